"""Terms that change the attention scores: softcap (Gemma 2), ALiBi (BLOOM, MPT) and sinks (gpt-oss).

Each is a small function of the scaled scores, written once and used by every backend:

- ``softcap(logits, cap)``: ``cap * tanh(logits / cap)``, after scaling, before any mask;
- ``alibi_bias(slopes, q_pos, k_pos)``: ``-slope * |p_i - j|`` added to the logits, with the
  query at ``p_i = i + S - T`` (bottom-right, as every mask in ``headwise.masks``);
- a sink is one more logit per query head that joins the softmax and carries no value: the
  weights over the S keys sum to ``1 - sink share``. ``sink_share`` gives that share from a
  row's log-sum-exp, which is how a fused kernel that returns its log-sum-exp takes sinks:
  ``context_with_sink = context * sigmoid(lse - sink)`` exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def softcap(logits: Tensor, cap: float) -> Tensor:
    """``cap * tanh(logits / cap)``: scores bounded to (-cap, cap), unchanged near zero."""
    return torch.tanh(logits / cap) * cap


def alibi_slopes(num_heads: int) -> Tensor:
    """The standard ALiBi slopes, (H,) float32.

    For H a power of two, ``2 ** (-8 i / H)`` for i = 1 .. H; otherwise BLOOM's rule: the
    slopes of the nearest lower power of two P, then every other slope of 2P.

    Example:
        >>> alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
    slopes += [2.0 ** (-8.0 * i / (2 * p)) for i in range(1, 2 * (num_heads - p), 2)]
    return torch.tensor(slopes, dtype=torch.float32)  # (H,)


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``-slope * |q_pos - k_pos|``: (Bs, H) slopes, (t,) and (s,) positions -> (Bs, H, t, s).

    Computed in the wider of ``dtype`` (the scores' own), the slopes' dtype and float32.
    """
    dtype = torch.promote_types(torch.promote_types(slopes.dtype, dtype), torch.float32)
    distance = (q_pos[:, None] - k_pos[None, :]).abs().to(dtype)  # (t, s)
    return -slopes.to(dtype)[:, :, None, None] * distance  # (Bs, H, t, s)


def sink_share(lse: Tensor, sinks: Tensor) -> Tensor:
    """The keys' share of the mass once the sink joins: ``sigmoid(lse - sink)``.

    lse: (B, H, T) log-sum-exp of each row's logits over its keys; sinks: (H,).
    Returns (B, H, T), float32 or wider; multiply a row's context by it.
    """
    dtype = torch.promote_types(torch.promote_types(lse.dtype, sinks.dtype), torch.float32)
    sinks = sinks.to(dtype).clamp_min(torch.finfo(dtype).min)  # a sink of -inf (no sink) leaves every row whole, one of no keys (lse -inf) too
    return torch.sigmoid(lse.to(dtype) - sinks[:, None])  # (B, H, T)
