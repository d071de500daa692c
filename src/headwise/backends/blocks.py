"""Blocks of queries, each over only the keys it may see: the one loop of every runner that blocks.

``query_blocks(spec, rows)``: query rows r0..r1 and the keys c0..c1 they may see at all
(``visible``); queries that see no key get an empty key range, answered with zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .spec import Spec


class Block(NamedTuple):
    """Queries ``rows`` = (r0, r1) and the keys ``cols`` = (c0, c1) they may see (c0 == c1: none)."""

    rows: tuple[int, int]
    cols: tuple[int, int]


def visible(T: int, S: int, causal: bool, window: int | None, r0: int, r1: int) -> tuple[int, int]:
    """Keys c0..c1 that queries r0..r1 of T (the last T of S positions) may see at all.

    Causal cuts the keys after the last query's position, a window those before the first
    query's window; both ends clamp to 0..S, and c0 <= c1.
    """
    if not causal:
        return 0, S
    first = S - T  # the position of query 0
    c1 = max(0, min(S, first + r1))  # the last query's own position, + 1
    c0 = 0 if window is None else max(0, min(c1, first + r0 - window + 1))
    return c0, c1


def rows_per_block(T: int, row_elements: int, block_elements: int) -> int:
    """Query rows whose scores (``row_elements`` each, e.g. B * H * S) fit ``block_elements``; all T when they fit at once.

    All T is T itself, not a number computed from it: under ``torch.compile`` a symbolic T then
    makes one block, with no loop over a symbolic range.
    """
    row_elements = max(1, row_elements)
    return max(1, T) if T * row_elements <= block_elements else max(1, block_elements // row_elements)


def query_blocks(spec: Spec, rows: int) -> list[Block]:
    """Blocks of ``rows`` queries (the last one shorter) and the keys each may see; one empty block when T = 0."""
    if spec.T and rows >= spec.T:  # all T at once: no range over a symbolic T under compile (it would fix T: a graph a length)
        return [Block((0, spec.T), visible(spec.T, spec.S, spec.causal, spec.window, 0, spec.T))]
    starts = range(0, spec.T, rows) if spec.T else [0]
    return [Block((r0, min(spec.T, r0 + rows)), visible(spec.T, spec.S, spec.causal, spec.window, r0, min(spec.T, r0 + rows))) for r0 in starts]


def joined(contexts: list[Tensor]) -> Tensor:
    """The blocks' (B, H, t, Dv) contexts in order, as one (B, H, T, Dv)."""
    return contexts[0] if len(contexts) == 1 else torch.cat(contexts, dim=2)
