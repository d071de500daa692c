"""What the core reads from a cache, whatever its kind.

A cache answers two questions for the layer and one for ``attention``:

- ``start(t)``: where the ``t`` new tokens sit: one int for every row (the static cache: the
  first new token's position), or (1, T) position ids when the row packs tokens of several
  sequences (the paged cache's batch: each sequence continues from its own length);
- ``check_owner(owner)`` / ``bind(owner)``: a cache belongs to one attention module (the first
  refuses, changing nothing, a cache of another module; the second ties it, after its first write);
- ``sizes(t)``: ``[(rows, S)]``, what ``append`` of t tokens will answer with, before anything is
  written: the core checks every term against them first, so that a refused call changes nothing;
- ``append(k, v, attention_mask)``: store the new keys and values (and their padding), and say
  what to attend over, as a list of ``Attended``: the queries in ``rows`` (a slice of the T axis)
  attend over ``keys`` / ``values`` with ``attention_mask``. A static cache answers with one
  covering every query; a paged batch with one per sequence (ragged: no padding to the longest).
  Keys come in time order, except that a sliding cache may answer one new token with its slots
  in ring order; ``in_order=True`` (what ALiBi and documents need) asks for time order always.

``window`` is the window the stored keys were kept for (a ring buffer), or None.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from torch import Tensor


class Attended(NamedTuple):
    """Queries ``q[:, :, rows]`` attend over keys (B, Hkv, S, D), values (B, Hkv, S, Dv), padding (B, S) or None."""

    rows: slice
    keys: Tensor
    values: Tensor
    attention_mask: Tensor | None


class Cache(Protocol):
    """The one protocol ``attention`` and ``AttentionLayer`` read (``KVCache``, ``PagedBatch``)."""

    window: int | None

    def start(self, t: int) -> int | Tensor: ...

    def check_owner(self, owner: object) -> None: ...

    def bind(self, owner: object) -> None: ...

    def sizes(self, t: int, *, in_order: bool = False) -> list[tuple[slice, int]]: ...

    def append(self, k: Tensor, v: Tensor, attention_mask: Tensor | None, *, in_order: bool = False) -> list[Attended]: ...

