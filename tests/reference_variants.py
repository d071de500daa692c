"""A float64 reference for the attention variants: softcap, sinks, ALiBi, packed documents.

Written from the definitions, row by row; it imports nothing of headwise (nor transformers).
Rules it encodes (B batch, H query heads, Hkv key/value heads, T queries, S keys):
- query i sits at position p = i + S - T; causal: it sees keys j <= p; window W: j > p - W;
- logit_j = q·k_j * scale; softcap c: c * tanh(logit / c); ALiBi slope m: logit - m * |p - j|;
  an additive float mask is added after those; bool masks / padding / documents only say
  which keys are visible (documents: key j is visible when doc[j] == doc[p]);
- sinks: the softmax denominator also holds exp(sink_h); the sink contributes no value;
- a query that sees no key gets zero weights (a sink of -inf is no sink at all).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def variant_weights(
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    documents: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """(B, H, T, S) float64 weights, differentiable in q, k, sinks, alibi_slopes and a float mask."""
    q, k = q.double(), k.double()
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    full_mask = None if mask is None else mask.expand(B, H, T, S)
    rows = []
    for b in range(B):
        for h in range(H):
            for i in range(T):
                p = i + S - T
                logits = (k[b, h // group] @ q[b, h, i]) * scale  # (S,)
                if softcap is not None:
                    logits = softcap * torch.tanh(logits / softcap)
                if alibi_slopes is not None:
                    slope = alibi_slopes.double()[h] if alibi_slopes.ndim == 1 else alibi_slopes.double()[b, h]
                    logits = logits - slope * torch.tensor([abs(p - j) for j in range(S)], dtype=torch.float64)
                ok = [True] * S
                for j in range(S):
                    if causal and j > p:
                        ok[j] = False
                    if window is not None and j <= p - window:
                        ok[j] = False
                    if attention_mask is not None and not bool(attention_mask[b, j]):
                        ok[j] = False
                    if documents is not None and (p < 0 or int(documents[b, j]) != int(documents[b, p])):
                        ok[j] = False
                if full_mask is not None:
                    m = full_mask[b, h, i]
                    if m.dtype == torch.bool:
                        ok = [o and bool(x) for o, x in zip(ok, m, strict=True)]
                    else:
                        logits = logits + m.double()
                        ok = [o and bool(x > -math.inf) for o, x in zip(ok, m, strict=True)]
                keep = torch.tensor(ok, dtype=torch.bool)
                row = torch.zeros(S, dtype=torch.float64)
                if keep.any():  # a row that sees no key gives them no weight, sink or not
                    seen = logits[keep]
                    parts = [seen] if sinks is None else [seen, sinks.double()[h].reshape(1)]
                    everything = torch.cat(parts)
                    e = torch.exp(everything - everything.max())
                    p_all = e / e.sum()
                    row = row.index_put((keep.nonzero().flatten(),), p_all[: seen.numel()])
                rows.append(row)
    return torch.stack(rows).view(B, H, T, S)


def variant_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """(B, H, T, Dv) float64 context: the weights times each query head's key/value head's values."""
    w = variant_weights(q, k, **kwargs)  # (B, H, T, S)
    B, H = w.shape[:2]
    group = H // v.shape[1]
    v = v.double()
    return torch.stack([torch.stack([w[b, h] @ v[b, h // group] for h in range(H)]) for b in range(B)])  # (B, H, T, Dv)
