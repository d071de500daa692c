"""Grading a file in its own process: time limit, crashes at import, empty and broken files, the CLI.

Each subprocess starts Python and torch (seconds on a busy machine), so only the cases that
need a real process run one; the rest call the worker in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from llms_from_scratch import ch03 as book

from headwise.cli import main as cli_main
from headwise.grade import grade
from headwise.grade.worker import run as worker_run

LEARNERS = Path(__file__).parent / "learners"
SRC = str(Path(__file__).parents[2] / "src")


def events(tmp_path: Path, target: str, *names: str) -> list[dict]:
    """Run the worker in this process and keep what it sent."""
    sent: list[dict] = []
    worker_run(target, str(tmp_path), list(names), sent.append)
    return sent


def test_a_syntax_error_is_shown_at_its_line(tmp_path):
    (problem,) = [e["problem"] for e in events(tmp_path, str(LEARNERS / "syntax_error.py")) if "problem" in e]
    assert problem.endswith("syntax_error.py raised: syntax_error.py:7: def forward(self, x)  SyntaxError: expected ':'")


def test_an_empty_file_says_what_it_looked_for(tmp_path):
    (problem,) = [e["problem"] for e in events(tmp_path, str(LEARNERS / "empty.py")) if "problem" in e]
    assert "defines no class named CausalAttention, MultiHeadAttentionWrapper, MultiHeadAttention (classes defined there: none)" in problem


def test_a_book_class_that_is_not_a_module_is_named_as_such(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text("class MultiHeadAttention:\n    def __init__(self, d_in, d_out, context_length, dropout, num_heads):\n        pass\n")
    (problem,) = [e["problem"] for e in events(tmp_path, str(path)) if "problem" in e]
    assert f"{path} defines MultiHeadAttention, but not as a torch.nn.Module: the book's classes start class MultiHeadAttention(nn.Module)" in problem


def test_an_import_that_raises_points_at_the_learners_line(tmp_path):
    path = tmp_path / "notebook.py"
    path.write_text("import torch\n\nmha = MultiHeadAttention(3, 2, 6, 0.0, 2)\n")
    (problem,) = [e["problem"] for e in events(tmp_path, str(path)) if "problem" in e]
    assert problem.startswith(f"importing {path} raised: notebook.py:3: mha = MultiHeadAttention(3, 2, 6, 0.0, 2)  NameError:")


def test_a_class_asked_for_by_name_that_is_missing_lists_what_is_there(tmp_path):
    (problem,) = [e["problem"] for e in events(tmp_path, str(LEARNERS / "einsum.py"), "MHA") if "problem" in e]
    assert problem.endswith("einsum.py has no nn.Module class named MHA (classes defined there: MultiHeadAttention)")


def test_the_worker_writes_found_started_result_in_order(tmp_path):
    kinds = [next(iter(e)) for e in events(tmp_path, str(LEARNERS / "wrapper_cat_dim.py"))]
    assert kinds == ["ready", "found", "started", "result", "started", "result", "done"]


# ----------------------------------------------------------------------------- real processes


@pytest.mark.slow
def test_a_hang_is_stopped_and_the_other_classes_are_still_graded():
    report = grade(LEARNERS / "hang.py", timeout=3)
    assert [(r.name, r.passed, r.step) for r in report.results] == [("MultiHeadAttention", False, "error"), ("CausalAttention", True, None)]
    assert report.results[0].error == "stopped after 3 s: an endless loop, or far too slow"
    stopped = report.results[0]
    assert (stopped.line, stopped.code) in {("hang.py:14", "while steps >= 0:  # an off-by-one loop that never ends"), ("hang.py:15", "steps += 1")}
    assert f"MultiHeadAttention: FAIL at {stopped.line}" in report.to_text()
    assert report.exit_code == 1


@pytest.mark.slow
def test_a_file_that_kills_the_interpreter_is_reported(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import os\n\nos._exit(3)\n")
    report = grade(path)
    assert report.exit_code == 2
    assert report.problem == ("the grading process ended with exit code 3 while importing the file: "
                              "the code called os._exit() (or something ended the interpreter) and printed no error")


def cli(*args: str, cwd: Path = LEARNERS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headwise.cli", "grade", *args], capture_output=True, text=True, cwd=cwd, env={"PYTHONPATH": SRC}, timeout=300)


@pytest.mark.slow
def test_cli_json_for_a_passing_file_exits_0():
    proc = cli("book.py", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["file"] == "book.py" and data["problem"] is None
    assert [(r["class"], r["passed"], r["step"], r["hint"]) for r in data["results"]] == [
        ("CausalAttention", True, None, None), ("MultiHeadAttentionWrapper", True, None, None), ("MultiHeadAttention", True, None, None)
    ]


@pytest.mark.slow
def test_cli_text_for_a_module_path_with_a_mistake_exits_1():
    proc = cli("learners.swapped_qk", "--class", "MultiHeadAttention", cwd=LEARNERS.parent)
    assert proc.returncode == 1, proc.stderr
    assert "MultiHeadAttention: FAIL at step `scores`" in proc.stdout
    assert "hint:         keys and queries are swapped" in proc.stdout


def test_cli_exits_2_when_nothing_could_be_graded(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["grade", str(tmp_path / "missing.py")])
    assert exit_.value.code == 2
    assert capsys.readouterr().out.splitlines()[-1] == f"  nothing graded: no such file: {tmp_path / 'missing.py'}"


# ----------------------------------------------------------------------------- arguments


def test_bad_arguments_raise_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds, got 0"):
        grade(book.MultiHeadAttention, timeout=0)
    with pytest.raises(TypeError, match=r"path_or_class must be a file path, a module path, a class or a list of classes, got int"):
        grade(3)
    with pytest.raises(TypeError, match=r"classes must be a list of class names \(str\), got 'MultiHeadAttention'"):
        grade("x.py", classes="MultiHeadAttention")
    report = grade(tmp_path / "missing.py")
    assert report.exit_code == 2 and report.problem == f"no such file: {tmp_path / 'missing.py'}"
