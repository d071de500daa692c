"""Grouped-query attention: query head h reads key/value head h // (H // Hkv).

Oracles: the float64 reference (tests/reference.py), and the same module with every KV head
repeated over its group of query heads (plain multi-head attention with tied weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import BACKENDS, decode, make, new_cache, reference_weights, tol
from hypothesis import given
from hypothesis import strategies as st
from reference import reference_mha

import headwise as hw


def repeated(m):
    """The same module with H key/value heads: each KV head's rows copied to its group."""
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    rows = torch.arange(H * D).view(H, D) // D  # (H, D): head index of every row
    rows = (rows // (H // Hkv)) * D + torch.arange(D)  # (H, D): the KV row each repeated row copies
    rows = rows.flatten()  # (H*D,)
    if isinstance(m, hw.MultiHeadAttention):
        full = hw.MultiHeadAttention(m.d_in, m.d_out, m.context_length, 0.0, H, qkv_bias=True, window=m.window, backend=m.backend)
        with torch.no_grad():
            full.W_query.load_state_dict(m.W_query.state_dict())
            full.out_proj.load_state_dict(m.out_proj.state_dict())
            for name in ("W_key", "W_value"):
                getattr(full, name).weight.copy_(getattr(m, name).weight[rows])
                getattr(full, name).bias.copy_(getattr(m, name).bias[rows])
        return full.to(m.W_query.weight).eval()  # its dtype and device
    config = hw.GPT2Config(n_embd=m.d_in, n_head=H, n_positions=m.config.n_positions, attn_pdrop=0.0, resid_pdrop=0.0)
    full = hw.GPT2MultiHeadAttention(config, window=m.window, backend=m.backend)
    C, kv = m.d_in, m.num_kv_heads * m.head_dim
    keep = torch.cat([torch.arange(C), C + rows, C + kv + rows])  # [queries | repeated keys | repeated values]
    with torch.no_grad():
        full.c_attn.weight.copy_(m.c_attn.weight[keep])
        full.c_attn.bias.copy_(m.c_attn.bias[keep])
        full.c_proj.load_state_dict(m.c_proj.state_dict())
    return full.to(m.c_attn.weight).eval()  # its dtype and device


def test_num_heads_must_be_a_multiple_of_num_kv_heads():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be divisible by num_kv_heads \(4\)"):
        hw.MultiHeadAttention(12, 12, 8, 0.0, 6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"n_head \(6\) must be divisible by n_kv_head \(4\)"):
        hw.GPT2Config(n_embd=12, n_head=6, n_kv_head=4)
    with pytest.raises(ValueError, match=r"num_kv_heads must be a positive int, got 0"):
        hw.MultiHeadAttention(12, 12, 8, 0.0, 6, num_kv_heads=0)
    with pytest.raises(ValueError, match=r"q's heads H=6 must be a multiple of k/v's heads Hkv=4"):
        hw.attention(torch.randn(1, 6, 2, 3), torch.randn(1, 4, 2, 3), torch.randn(1, 4, 2, 3))


def test_projections_are_num_kv_heads_wide():
    m = hw.MultiHeadAttention(24, 24, 8, 0.0, 6, num_kv_heads=2)  # D = 4
    assert m.W_query.weight.shape == (24, 24)
    assert m.W_key.weight.shape == m.W_value.weight.shape == (2 * 4, 24)
    g = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=24, n_head=6, n_kv_head=3))
    assert g.c_attn.weight.shape == (24 + 2 * 3 * 4, 24)
    assert hw.MultiHeadAttention(24, 24, 8, 0.0, 6).W_key.weight.shape == (24, 24)  # default Hkv = H


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Hkv", [1, 2])  # multi-query and grouped
def test_equals_the_module_with_repeated_kv_heads(kind, backend, Hkv, device):
    m = make(kind, H=4, Hkv=Hkv, backend=backend, ctx=16, device=device)
    full = repeated(m)
    x = torch.randn(2, 9, 16).to(device)
    kpm = torch.arange(9, device=device) >= torch.tensor([0, 3], device=device)[:, None]  # (B, T) left padding on row 1
    close = tol(device, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), full(x), **close)
        torch.testing.assert_close(m(x, attention_mask=kpm), full(x, attention_mask=kpm), **close)
        got = decode(m, x, [4, 1, 3, 1], new_cache(m, 2, 16), kpm)
        want = decode(full, x, [4, 1, 3, 1], new_cache(full, 2, 16), kpm)
    torch.testing.assert_close(got, want, **close)


@given(
    Hkv=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3]), T=st.integers(1, 7), causal=st.booleans(),
    backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**16),
)
def test_mha_gqa_matches_the_float64_reference(Hkv, group, T, causal, backend, seed):
    H, D = Hkv * group, 3
    torch.manual_seed(seed)
    m = hw.MultiHeadAttention(5, H * D, 8, 0.0, H, qkv_bias=True, causal=causal, num_kv_heads=Hkv, backend=backend).double().eval()
    x = torch.randn(2, T, 5, dtype=torch.float64)
    with torch.no_grad():
        want = reference_mha(x, **reference_weights(m), num_heads=H, num_kv_heads=Hkv, causal=causal)
        torch.testing.assert_close(m(x), want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("T", [1, 5])
def test_sdpa_gets_the_kv_heads_unrepeated(monkeypatch, T):
    from headwise.backends import decode_kernel

    monkeypatch.setattr(decode_kernel, "available", lambda: False)  # the one-query calls: the C++ kernel's where built
    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.shape[1], k.shape[1], v.shape[1], kwargs.get("enable_gqa")))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    m = make("gpt2", H=4, Hkv=2, backend="sdpa")
    with torch.no_grad():
        cache = new_cache(m, 1, 16)
        m(torch.randn(1, T, 16), cache=cache)
        m(torch.randn(1, 1, 16), cache=cache)
    assert seen == [(4, 2, 2, True), (4, 2, 2, True)]  # torch broadcasts the groups; no (B, H, S, D) copy


@pytest.mark.parametrize("T", [1, 3])
def test_math_backend_never_builds_repeated_kv(T):
    """No op in the math backend may produce a tensor as big as K repeated over the groups."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    B, Hkv, G, S, D = 1, 2, 4, 256, 8
    q = torch.randn(B, Hkv * G, T, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    with Largest() as seen:
        got = hw.attention(q, k, v, causal=True, backend="math")
    assert seen.numel < Hkv * G * S * D  # the scores (B, H, T, S) are the biggest thing made
    want = hw.attention(q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), causal=True, backend="math")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
