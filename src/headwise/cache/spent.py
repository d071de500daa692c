"""Keys and values autograd recorded, marked when a backward goes through them.

A backward frees the graph it went through: a cache that kept recorded keys (a ``KVCache``'s
``_graph``, a ``ContextCache``'s projections) and hands them to a later forward would make that
forward's backward fail deep inside autograd. Each cache marks itself (``_spent``) instead, and
decides before its next write what to do: project again (``ContextCache``) or say so by name (``KVCache``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

from torch import Tensor

from .._checks import compiling


class Spendable:
    """``_spent``: a backward went through the recorded tensors last handed to ``mark_on_backward``; ``_epoch`` counts
    the times the cache let go of its recorded tensors (later hooks of older tensors mark nothing)."""

    _spent = False
    _epoch = 0

    def forget_recorded(self) -> None:
        """Let go of the recorded tensors' marks: hooks on them mark nothing from now on."""
        self._epoch += 1
        self._spent = False

    def mark_on_backward(self, tensors: Iterable[Tensor]) -> None:
        """A hook on the autograd node of each of ``tensors`` that has one: a backward through it sets ``_spent``,
        unless the cache let go of them since (the cache held weakly: the graph does not keep it alive).

        Not under ``torch.compile``, which cannot trace a hook registered on a graph's node (a break, and
        ``fullgraph=True`` fails): a compiled forward that reuses keys a backward already went through gets autograd's
        own error at its backward ("backward through the graph a second time") instead of the cache's by name."""
        if compiling():
            return
        cache, epoch = weakref.ref(self), self._epoch

        def hook(*_: object) -> None:
            c = cache()
            if c is not None and c._epoch == epoch:
                c._spent = True

        for t in tensors:
            if t.grad_fn is not None:
                t.grad_fn.register_hook(hook)
