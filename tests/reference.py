"""An independent float64 reference for attention: plain loops over batch and heads.

Written from the definition, not from headwise: nothing here imports headwise, transformers,
torch.nn.MultiheadAttention or the book's package. Shapes follow the package's glossary
(B batch, H query heads, Hkv key/value heads, T queries, S keys, D head size).

Rules it encodes:
- query head h reads key/value head h // (H // Hkv);
- causal is aligned bottom-right: query i sits at position i + S - T and sees keys j <= that;
  with a window W it sees only keys j > i + S - T - W;
- a bool mask is True = may attend; a float mask is added to the scaled scores;
- attention_mask (B, S) is True = real token;
- a query that can see no key (every logit -inf) gets zero weights and a zero context.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def allowed_matrix(t: int, s: int, *, causal: bool, window: int | None) -> Tensor:
    """(T, S) bool built entry by entry: True where query i may see key j."""
    out = torch.ones(t, s, dtype=torch.bool)
    for i in range(t):
        pos = i + s - t  # bottom-right alignment
        for j in range(s):
            if causal and j > pos:
                out[i, j] = False
            if window is not None and j <= pos - window:
                out[i, j] = False
    return out


def reference_weights(
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """(B, H, T, S) float64 softmax weights; all-zero rows where nothing is visible."""
    q, k = q.double(), k.double()
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    allowed = allowed_matrix(T, S, causal=causal, window=window)
    full_mask = None if mask is None else mask.expand(B, H, T, S)
    out = torch.zeros(B, H, T, S, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            logits = (q[b, h] @ k[b, h // group].T) * scale  # (T, S)
            ok = allowed.clone()
            if attention_mask is not None:
                ok &= attention_mask[b].unsqueeze(0)
            if full_mask is not None:
                m = full_mask[b, h]
                if m.dtype == torch.bool:
                    ok &= m
                else:
                    logits = logits + m.double()
            ok &= logits > -math.inf
            for i in range(T):
                if not ok[i].any():
                    continue  # nothing to see: the row stays zero
                row = logits[i][ok[i]]
                e = torch.exp(row - row.max())
                out[b, h, i, ok[i]] = e / e.sum()
    return out


def reference_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
    """(B, H, T, Dv) float64 context: reference weights times the group's values."""
    w = reference_weights(q, k, **kwargs)  # (B, H, T, S)
    v = v.double()
    B, H = w.shape[:2]
    group = H // v.shape[1]
    out = torch.zeros(B, H, w.shape[2], v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            out[b, h] = w[b, h] @ v[b, h // group]
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T + bias in float64 (PyTorch's (out, in) layout)."""
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def int8_linear(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """An int8 layer's product in float64, and how far a computed one may be from it.

    The activations rounded to bfloat16, times the (N, K) int8 weight: s = bf16(x) @ q^T, exact in
    float64; the result s * scale + bias. A computation that sums in float32 and rounds s once to
    bfloat16 is within half a bfloat16 step of s (2^-8 relative) plus float32's error of the sums.

    Returns:
        (..., N) the product and (..., N) the allowed distance.
    """
    xb, q, scale = x.bfloat16().double(), weight.double(), scales.double()
    s = xb @ q.T  # (..., N)
    slack = (2.0**-8 * s.abs() + 1e-5 * (xb.abs() @ q.abs().T)) * scale + 1e-6  # (..., N)
    return s * scale + (0 if bias is None else bias.double()), slack


def reference_mha(
    x: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    bq: Tensor | None,
    bk: Tensor | None,
    bv: Tensor | None,
    wo: Tensor | None,
    bo: Tensor | None,
    num_heads: int,
    num_kv_heads: int | None = None,
    **kwargs,
) -> Tensor:
    """Multi-head attention from raw weights, (B, T, d_in) -> (B, T, d_out), head by head.

    Head h's query is columns [h*D, (h+1)*D) of x W_q^T; kv head g likewise for keys/values.
    ``wo`` None means no output projection (the book's wrapper).
    """
    num_kv_heads = num_kv_heads or num_heads
    qs, ks, vs = linear(x, wq, bq), linear(x, wk, bk), linear(x, wv, bv)
    D = qs.shape[-1] // num_heads
    q = torch.stack([qs[..., h * D : (h + 1) * D] for h in range(num_heads)], dim=1)  # (B, H, T, D)
    k = torch.stack([ks[..., g * D : (g + 1) * D] for g in range(num_kv_heads)], dim=1)  # (B, Hkv, T, D)
    v = torch.stack([vs[..., g * D : (g + 1) * D] for g in range(num_kv_heads)], dim=1)  # (B, Hkv, T, D)
    ctx = reference_attention(q, k, v, **kwargs)  # (B, H, T, D)
    merged = torch.cat([ctx[:, h] for h in range(num_heads)], dim=-1)  # (B, T, C)
    return merged if wo is None else linear(merged, wo, bo)


def plain_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None) -> Tensor:
    """The naive implementation in q's own dtype (no float32 softmax): the yardstick for the
    low-precision rule. Same heads (H == Hkv), causal top-left == bottom-right for T == S."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, S) in q.dtype
    if causal:
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(~allowed_matrix(T, S, causal=True, window=None), -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps) * weight.double() + bias.double()


def reference_gpt2_logits(state: dict[str, Tensor], input_ids: Tensor, n_head: int, eps: float = 1e-5) -> Tensor:
    """(B, T, vocab) float64 logits of a GPT-2 whose state dict holds (out, in) Linear weights
    (``transformer.h.{i}.attn.c_attn.weight`` (3C, C), ...), on unpadded ids at positions 0..T-1."""
    s = {k.removeprefix("transformer."): v.double() for k, v in state.items()}
    t = input_ids.shape[1]
    x = s["wte.weight"][input_ids] + s["wpe.weight"][:t]  # (B, T, C)
    c = x.shape[-1]
    for i in range(1 + max(int(k.split(".")[1]) for k in s if k.startswith("h."))):
        p = f"h.{i}."
        a = _layer_norm(x, s[p + "ln_1.weight"], s[p + "ln_1.bias"], eps)
        wq, wk, wv = s[p + "attn.c_attn.weight"].split(c)
        bq, bk, bv = s[p + "attn.c_attn.bias"].split(c)
        x = x + reference_mha(a, wq, wk, wv, bq, bk, bv, s[p + "attn.c_proj.weight"], s[p + "attn.c_proj.bias"], n_head, causal=True)
        m = linear(_layer_norm(x, s[p + "ln_2.weight"], s[p + "ln_2.bias"], eps), s[p + "mlp.c_fc.weight"], s[p + "mlp.c_fc.bias"])
        m = 0.5 * m * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (m + 0.044715 * m**3)))  # GPT-2's tanh GELU
        x = x + linear(m, s[p + "mlp.c_proj.weight"], s[p + "mlp.c_proj.bias"])
    return _layer_norm(x, s["ln_f.weight"], s["ln_f.bias"], eps) @ s["wte.weight"].T  # (B, T, vocab)
