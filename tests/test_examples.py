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


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "/nonexistent"], "--model must be a HuggingFace directory with config.json, weights and tokenizer.json, got /nonexistent"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a positive int, got 0"),
])
def test_generate_text_names_a_bad_argument_in_one_line(args, message):
    """A bad argument is the parser's one-line error (exit code 2), before any training or loading: no traceback."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "generate_text.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--ids", "a,b"], "--ids must be comma-separated token ids, got 'a,b'"),
    (["--max-new-tokens", "-1"], "argument --max-new-tokens: expected a positive int, got -1"),
    (["--top-k", "0"], "argument --top-k: expected a positive int, got 0"),
    (["--model", "/nonexistent"], "--model must be a HuggingFace GPT-2 directory with config.json, got /nonexistent"),
])
def test_the_tensor_parallel_demo_checks_its_arguments_before_joining_a_group(args, message, capsys):
    """Checked before the process group (no torchrun needed to be told), each a one-line error naming the flag."""
    from headwise.parallel import demo

    with pytest.raises(SystemExit) as exit_:
        demo.main(args)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
