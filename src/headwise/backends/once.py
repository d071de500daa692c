"""First-order gradients only: the backward of a runner built on a kernel's own backward (the flash kernel's, a
blocked softcap) has no derivative of its own. ``first_order(grads, inputs, what)`` hands its gradients back as they
are where no graph is built (``create_graph=False``, the usual case); under ``create_graph=True`` they hang from a node
joined to the runner's ``inputs``, so that a second derivative through them reaches it and raises a RuntimeError that
says which runner it was and how to get one (``backend="math"``, whose ops are all twice differentiable), where torch
would fail inside its own ops with a message that names neither (or, with ``allow_unused=True``, give None).
"""

from __future__ import annotations

import torch
from torch import Tensor


class _Refused(torch.autograd.Function):
    """The identity on the gradients after the first ``inputs`` tensors, joined to those; its backward refuses."""

    @staticmethod
    def forward(ctx, what: str, inputs: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.what = what
        return tuple(g.view_as(g) for g in tensors[inputs:])

    @staticmethod
    def backward(ctx, *_: Tensor) -> tuple:
        raise RuntimeError(f"a second derivative through attention {ctx.what} is not implemented (its backward is the "
                           f"kernel's own): pass backend='math' for gradients of gradients (the same attention in "
                           f"twice-differentiable ops)")


def first_order(grads: tuple[Tensor | None, ...], inputs: tuple[Tensor | None, ...], what: str) -> tuple[Tensor | None, ...]:
    """``grads`` (a backward's return value, computed without a graph); under ``create_graph=True``, joined to
    ``inputs`` (the saved tensors that may want gradients) through a node that refuses a second derivative, ``what``
    named in its message."""
    if not torch.is_grad_enabled():  # backward without create_graph: nothing can differentiate them again
        return grads
    joined = [t for t in inputs if t is not None and t.requires_grad]
    where = [i for i, g in enumerate(grads) if g is not None]
    if not joined or not where:
        return grads
    refused = _Refused.apply(what, len(joined), *joined, *(grads[i] for i in where))
    out = list(grads)
    for i, g in zip(where, refused, strict=True):
        out[i] = g
    return tuple(out)
