"""A tensor as small multiples: every matrix of it, one per index of its leading axes, side by side.

``matrices`` splits a tensor into those matrices; ``tensor_text`` lays them out as plain text
(the command line), ``_html.tensor_table`` as tables (a notebook). A (B, H, T, D) tensor shows
every head, a (B, T, H, D) view every token, so a reshaping step shows what moved where.

Example:
    >>> print(tensor_text(torch.arange(4.0).view(2, 1, 2), label=lambda i: f"head {i[0]}"))
    head 0          head 1
    0.0000 1.0000   2.0000 3.0000
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

#: A label for the matrix at an index of the leading axes, e.g. ``(0, 1) -> "head 1"``.
Label = Callable[[tuple[int, ...]], str]


def index_label(index: tuple[int, ...]) -> str:
    """The default label: the matrix's place, ``(0, 1) -> "[0, 1, :, :]"``."""
    return "[" + ", ".join([*map(str, index), ":", ":"]) + "]"


def matrices(t: Tensor, limit: int | None = None) -> Iterator[tuple[tuple[int, ...], Tensor]]:
    """Each matrix ``t[i, j, ..., :, :]`` with its index ``(i, j, ...)``, at most ``limit`` of them.

    A 2-D tensor is one matrix (index ``()``), a 1-D tensor one row, a scalar one cell.
    """
    if t.ndim < 2:
        yield (), t.reshape(1, -1)  # (1, N)
        return
    for index in itertools.islice(itertools.product(*map(range, t.shape[:-2])), limit):
        yield index, t[index]  # (R, C)


def number(v: float, infinity: str = "inf") -> str:
    """A float in 4 decimals, ``-inf`` / ``inf`` (or the ``infinity`` sign given) / ``nan`` spelled out."""
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "-" + infinity if v < 0 else infinity
    return f"{v:.4f}"


def _panel(title: str, matrix: Tensor, rows: int, cols: int) -> list[str]:
    """A matrix as lines of right-aligned numbers under its title (``...`` where cut)."""
    cells = [[number(v) for v in row[:cols]] + (["..."] if matrix.shape[1] > cols else []) for row in matrix[:rows].tolist()]
    if matrix.shape[0] > rows:
        cells.append(["..."])
    width = max(len(c) for row in cells for c in row)
    lines = [" ".join(c.rjust(width) for c in row) for row in cells]
    return [title, *lines] if title else lines


def _band(blocks: list[list[str]]) -> list[str]:
    """Blocks of equal-width lines side by side, three spaces apart."""
    height = max(len(b) for b in blocks)
    return ["   ".join(b[r] if r < len(b) else " " * len(b[0]) for b in blocks).rstrip() for r in range(height)]


def tensor_text(t: Tensor, *, label: Label | None = index_label, rows: int = 24, cols: int = 12, panels: int = 48, width: int = 100) -> str:
    """Every matrix of ``t`` as a block of numbers, as many side by side as fit in ``width`` characters.

    Args:
        t: any tensor; its last two axes are the rows and columns of each block.
        label: each block's title from its index (None: no titles).
        rows, cols: the most rows and columns printed of each block.
        panels: the most blocks printed; a line says how many were left out.
        width: the line width the blocks are laid out in.
    """
    t = t.detach().to("cpu", torch.float64)
    blocks = []
    for index, matrix in matrices(t, panels):
        lines = _panel(label(index) if label and index else "", matrix, rows, cols)
        w = max(len(s) for s in lines)
        blocks.append([s.ljust(w) for s in lines])
    out: list[str] = []
    row: list[list[str]] = []  # the blocks side by side on the current band of lines
    for block in blocks:
        if row and sum(len(b[0]) + 3 for b in row) + len(block[0]) > width:
            out += _band(row)
            row = []
        row.append(block)
    out += _band(row)
    total = math.prod(t.shape[:-2]) if t.ndim > 2 else 1
    if total > len(blocks):
        out.append(f"... {total - len(blocks)} more of shape {tuple(t.shape[-2:])} not shown")
    return "\n".join(out)
