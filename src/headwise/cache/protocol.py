"""What the core reads from a cache, whatever its kind (``Cache``), and what ``append`` answers (``Attended``).

- ``start(t, attention_mask)``: where the ``t`` new tokens sit: one int for every row (the static
  cache), or position ids: (B, T) once padding was written (each row's real tokens counted), (1, T)
  when the row packs tokens of several sequences (a paged batch);
- ``check_owner(owner)`` / ``bind(owner)``: a cache belongs to one attention module (``owner.py``);
- ``sizes(t)``: ``[(rows, S)]``, what ``append`` of t tokens will answer with, before anything is
  written: the core checks every term against them first, so that a refused call changes nothing;
- ``append(k, v, attention_mask)``: store the new keys and values (and their padding), and answer
  with ``Attended`` runs: the queries in ``rows`` (a slice of the T axis) attend over ``keys`` /
  ``values`` with ``attention_mask``; one run for a static cache, one per sequence for a paged
  batch (ragged). Keys come in time order, except that a sliding cache may answer one new token
  with its slots in ring order; ``in_order=True`` (what ALiBi and documents need) asks for time order;
- ``padded``: whether its answers carry a padding mask (any write came with one);
- ``window``: the window the stored keys were kept for (a ring buffer), or None;
- ``dtype``: what it takes and answers: the keys' dtype, or bfloat16 under float32 keys (``attention`` rounds them and
  attends in bfloat16, the context back in float32); an 8-bit ``KVCache`` says float32 (it stores 8-bit rows and
  answers with them read back).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
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
    padded: bool

    @property
    def dtype(self) -> torch.dtype: ...

    def start(self, t: int, attention_mask: Tensor | None = None) -> int | Tensor: ...

    def check_owner(self, owner: object) -> None: ...

    def bind(self, owner: object) -> None: ...

    def sizes(self, t: int, *, in_order: bool = False) -> list[tuple[slice, int]]: ...

    def check_append(self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None) -> None: ...

    def append(self, k: Tensor, v: Tensor, attention_mask: Tensor | None, *, in_order: bool = False) -> list[Attended]: ...
