"""Watch the steps of a forward pass: modules and the math backend report named tensors.

``with observe(fn): module(x)`` calls ``fn(name, tensor)`` for each intermediate the
forward pass produces (projections, head split, scores, weights, context, merge, ...).
Nothing is recorded when no one observes; the check costs one context-variable read.
While observed, ``backend="auto"`` picks the ``"math"`` backend, the one whose scores and
weights exist as tensors.

Steps are reported as attention computes them: where a call's own padded keys are zeroed before the scores (padding
given with no cache: whatever sits there must not reach a real row), ``scores`` holds 0 in those columns while ``keys``
shows them as projected (the columns are masked next); in training with dropout, ``weights`` is the softmax and
``dropped_weights`` what multiplies the values. An observer that raises stops the call after what it had done (a
cache's write included).

Under ``torch.compile`` observers are off: ``observing()`` and ``report`` first ask
``_checks.compiling()``, which Dynamo folds to the constant True while it traces, so a
compiled forward holds no observer call, no context-variable read and no graph break, and
``backend="auto"`` keeps the fused kernel. Observe an eager module (the same weights, not
compiled) to see its steps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from ._checks import compiling

Observer = Callable[[str, Tensor], None]

_OBSERVER: ContextVar[Observer | None] = ContextVar("headwise_observer", default=None)


def observing() -> bool:
    """True inside an ``observe`` block, in eager mode (always False while ``torch.compile`` traces)."""
    if compiling():  # a constant to Dynamo: the branch below is never traced
        return False
    return _OBSERVER.get() is not None


def report(name: str, tensor: Tensor) -> None:
    """Hand ``tensor`` (detached) to the active observer, if any (none under ``torch.compile``)."""
    if compiling():
        return
    observer = _OBSERVER.get()
    if observer is not None:
        observer(name, tensor.detach())


@contextmanager
def observe(fn: Observer) -> Iterator[None]:
    """Call ``fn(name, tensor)`` for every step reported inside the block (eager modules only).

    Example:
        >>> import headwise as hw
        >>> mha = hw.MultiHeadAttention(8, 8, context_length=4, dropout=0.0, num_heads=2)
        >>> steps = []
        >>> with observe(lambda name, t: steps.append(name)):
        ...     _ = mha(torch.randn(1, 4, 8))
        >>> steps[:4], steps[-1]
        (['x', 'queries', 'keys', 'values'], 'output')
    """
    if not callable(fn) or isinstance(fn, torch.nn.Module):  # (a module is callable: its forward would get the names)
        hint = ": observe watches every module that runs in the block, so pass the function and call the model inside" if callable(fn) else ""
        raise TypeError(f"fn must be a callable (name, tensor) -> None, got {type(fn).__name__}{hint}")
    token = _OBSERVER.set(fn)
    try:
        yield
    finally:
        _OBSERVER.reset(token)
