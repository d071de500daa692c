"""Tensors made from weights (oneDNN's packed layout, the panels GEMM's, Q/K/V stacked into one), kept until a weight changes.

An entry is keyed by the ids of the tensors it was made from and remembers their state: storage
pointer, ``_version`` (bumped by in-place writes: optimizer steps, ``load_state_dict``), shape,
strides and dtype. A lookup that finds another state makes the entry again; the entry dies with
its tensors. Under ``torch.distributed`` nothing is kept: FSDP2 refills its unsharded weights in
place, at the same address, without bumping ``_version``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

PACKED: dict[tuple[int], tuple] = {}  # (id(weight),) -> (its state, the weight in oneDNN's blocked layout)
STACKED: dict[tuple[int, ...], tuple] = {}  # ids of weights and biases -> (their state, what was stacked from them)
PANELS: dict[torch.dtype, dict] = {}  # rows' dtype -> {(id(weight),): (its state, the weight packed in panels for such rows)}
READY: dict[tuple, object] = {}  # (ids of layers, x's dtype and device, path setting) -> projection.Ready, a decode call decided once


def watchable() -> bool:
    """Whether a weight's storage pointer and ``_version`` tell every change (not under torch.distributed)."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def state(tensors: Sequence[Tensor]) -> tuple:
    """What changes when any of ``tensors`` is written or replaced."""
    return tuple([(t.data_ptr(), t._version, t.shape, t.stride(), t.dtype) for t in tensors])


def cached(cache: dict, owners: Sequence[Tensor], make: Callable[[], object]) -> Any:
    """``make()``'s value for these tensors, made again whenever any of them changed; the entry dies with them."""
    if not watchable():
        return make()
    ids, now = tuple(map(id, owners)), state(owners)
    entry = cache.get(ids)
    if entry is None:
        for t in owners:
            weakref.finalize(t, cache.pop, ids, None)
    if entry is None or entry[0] != now:
        entry = cache[ids] = (now, make())
    return entry[1]
