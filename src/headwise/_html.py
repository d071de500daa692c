"""Small HTML pieces the rich displays share: escaping, a tensor's compact tables (every matrix of it), a heatmap,
a page in an ``<iframe srcdoc>``, and one scoped stylesheet.

Everything is plain text with inline styles: no script, nothing fetched, so it shows the same
in JupyterLab, the classic Notebook and VS Code, and in a saved notebook. Every text that comes
from data goes through ``escape``.

Example:
    >>> import torch
    >>> "<table" in heatmap(torch.eye(2), ["a", "b"], ["a", "b"])
    True
"""

from __future__ import annotations

import html
import math

import torch
from torch import Tensor

from . import _text
from ._text import Label, index_label, matrices

#: The stylesheet of every display, scoped to ``.headwise`` so that it cannot restyle the notebook.
CSS = """
.headwise { font: 13px/1.4 system-ui, sans-serif; color: #222; background: #fff; padding: 6px 8px; border-radius: 4px; }
.headwise h3, .headwise h4 { margin: 6px 0 4px; font-size: 14px; }
.headwise code { background: #f3f3f3; padding: 0 3px; border-radius: 3px; font-size: 12px; }
.headwise table.hw-t { border-collapse: collapse; margin: 2px 10px 6px 0; display: inline-table; vertical-align: top; }
.headwise table.hw-t td, .headwise table.hw-t th { padding: 1px 5px; text-align: right; font: 11px/1.3 ui-monospace, monospace; }
.headwise table.hw-t th { color: #666; font-weight: normal; }
.headwise table.hw-t caption { white-space: nowrap; font-size: 11px; color: #555; text-align: left; caption-side: top; }
.headwise td.hw-neginf { color: #999; }
.headwise .hw-multi { display: inline-block; vertical-align: top; margin: 2px 10px 6px 0; }
.headwise .hw-multi .hw-cap, .headwise .hw-more { font-size: 11px; color: #555; }
.headwise .hw-step { border-top: 1px solid #e5e5e5; padding: 4px 0; }
.headwise .hw-badge { display: inline-block; padding: 0 6px; border-radius: 3px; color: #fff; font-weight: 600; font-size: 12px; }
.headwise h4 .hw-note { font-weight: normal; }
.headwise [data-verdict="pass"] > h4 .hw-badge { background: #2e7d32; }
.headwise [data-verdict="fail"] > h4 .hw-badge { background: #c62828; }
.headwise .hw-problem { color: #c62828; }
.headwise ol.hw-steps { list-style: none; padding: 0; margin: 2px 0 4px; display: flex; flex-wrap: wrap; gap: 3px; }
.headwise ol.hw-steps li { font: 11px ui-monospace, monospace; padding: 1px 5px; border-radius: 3px; background: #eee; }
.headwise ol.hw-steps li[data-status="match"] { background: #e3f1e4; color: #1b5e20; }
.headwise ol.hw-steps li[data-status="skipped"] { background: #f1f1f1; color: #777; }
.headwise ol.hw-steps li[data-status="missing"] { background: #fbe3e3; color: #8e1b1b; }
.headwise ol.hw-steps li[data-first] { outline: 2px solid #c62828; }
.headwise dl { display: grid; grid-template-columns: max-content 1fr; gap: 1px 10px; margin: 2px 0; }
.headwise dt { color: #666; }
.headwise dd { margin: 0; font: 12px ui-monospace, monospace; white-space: pre-wrap; }
.headwise dd.hw-hint { font-family: system-ui, sans-serif; color: #0d47a1; }
"""


NEGINF_CELL = '<td class="hw-neginf">-∞</td>'


def escape(value: object) -> str:
    """Text as HTML (quotes too, so it can sit in an attribute)."""
    return html.escape(str(value), quote=True)


def block(kind: str, body: str, **data: object) -> str:
    """A display's outer ``<div class="headwise headwise-KIND">`` with its stylesheet and ``data-*`` attributes."""
    attrs = "".join(f' data-{k.replace("_", "-")}="{escape(v)}"' for k, v in data.items())
    return f'<div class="headwise headwise-{kind}"{attrs}><style>{CSS}</style>{body}</div>'


def number(v: float) -> str:
    """A float in 4 decimals, ``-∞`` / ``∞`` / ``nan`` spelled out."""
    return _text.number(v, "∞")


