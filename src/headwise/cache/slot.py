"""``SlotCache``: a ``KVCache`` seen by a decode step whose shapes never change, so that it can be
captured once (a CUDA graph) and replayed for every token.

An eager step reads the cache's first ``len(cache)`` positions, a length the host knows and the
shapes carry: a captured step would replay the length it was captured with. Here the new token's
index lives in a device tensor (``count``), the write goes to that slot (``index_copy_``), and every
step reads the whole buffer with a (B, L) mask: the slots written so far that hold real tokens. A
masked key weighs exactly zero, so the context is attention over the written keys.

A ring (``KVCache.sliding``) writes slot ``count % window``; once full, every slot is in the window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .protocol import Attended
from .static import KVCache


class SlotCache(KVCache):
    """``cache``'s buffers (shared, not copied), written one token a row at the slot ``count`` says.

    Args:
        cache: the ``KVCache`` whose buffers the step writes and reads.
        count: (1,) int64 on the cache's device: how many tokens the cache holds before this step's
            write (the new token's index). The caller sets it before every step; nothing here reads
            it on the host, and ``len(cache)`` stays what it was (the caller counts the steps).
    """

    def __init__(self, cache: KVCache, count: Tensor) -> None:
        if cache.rows8:
            raise ValueError("a SlotCache (generate's cuda_graph step) reads float32 or bfloat16 rows; this cache holds "
                             "8-bit rows (dtype=torch.int8)")
        self.k, self.v, self.is_token, self.window = cache.k, cache.v, cache.is_token, cache.window  # (B, Hkv, L, D) x2, (B, L)
        self.count = count  # (1,)
        self.slots = torch.arange(cache.k.shape[2], device=cache.k.device)  # (L,)
        self._padded, self._len, self._graph = True, len(cache), None  # every answer carries its mask
        self._pads = None  # positions: the caller's (``start`` is the count of steps it was made at)

    def sizes(self, t: int, *, in_order: bool = False) -> list[tuple[slice, int]]:
        return [(slice(None), self.k.shape[2])]  # every query over the whole buffer, masked

    def append(
        self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None, *, in_order: bool = False, check: bool = True
    ) -> list[Attended]:
        """Write one new token a row at slot ``count`` (ring: ``count % window``); answer the whole buffer and
        its (B, L) mask of written, real slots. One token, no padding, no autograd, no time order: those are
        what a replayed decode step can be."""
        if k.shape[2] != 1 or attention_mask is not None or (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)):
            raise ValueError("a SlotCache takes one new token a row, without padding or autograd (a decode step)")
        if in_order and self.window is not None:
            raise ValueError("a SlotCache cannot answer a ring in time order (ALiBi, documents): replay the step eagerly")
        if check:  # the keys' and values' shapes, dtype and device, before either is written (nothing read on the host)
            self._check(k, v, None)
        slot = self.count if self.window is None else self.count % self.window  # (1,)
        self.k.index_copy_(2, slot, k)
        self.v.index_copy_(2, slot, v)
        self.is_token.index_fill_(1, slot, True)  # a ring's slot may have held a padded position
        seen = self.is_token & (self.slots <= self.count)  # (B, L): written (a full ring: every slot) and real
        return [Attended(slice(None), self.k, self.v, seen)]
