"""``headwise::linear`` and ``headwise::linear_many``: a compiled inference call's projections as opaque ops.

``torch.compile`` does not look into them: the graph hands them the model's own parameters, and
they choose their path, pack and stack the weights when the graph runs, as the eager call does
(a stack or a packed weight made once cannot live in a graph); a decode-shaped call keeps what it
decided, keyed by the weights (``projection.ready_for``), as ``project`` keeps it by the layers.
``projection.runs_as_op`` says which traced calls become these ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .projection import linear, ready_for, stacked_linear


@torch.library.custom_op("headwise::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear`` whole: (..., K) -> (..., N); a decode-shaped call runs what was decided and packed for it once."""
    if (ready := ready_for((weight,), (bias,), x)) is not None:
        return ready(x)  # (..., N)
    return linear(x, weight, bias)


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))  # (..., N)


@torch.library.custom_op("headwise::linear_many", mutates_args=())
def _linear_many_op(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """``project_many``'s stacked GEMM: (..., K) -> (..., sum N), the stack made once (biases: all or [])."""
    biases = biases or [None] * len(weights)
    if (ready := ready_for(weights, biases, x)) is not None:
        return ready(x)  # (..., sum N)
    return stacked_linear(x, weights, biases)


@_linear_many_op.register_fake
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))  # (..., sum N)
