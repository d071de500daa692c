"""``headwise::linear`` and ``headwise::linear_many``: a compiled inference call's projections as opaque ops.

``torch.compile`` does not look into them: the graph hands them the model's own parameters, and
they choose their path, pack and stack the weights when the graph runs, as the eager call does
(a stack or a packed weight made once cannot live in a graph). ``projection.runs_as_op`` says
which traced calls become these ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .projection import linear, stacked_linear


@torch.library.custom_op("headwise::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear`` whole: (..., K) -> (..., N)."""
    return linear(x, weight, bias)


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))  # (..., N)


@torch.library.custom_op("headwise::linear_many", mutates_args=())
def _linear_many_op(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """``project_many``'s stacked GEMM: (..., K) -> (..., sum N), the stack made once (biases: all or [])."""
    return stacked_linear(x, weights, biases or [None] * len(weights))


@_linear_many_op.register_fake
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))  # (..., sum N)
