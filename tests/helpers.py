"""Helpers shared by the tests (none of them computes a reference: that is tests/reference.py)."""

from __future__ import annotations

import torch
from torch import nn

import headwise as hw

#: The rule for low precision (flash-attention's tests): our error against a float64 reference
#: must be within ERROR_RATIO times the error of a plain implementation in the same dtype.
ERROR_RATIO = 3

BACKENDS = ["math", "sdpa", "auto"]


def make(kind: str, *, H=4, Hkv=None, D=4, ctx=32, window=None, backend="auto", dtype=torch.float32, seed=0):
    """A MultiHeadAttention or GPT2MultiHeadAttention in eval mode, random biases."""
    torch.manual_seed(seed)
    if kind == "mha":
        m = hw.MultiHeadAttention(H * D, H * D, ctx, 0.0, H, qkv_bias=True, num_kv_heads=Hkv, window=window, backend=backend)
    else:
        config = hw.GPT2Config(n_embd=H * D, n_head=H, n_kv_head=Hkv, n_positions=ctx, attn_pdrop=0.0, resid_pdrop=0.0)
        m = hw.GPT2MultiHeadAttention(config, window=window, backend=backend)
    m = m.to(dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 1:
                p.normal_()  # zero-initialised biases would hide a mis-split
    return m


def decode(m, x, schedule, cache, attention_mask=None, every_chunk=False):
    """Feed x (B, T, C) through m in chunks of the given sizes; each chunk's part of the mask goes
    with it if every_chunk, else the mask goes with the first chunk only (the rest must be real)."""
    outs, start = [], 0
    for i, n in enumerate(schedule):
        kpm = attention_mask[:, start : start + n] if (attention_mask is not None and (i == 0 or every_chunk)) else None
        outs.append(m(x[:, start : start + n], attention_mask=kpm, cache=cache))
        start += n
    return torch.cat(outs, dim=1)  # (B, T, C)


def new_cache(m, B, max_len, dtype=torch.float32):
    return hw.KVCache(B, m.num_kv_heads, max_len, m.head_dim, dtype=dtype)


def reference_weights(m: nn.Module) -> dict:
    """A headwise module's projections as ``reference_mha``'s keyword arguments (detached).

    The book's classes give W_query / W_key / W_value (and out_proj, None for CausalAttention);
    GPT-2's fused c_attn rows are [queries | keys | values].
    """
    get = lambda layer, attr: None if layer is None or getattr(layer, attr) is None else getattr(layer, attr).detach()  # noqa: E731
    if isinstance(m, hw.GPT2MultiHeadAttention):
        C, kv = m.d_in, m.num_kv_heads * m.head_dim
        w, b = m.c_attn.weight.detach(), m.c_attn.bias.detach()
        return {
            "wq": w[:C], "wk": w[C : C + kv], "wv": w[C + kv :], "bq": b[:C], "bk": b[C : C + kv], "bv": b[C + kv :],
            "wo": m.c_proj.weight.detach(), "bo": m.c_proj.bias.detach(),
        }
    out_proj = getattr(m, "out_proj", None)
    return {
        "wq": m.W_query.weight.detach(), "wk": m.W_key.weight.detach(), "wv": m.W_value.weight.detach(),
        "bq": get(m.W_query, "bias"), "bk": get(m.W_key, "bias"), "bv": get(m.W_value, "bias"),
        "wo": get(out_proj, "weight"), "bo": get(out_proj, "bias"),
    }
