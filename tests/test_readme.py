"""Every block of README.md runs as written and prints what the README shows (the rules: tests/snippets.py),
the README stays short, and its links point at files that exist."""

from __future__ import annotations

import re

import pytest
from snippets import ROOT, blocks, params, run

README = ROOT / "README.md"
BLOCKS = blocks(README)


def test_the_readme_has_quickstarts_that_print():
    shown = [b for b in BLOCKS if not b.skip and (b.output is not None or b.label == "console")]
    assert len(shown) >= 3, [b.name for b in shown]  # the two quickstarts' Python and the grade command


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 300, f"README.md has {lines} lines: move details into docs/ (at most 300)"


@pytest.mark.parametrize("block", params(BLOCKS))
def test_readme_block(block, tmp_path, monkeypatch, capsys):
    run(block, tmp_path, monkeypatch, capsys)


def test_readme_links_exist():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"
