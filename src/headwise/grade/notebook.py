"""A Jupyter notebook's code cells, read from its JSON with the standard library (no nbformat), run in order.

The cells run one after the other in one module, as "Run All" runs them. IPython's own syntax
is not Python: a line magic (``%matplotlib inline``) or a shell line (``!pip install x``)
becomes ``pass``, so the lines below it keep their numbers; a cell magic whose body is Python
(``%%time``, ``%%capture``) runs its body, any other (``%%bash``, ``%%html``...) is skipped.
``display`` exists as in IPython (it prints, and the grader ignores what is printed).

Each cell is compiled under a file name of its own and kept in ``linecache``, as IPython keeps
its cells, so a traceback shows the cell's lines; ``CELLS`` says how an error names a cell:
``mine.ipynb, cell 4`` (its place among all the notebook's cells), or the label a cell carries
in its metadata (``{"headwise": {"label": "Cell In[5]"}}``, as the grader writes classes it carries).

Example:
    >>> cells = [Cell("a cell", "%matplotlib inline\\nx = 1")]
    >>> namespace = {}
    >>> run(cells, namespace, "example.ipynb")
    >>> namespace["x"]
    1
"""

from __future__ import annotations

import json
import linecache
import re
from dataclasses import dataclass
from pathlib import Path

#: Compiled cell file name -> how an error names the cell.
CELLS: dict[str, str] = {}
PYTHON_CELL_MAGICS = ("time", "timeit", "capture", "prun")


class NotebookError(ValueError):
    """The file is not a notebook this module can read."""


@dataclass(frozen=True)
class Cell:
    """One code cell: how an error names it, and its text."""

    label: str
    source: str


def read(path: Path) -> list[Cell]:
    """The code cells of the ``.ipynb`` file at ``path`` (nbformat 4), in order.

    Raises:
        NotebookError: not JSON, or not a notebook of format 4.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotebookError(f"cannot read {path.name} as a notebook: {e}") from None
    if not (isinstance(data, dict) and isinstance(data.get("cells"), list)):
        version = data.get("nbformat") if isinstance(data, dict) else None
        old = f" (it says nbformat {version}: open it in Jupyter and save it again)" if version not in (None, 4) else ""
        raise NotebookError(f"{path.name} is not a Jupyter notebook of format 4, a JSON object with a list of cells{old}")
    cells = []
    for number, cell in enumerate(data["cells"], 1):
        if not (isinstance(cell, dict) and cell.get("cell_type") == "code"):
            continue
        source = cell.get("source", "")
        source = "".join(source) if isinstance(source, list) and all(isinstance(s, str) for s in source) else source
        if not isinstance(source, str):
            raise NotebookError(f"{path.name}, cell {number}: its source is a {type(source).__name__}, not text")
        meta = cell.get("metadata")
        mine = meta.get("headwise") if isinstance(meta, dict) else None
        label = mine.get("label") if isinstance(mine, dict) and isinstance(mine.get("label"), str) else f"{path.name}, cell {number}"
        cells.append(Cell(label, source))
    return cells


def write(cells: list[Cell], path: Path) -> None:
    """Save ``cells`` as a notebook whose cells keep their labels."""
    data = {"cells": [{"cell_type": "code", "execution_count": None, "metadata": {"headwise": {"label": c.label}}, "outputs": [],
                       "source": c.source} for c in cells], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def run(cells: list[Cell], namespace: dict, name: str) -> None:
    """Run ``cells`` in order in ``namespace``; ``name`` (the notebook's path) makes each cell's file name.

    Raises:
        whatever a cell raises (a ``SyntaxError`` too), with the cell's file name in its traceback.
    """
    namespace.setdefault("display", _display)
    for number, cell in enumerate(cells, 1):
        filename = f"{name}#cell{number}"
        CELLS[filename] = cell.label
        code = _compile(cell.source, filename)
        if code is not None:
            exec(code, namespace)


#: An assignment of a magic's or a shell line's value: the names assigned to, kept (given None).
MAGIC_VALUE = re.compile(r"^(\s*[\w.\[\], ]+?\s*=\s*)[%!]")


def _compile(source: str, filename: str):
    """The cell as Python: IPython's magics, shell lines and help (``obj?``) made ``pass``, an assignment of a magic's or
    a shell line's value made ``None`` (each found where Python stops reading)."""
    lines = source.splitlines(True)
    first = lines[0].strip() if lines else ""
    if first.startswith("%%"):
        if (first[2:].split() or [""])[0] not in PYTHON_CELL_MAGICS:
            return None
        lines[0] = "\n"
    for _ in range(len(lines) + 1):
        text = "".join(lines)
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        try:
            return compile(text, filename, "exec")
        except SyntaxError as e:
            at = (e.lineno or 0) - 1
            line = lines[at] if 0 <= at < len(lines) else ""
            stripped = line.lstrip()
            indent = line[: len(line) - len(stripped)]
            if stripped.startswith(("%", "!", "?")) or stripped.rstrip().endswith("?"):  # a magic, a shell line, help (obj?)
                lines[at] = indent + "pass\n"
            elif (assigned := MAGIC_VALUE.match(line)) is not None:  # files = !ls, t = %timeit -o f()
                lines[at] = assigned.group(1) + "None\n"
            else:
                raise
    raise AssertionError("unreachable: every pass replaces one more magic line")


def _display(*objects: object, **_: object) -> None:
    for obj in objects:
        print(repr(obj))
