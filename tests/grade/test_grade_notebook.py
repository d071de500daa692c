"""Grading a notebook file: its code cells run in order (as "Run All" runs them), then its classes are graded.

The notebooks are written here as JSON, the way Jupyter saves them (nbformat 4); most tests run
the grading worker in this process, the command line ones start the real grading process.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from test_grade_live import ADD_TO_CLASS, BOOK, method

import headwise as hw
from headwise.cli import main as cli_main
from headwise.grade import grade
from headwise.grade import hints as H
from headwise.grade.worker import run as worker_run

LEARNERS = Path(__file__).parent / "learners"


def ipynb(folder: Path, *cells: str, name: str = "mine.ipynb") -> Path:
    """A notebook of these cells: a cell starting with ``# md`` is markdown, the others code (source as a list of lines, as Jupyter saves it)."""
    data = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": c} if c.startswith("# md") else
                      {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": c.splitlines(True)}
                      for c in cells], "metadata": {"kernelspec": {"name": "python3"}}, "nbformat": 4, "nbformat_minor": 5}
    path = folder / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def results(tmp_path: Path, path: Path) -> dict:
    """Run the worker in this process: each class's result, or the problem."""
    sent: list[dict] = []
    worker_run(str(path), str(tmp_path), [], sent.append)
    problem = [e["problem"] for e in sent if "problem" in e]
    return {"problem": problem[0]} if problem else {e["result"]["class"]: e["result"] for e in sent if "result" in e}


@pytest.mark.slow
def test_the_books_notebook_passes_and_a_wrong_one_fails_with_a_hint_on_the_command_line(tmp_path, capsys):
    head, classes = BOOK.split("class CausalAttention", 1)
    good = ipynb(tmp_path, "# md\n# Chapter 3", "%matplotlib inline\n" + head, "class CausalAttention" + classes, name="book.ipynb")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["grade", str(good)])
    out = capsys.readouterr().out
    assert exit_.value.code == 0, out
    assert out.endswith("3 of 3 classes passed.\n")
    wrong = ipynb(tmp_path, "import torch\nimport torch.nn as nn", (LEARNERS / "no_scaling.py").read_text(), name="wrong.ipynb")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["grade", str(wrong)])
    out = capsys.readouterr().out
    assert exit_.value.code == 1, out
    assert "MultiHeadAttention: FAIL at step `weights`" in out and f"hint:         {H.NO_SCALE}" in out
    report = hw.grade(good)  # the package's own attribute: a notebook's path, as a Path
    assert (report.file, report.exit_code) == (str(good), 0)


def test_magics_and_shell_lines_are_left_out_and_display_exists(tmp_path):
    path = ipynb(tmp_path, "%%bash\necho this is not Python", "%load_ext autoreload\n!pip list\nimport torch\nimport torch.nn as nn",
                 "%%time\n" + BOOK.split('"""', 2)[2], "if True:\n    %time x = 1\ndisplay(mha)")
    found = results(tmp_path, path)
    assert [(name, r["passed"]) for name, r in found.items()] == [
        ("CausalAttention", True), ("MultiHeadAttentionWrapper", True), ("MultiHeadAttention", True)]


def test_ipythons_assigned_magics_and_help_lines_are_left_out_too(tmp_path):
    """``files = !ls``, ``t = %timeit -o ...`` and ``obj?`` run in Jupyter: the notebook is graded around them."""
    path = ipynb(tmp_path, "import torch\nimport torch.nn as nn\nfiles = !ls\nt = %timeit -o -n1 sum([1])\ntorch.nn.Linear?\n?torch.nn\n"
                 "assert files is None and t is None",
                 BOOK.split('"""', 2)[2])
    found = results(tmp_path, path)
    assert [(name, r["passed"]) for name, r in found.items()] == [
        ("CausalAttention", True), ("MultiHeadAttentionWrapper", True), ("MultiHeadAttention", True)]


def test_a_cell_that_raises_stops_the_notebook_and_is_named_with_its_line(tmp_path):
    path = ipynb(tmp_path, "# md\nintro", "import torch", "x = torch.ones(2)\ny = x @ torch.ones(3)")
    problem = results(tmp_path, path)["problem"]
    assert problem.startswith(f"importing {path} raised: mine.ipynb, cell 3, line 2: y = x @ torch.ones(3)  RuntimeError:")
    path = ipynb(tmp_path, "import torch", "def f(:\n    pass", name="broken.ipynb")
    assert results(tmp_path, path)["problem"] == (f"importing {path} raised: broken.ipynb, cell 2, line 1: def f(:  SyntaxError: invalid syntax")


def test_a_class_that_raises_in_a_notebook_is_shown_at_its_cell_and_line(tmp_path):
    path = ipynb(tmp_path, "import torch\nimport torch.nn as nn", (LEARNERS / "crash.py").read_text())
    r = results(tmp_path, path)["MultiHeadAttention"]
    assert (r["step"], r["line"], r["code"]) == ("error", "mine.ipynb, cell 2, line 31", "attn_scores = queries @ self.keys.transpose(2, 3)")


def test_a_file_that_is_not_a_notebook_says_so(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    assert results(tmp_path, bad)["problem"].startswith("cannot read bad.ipynb as a notebook: Expecting property name")
    bad.write_text(json.dumps({"nbformat": 3, "worksheets": []}))
    assert results(tmp_path, bad)["problem"] == ("bad.ipynb is not a Jupyter notebook of format 4, a JSON object with a list of cells "
                                                 "(it says nbformat 3: open it in Jupyter and save it again)")
    report = grade(tmp_path / "missing.ipynb")
    assert report.exit_code == 2 and report.problem == f"no such file: {tmp_path / 'missing.ipynb'}"


def test_the_classes_a_notebook_leaves_are_graded_exec_patches_and_add_to_class_included(tmp_path):
    remade = ipynb(tmp_path, BOOK, f"exec({(LEARNERS / 'no_scaling.py').read_text()!r})", name="remade.ipynb")
    assert results(tmp_path, remade)["MultiHeadAttention"]["hint"] == H.NO_SCALE
    patched = ipynb(tmp_path, BOOK, method("no_scaling", "forward").replace("def forward(", "def unscaled(") +
                    "\nMultiHeadAttention.forward = unscaled", name="patched.ipynb")
    assert results(tmp_path, patched)["MultiHeadAttention"]["hint"] == H.NO_SCALE
    added = ipynb(tmp_path, "import torch\nfrom torch import nn\n\n" + ADD_TO_CLASS,
                  "class MultiHeadAttention(nn.Module):\n" + textwrap.indent(method("book", "__init__"), "    "),
                  "@add_to_class(MultiHeadAttention)\n" + method("book", "forward"), name="added.ipynb")
    assert results(tmp_path, added)["MultiHeadAttention"]["passed"]


@pytest.mark.slow
def test_a_notebook_that_loops_while_running_its_cells_is_stopped_at_its_line(tmp_path):
    path = ipynb(tmp_path, "import torch", "while True: pass")
    report = grade(path, timeout=3)
    assert report.exit_code == 2
    assert report.problem == ("stopped after 3 s while importing the file, at mine.ipynb, cell 2, line 1 (`while True: pass`): "
                              "an endless loop, or far too slow")
