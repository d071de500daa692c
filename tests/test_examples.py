"""The scripts in examples/ run as a user runs them, offline, and print what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("tokenizers", reason="the [models] extra brings tokenizers")


@pytest.mark.slow
def test_generate_text_learns_the_zen_and_continues_its_lines():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "generate_text.py")], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("trained a 400-token byte-level BPE and a 2-layer GPT-2 on the Zen of Python")
    assert "\nBeautiful is better than ugly.\nExplicit is better than implicit.\n" in out.stdout
    assert "\nErrors should never pass silently.\n" in out.stdout