def _matrix_table(matrix: Tensor, caption: str, rows: int, cols: int, attrs: str) -> str:
    """One (R, C) matrix as a table of up to ``rows`` x ``cols`` numbers (``…`` / ``⋮`` where cut)."""
    body = []
    for r in range(min(matrix.shape[0], rows)):
        values = matrix[r, :cols].tolist()
        cells = "".join((NEGINF_CELL if v == -math.inf else f"<td>{number(v)}</td>") for v in values)
        more = "<td>…</td>" if matrix.shape[1] > cols else ""
        body.append(f"<tr>{cells}{more}</tr>")
    if matrix.shape[0] > rows:
        body.append(f'<tr><td colspan="{min(matrix.shape[1], cols)}">⋮</td></tr>')
    return f'<table class="hw-t"{attrs}><caption>{caption}</caption>{"".join(body)}</table>'


def tensor_table(name: str, t: Tensor, *, label: Label = index_label, axes: str = "", rows: int = 6, cols: int = 8, panels: int = 12) -> str:
    """A tensor as small tables: one matrix (a 1-D or 2-D tensor, or (1, R, C)) in one table (up to ``rows`` x ``cols``);
    a larger one as small multiples, one table per matrix ``t[i, j, ..., :, :]`` (up to ``panels``),
    each captioned by ``label(index)`` (e.g. ``head 1``), inside a ``<div>`` whose caption gives the
    name, the shape and its ``axes`` (e.g. ``(b, num_heads, num_tokens, head_dim)``)."""
    t = t.detach().to("cpu", torch.float64)
    shape = tuple(t.shape)
    data = f' data-tensor="{escape(name)}" data-shape="{escape(list(shape))}"'
    head = f"<code>{escape(name)}</code> {escape(shape)}" + (f" = {escape(axes)}" if axes else "")
    if t.ndim <= 2 or math.prod(shape[:-2]) == 1:  # one matrix: one table
        return _matrix_table(t.reshape(1, -1) if t.ndim < 2 else t.reshape(shape[-2:]), head, rows, cols, data)
    tables = [_matrix_table(m, escape(label(i)), rows, cols, f' data-index="{escape(list(i))}"') for i, m in matrices(t, panels)]
    total = math.prod(shape[:-2])
    more = f'<span class="hw-more">… {total - len(tables)} more</span>' if total > len(tables) else ""
    return f'<div class="hw-multi"{data}><div class="hw-cap">{head}</div>{"".join(tables)}{more}</div>'


def colour(v: float) -> str:
    """A weight in [0, 1] as a shade of blue (white at 0), the heads page's scale."""
    v = min(max(v, 0.0), 1.0)
    r, g, b = (round(255 + (c - 255) * v) for c in (8, 48, 107))
    return f"rgb({r}, {g}, {b})"


def heatmap(weights: Tensor, rows: list[str], cols: list[str], *, caption: str = "", cell: int = 18) -> str:
    """A (T, S) matrix of weights in [0, 1] as a table of coloured cells, row and column labels at the sides;
    each cell's ``title`` holds its value."""
    w = weights.detach().to("cpu", torch.float64)
    head = "<tr><th></th>" + "".join(f'<th style="writing-mode: vertical-rl; transform: rotate(180deg)">{escape(c)}</th>' for c in cols) + "</tr>"
    body = []
    for i, label in enumerate(rows):
        cells = "".join(
            f'<td title="{escape(label)} → {escape(cols[j])}: {number(v)}" style="background: {colour(v)}; width: {cell}px; height: {cell}px; padding: 0"></td>'
            for j, v in enumerate(w[i].tolist())
        )
        body.append(f"<tr><th>{escape(label)}</th>{cells}</tr>")
    cap = f"<caption>{caption}</caption>" if caption else ""
    return f'<table class="hw-t hw-heat" data-shape="{escape(list(w.shape))}">{cap}{head}{"".join(body)}</table>'


def iframe(page: str, *, title: str, height: int) -> str:
    """A whole HTML page shown inside an ``<iframe srcdoc>``: its script and styles stay in the frame,
    and ``sandbox="allow-scripts"`` keeps it from reaching the notebook around it."""
    return (f'<iframe srcdoc="{escape(page)}" title="{escape(title)}" sandbox="allow-scripts" '
            f'style="width: 100%; height: {height}px; border: 1px solid #ddd; border-radius: 4px"></iframe>')
