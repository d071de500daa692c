"""Every block of the pages under docs/ runs as written and prints what the page shows (the rules:
tests/snippets.py), every page is in mkdocs.yml's navigation, and every included file and section exists.

``make docs`` builds the site strictly (links, anchors, the API reference); these tests need no mkdocs.
"""

from __future__ import annotations

import re

import pytest
import yaml
from snippets import ROOT, blocks, params, run

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BLOCKS = [b for page in PAGES for b in blocks(page)]


@pytest.mark.parametrize("block", params(BLOCKS))
def test_docs_block(block, tmp_path, monkeypatch, capsys):
    run(block, tmp_path, monkeypatch, capsys)


def _nav_pages(entry) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    if isinstance(entry, list):
        return [p for e in entry for p in _nav_pages(e)]
    return [p for value in entry.values() for p in _nav_pages(value)]


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    files = {str(p.relative_to(DOCS)) for p in [*PAGES, DOCS / "tutorial.ipynb"]}
    assert not files - set(nav), f"pages missing from mkdocs.yml's nav: {sorted(files - set(nav))}"
    assert not set(nav) - files, f"nav entries without a page: {sorted(set(nav) - files)}"
    assert len(nav) >= 8


def test_every_include_exists():
    """A ``--8<-- "FILE"`` or ``"FILE:SECTION"`` line names a file (relative to the repository root) and a section it marks."""
    includes = [(page, m.group(1)) for page in PAGES for m in re.finditer(r'^--8<-- "([^"]+)"', page.read_text(encoding="utf-8"), flags=re.M)]
    assert includes, "the design page and the changelog include their files"
    for page, target in includes:
        name, _, section = target.partition(":")
        assert (ROOT / name).is_file(), f"{page.relative_to(ROOT)} includes {name}, which does not exist"
        if section:
            text = (ROOT / name).read_text(encoding="utf-8")
            assert f"--8<-- [start:{section}]" in text and f"--8<-- [end:{section}]" in text, f"{name} has no section {section!r}"


def test_the_output_rule():
    """Shown output must equal what was printed, line by line; ``...`` stands for any lines, and nothing else does."""
    from snippets import matches

    assert matches("a\n...\nd\n", "a\nb\nc\nd\n")
    assert matches("...\nc\n...", "a\nb\nc\nd")
    assert matches("a  \nb", "a\nb\n")
    assert not matches("a\nd", "a\nb\nd")
    assert not matches("a\n...\nc", "a\nb\nd")
    assert not matches("tensor([1.0000])", "tensor([1.0001])")
