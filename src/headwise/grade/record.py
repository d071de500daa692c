"""Record every tensor a forward pass computes, without touching the code that computes it."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

MAX_RECORDS = 20_000  # a learner's loop cannot fill the memory


class Recorder(TorchFunctionMode):
    """Inside ``with Recorder() as rec:``, ``rec.tensors`` collects a copy of every floating
    tensor any torch function or Tensor method returns, in order.

    ``F.scaled_dot_product_attention`` computes its scores and weights out of sight; for it the
    recorder also adds what the book computes (q @ k^T, masked, softmax) so that a learner who
    calls it is graded on the same steps.

    Example:
        >>> with Recorder() as rec:
        ...     y = torch.ones(2, 3).sum(dim=-1)
        >>> [tuple(t.shape) for t in rec.tensors]
        [(2, 3), (2,)]
    """

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            self._add(_sdpa_steps(*args, **kwargs))
        self._add(out)
        return out

    def _add(self, out: Any) -> None:
        if isinstance(out, (tuple, list)):
            for item in out:
                self._add(item)
        elif isinstance(out, Tensor) and out.is_floating_point() and len(self.tensors) < MAX_RECORDS:
            self.tensors.append(out.detach().clone())


def _sdpa_steps(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
                is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> list[Tensor]:
    """The book's scores, masked scores and weights for an SDPA call (torch's parameter names: given by keyword or
    not, the same steps): (.., T, S) each."""
    q, k = query, key
    if enable_gqa and k.ndim >= 3 and k.shape[-3] != q.shape[-3]:  # each key head serves H / Hkv query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scores = q @ k.transpose(-2, -1)  # (.., T, S)
    steps = [scores]
    if is_causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(T, S, dtype=torch.bool, device=q.device).triu(1), -math.inf)
        steps.append(scores)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = scores * scale  # (.., T, S)
    if attn_mask is not None:
        logits = logits.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else logits + attn_mask
        steps.append(logits)
    return [*steps, torch.softmax(logits, dim=-1)]
