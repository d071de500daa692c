""""auto" on the CPU: one bfloat16 query per row (a decode step) goes to the math backend over blocks of
queries, everything else to SDPA as before; both against the float64 reference."""

import pytest
import torch
from reference import reference_attention

from headwise import KVCache, attention
from headwise.functional import attention_unchecked


def qkv(t, s, dtype, h=8, hkv=4, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, h, t, d, generator=gen).to(dtype)  # (B, H, T, D)
    k, v = (torch.randn(2, hkv, s, d, generator=gen).to(dtype) for _ in range(2))  # (B, Hkv, S, D)
    return q, k, v


def error(got, q, k, v, **kw):
    return float((got.double() - reference_attention(q, k, v, **kw)).abs().max())


@pytest.mark.parametrize("s", [1, 7, 300])
@pytest.mark.parametrize("terms", [{}, {"window": 5}, {"padding": True}], ids=["plain", "window", "padding"])
def test_one_bf16_query_per_row_is_as_close_to_float64_as_sdpa(s, terms):
    q, k, v = qkv(1, s, torch.bfloat16)
    kw = {"causal": True, "window": terms.get("window")}
    if terms.get("padding"):
        kw["attention_mask"] = torch.ones(2, s, dtype=torch.bool)
        kw["attention_mask"][1, : s // 2] = False  # row 1 left-padded
    auto, sdpa = attention(q, k, v, **kw), attention(q, k, v, backend="sdpa", **kw)
    assert auto.dtype == torch.bfloat16 and auto.shape == (2, 8, 1, 16)
    assert error(auto, q, k, v, **kw) <= max(2 * error(sdpa, q, k, v, **kw), 2**-7)  # bf16 rounding of the output


@pytest.mark.parametrize(("t", "dtype"), [(2, torch.bfloat16), (1, torch.float32), (5, torch.float32)])
def test_other_calls_keep_sdpa(t, dtype):
    q, k, v = qkv(t, 40, dtype)
    assert torch.equal(attention(q, k, v, causal=True), attention(q, k, v, causal=True, backend="sdpa"))


def test_a_bf16_decode_step_through_a_cache_takes_the_same_path_checked_or_not():
    q, k, v = qkv(1, 1, torch.bfloat16)
    checked, unchecked = KVCache(2, 4, 16, 16, dtype=torch.bfloat16), KVCache(2, 4, 16, 16, dtype=torch.bfloat16)
    for i in range(6):
        q, k, v = qkv(1, 1, torch.bfloat16, seed=i)
        want = attention(q, k, v, causal=True, cache=checked)  # (B, H, 1, D)
        assert torch.equal(attention_unchecked(q, k, v, unchecked, causal=True, window=None), want)
    keys, values = checked.k[:, :, :6].double(), checked.v[:, :, :6].double()  # (B, Hkv, 6, D) x2
    assert float((want.double() - reference_attention(q, keys, values, causal=True)).abs().max()) < 2**-6


def test_the_row_twice_runner_gives_the_reference_and_its_gradients():
    """``sdpa.row_twice`` (the plan's G = 1 decode runner where MKL runs no AVX-512 kernels), on any machine: the output
    and the gradients of q, k and v as near float64's as the one-row fused kernel's."""
    from headwise.backends import sdpa
    from headwise.backends.spec import Spec

    q, k, v = (t.requires_grad_() for t in qkv(1, 300, torch.bfloat16, hkv=8))  # G = 1
    spec = Spec(T=1, S=300, causal=True, scale=16**-0.5)
    got, one_row = sdpa.row_twice(q, k, v, spec), sdpa.fused(q, k, v, spec)  # (B, H, 1, D) each
    assert got.shape == (2, 8, 1, 16) and got.dtype == torch.bfloat16
    assert error(got, q, k, v, causal=True) <= max(error(one_row, q, k, v, causal=True), 2**-8)
    g = torch.randn(got.shape, generator=torch.Generator().manual_seed(3)).to(got.dtype)
    grads = torch.autograd.grad(got, (q, k, v), g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference_attention(q64, k64, v64, causal=True), (q64, k64, v64), g.double())
    ones = torch.autograd.grad(one_row, (q, k, v), g)
    for name, a, b, w in zip("qkv", grads, ones, want, strict=True):
        assert float((a.double() - w).abs().max()) <= 2 * float((b.double() - w).abs().max()) + 2**-8, name
