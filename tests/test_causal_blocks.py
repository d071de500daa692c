"""A causal prompt on the CPU as blocks of queries, each over the keys it may see, against the float64 reference."""

import pytest
import torch
import torch.nn.functional as F
from reference import reference_attention

from headwise import KVCache, attention
from headwise.backends import plan, sdpa

BLOCK = plan.CAUSAL_BLOCK


def qkv(t, dtype, h=8, hkv=4, d=16, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, h, d, generator=gen).to(dtype).transpose(1, 2)  # (B, H, T, D), strided as split heads
    k, v = (torch.randn(1, hkv, t, d, generator=gen).to(dtype) for _ in range(2))  # (B, Hkv, T, D)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def one_call(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, D)


def error(got, q, k, v):
    return float((got.double() - reference_attention(q, k, v, causal=True)).abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [BLOCK + 1, 2 * BLOCK, 300, plan.CAUSAL_BLOCKS_UP_TO])
def test_blocks_are_as_close_to_float64_as_one_kernel_call(t, dtype, monkeypatch):
    monkeypatch.setattr(plan, "mkl_avx512", lambda: False)  # blocks on any machine (where MKL runs AVX-512 kernels, one call)
    q, k, v = qkv(t, dtype)
    calls = []
    kernel = sdpa._kernel
    monkeypatch.setattr(sdpa, "_kernel", lambda q, k, *a: calls.append((q.shape[2], k.shape[2])) or kernel(q, k, *a))
    with torch.no_grad():
        got, one = attention(q, k, v, causal=True), one_call(q, k, v)
    rows = plan.causal_rows(t)
    assert calls == [(min(t, r0 + rows) - r0, min(t, r0 + rows)) for r0 in range(0, t, rows)]  # (queries, keys) per call
    assert got.dtype == dtype and got.shape == one.shape
    assert error(got, q, k, v) <= 2 * error(one, q, k, v)
    if dtype == torch.float32:
        torch.testing.assert_close(got, one, atol=1e-6, rtol=1e-6)


def test_a_blocked_prompt_takes_at_most_causal_calls_calls_of_at_least_causal_block_queries():
    """Few calls, since each waits for its slowest thread (a core another process holds makes every call wait):
    blocks of CAUSAL_BLOCK queries until that would take more than CAUSAL_CALLS calls, then T / CAUSAL_CALLS rounded up."""
    for t in range(BLOCK + 1, plan.CAUSAL_BLOCKS_UP_TO + 1):
        rows = plan.causal_rows(t)
        calls = -(-t // rows)
        assert rows >= BLOCK and calls <= plan.CAUSAL_CALLS, t
        assert rows == BLOCK or -(-t // (rows - 1)) > plan.CAUSAL_CALLS, t  # no more queries a call than the bound asks
    assert [plan.causal_rows(t) for t in (65, 256, 257, 300, 512)] == [64, 64, 65, 75, 128]


@torch.no_grad()
def test_rows_of_a_prompt_are_their_own_prefixes():
    """Row i of a blocked prompt is the last row of the prompt cut after token i: no key past its own."""
    q, k, v = qkv(3 * BLOCK + 5, torch.float32)
    full = attention(q, k, v, causal=True)  # (B, H, T, D)
    for i in (0, BLOCK - 1, BLOCK, 2 * BLOCK + 7, 3 * BLOCK + 4):
        alone = attention(q[:, :, : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], causal=True)[:, :, -1]  # (B, H, D)
        torch.testing.assert_close(full[:, :, i], alone, atol=1e-6, rtol=1e-6)


@torch.no_grad()
def test_where_mkl_runs_avx512_kernels_a_prompt_is_one_kernel_call(monkeypatch):
    monkeypatch.setattr(plan, "mkl_avx512", lambda: True)
    q, k, v = qkv(300, torch.float32)
    assert torch.equal(attention(q, k, v, causal=True), one_call(q, k, v))


@pytest.mark.parametrize("case", ["short", "long", "grad"])
def test_other_prompts_keep_one_kernel_call(case):
    t = {"short": BLOCK, "long": plan.CAUSAL_BLOCKS_UP_TO + 1, "grad": 300}[case]
    q, k, v = qkv(t, torch.float32, grad=case == "grad")
    with torch.no_grad() if case != "grad" else torch.enable_grad():
        assert torch.equal(attention(q, k, v, causal=True), one_call(q, k, v))


@torch.no_grad()
def test_a_prompt_through_an_empty_cache_is_blocked_the_same():
    q, k, v = qkv(200, torch.bfloat16)
    cache = KVCache(1, 4, 256, 16, dtype=torch.bfloat16)
    assert torch.equal(attention(q, k, v, causal=True, cache=cache), attention(q, k, v, causal=True))
