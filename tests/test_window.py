"""Sliding-window attention: query i sees keys i-W+1 .. i; the ring-buffer cache stays W long.

Oracle: the float64 reference (tests/reference.py) given an explicit (T, T) windowed mask
built here entry by entry, and the module's own full forward for float32.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BACKENDS, decode, make, on, reference_weights, tol
from hypothesis import given
from hypothesis import strategies as st
from reference import reference_attention, reference_mha

import headwise as hw


def windowed(T: int, W: int) -> torch.Tensor:
    """(T, T) bool, True where query i may see key j: i - W < j <= i."""
    return torch.tensor([[i - W < j <= i for j in range(T)] for i in range(T)])


def test_window_needs_causal_and_a_positive_int():
    with pytest.raises(ValueError, match=r"window \(sliding-window attention\) needs causal=True, got causal=False"):
        hw.MultiHeadAttention(8, 8, 8, 0.0, 2, causal=False, window=3)
    q = torch.randn(1, 2, 4, 3)
    with pytest.raises(ValueError, match=r"window \(sliding-window attention\) needs causal=True, got causal=False"):
        hw.attention(q, q, q, window=3)
    with pytest.raises(ValueError, match=r"window must be a positive int or None, got 0"):
        hw.MultiHeadAttention(8, 8, 8, 0.0, 2, window=0)
    with pytest.raises(TypeError, match=r"window must be a positive int or None, got 2.5"):
        hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2), window=2.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("W", [1, 3, 20])
def test_functional_window_is_the_explicit_band(backend, W, device):
    torch.manual_seed(W)
    q, k, v = (torch.randn(2, 4, 9, 5, dtype=torch.float64) for _ in range(3))
    got = hw.attention(*on(device, (q, k, v)), causal=True, window=W, backend=backend).cpu()
    want = reference_attention(q, k, v, mask=windowed(9, W))
    torch.testing.assert_close(got, want, **tol(device, torch.float64))


def test_sliding_cache_memory_stays_bounded():
    m = make("gpt2", H=4, Hkv=2, window=3, ctx=8)  # n_positions 8, yet decoding runs to 40 tokens
    cache = hw.KVCache.sliding(1, 2, 3, 4)
    assert cache.k.shape == cache.v.shape == (1, 2, 3, 4) and cache.max_len == 3
    ptr = cache.k.data_ptr()
    with torch.no_grad():
        m(torch.randn(1, 5, 16), cache=cache)
        for _ in range(35):
            m(torch.randn(1, 1, 16), cache=cache)
    assert len(cache) == 40  # the absolute position keeps counting
    assert cache.k.shape == (1, 2, 3, 4) and cache.k.data_ptr() == ptr  # still W slots, same storage


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_past_the_window_equals_the_full_forward(kind, backend, device):
    W = 4
    m = make(kind, window=W, backend=backend, ctx=32, device=device)
    x = torch.randn(2, 26, 16).to(device)
    schedule = [6, 1, 1, 1, 3, 1, 7, 5, 1]  # prefill > W, steps, chunks shorter and longer than W, back to back
    close = tol(device, torch.float32)
    with torch.no_grad():
        want = m(x)
        got = decode(m, x, schedule, hw.KVCache.sliding(2, m.num_kv_heads, W, m.head_dim, device=device))
        torch.testing.assert_close(got, want, **close)
        linear = decode(m, x, schedule, hw.KVCache(2, m.num_kv_heads, 32, m.head_dim, device=device))  # a full cache works too
        torch.testing.assert_close(linear, want, **close)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@given(
    W=st.integers(1, 6), schedule=st.lists(st.integers(1, 9), min_size=1, max_size=7), Hkv=st.sampled_from([1, 4]),
    pads=st.lists(st.integers(0, 3), min_size=2, max_size=2), sliding=st.booleans(), backend=st.sampled_from(BACKENDS),
    seed=st.integers(0, 2**16),
)
def test_windowed_decoding_matches_the_float64_reference_with_an_explicit_band(kind, W, schedule, Hkv, pads, sliding, backend, seed, device):
    m = make(kind, Hkv=Hkv, window=W, backend=backend, ctx=64, dtype=torch.float64, seed=seed, device=device)
    T = sum(schedule)
    x = torch.randn(2, T, 16, dtype=torch.float64)
    kpm = torch.arange(T) >= torch.tensor(pads).clamp(max=schedule[0])[:, None]  # (B, T) left padding in the prefill
    with torch.no_grad():
        kw = {"dtype": torch.float64, "device": device}
        cache = hw.KVCache.sliding(2, Hkv, W, 4, **kw) if sliding else hw.KVCache(2, Hkv, T, 4, **kw)
        got = decode(m, x.to(device), schedule, cache, kpm.to(device)).cpu()
    want = reference_mha(x, **on("cpu", reference_weights(m)), num_heads=4, num_kv_heads=Hkv, mask=windowed(T, W), attention_mask=kpm)
    torch.testing.assert_close(got, want, **tol(device, torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_sliding_decoding_equals_each_sequence_alone(backend):
    W, P = 3, 5
    m = make("mha", window=W, backend=backend, ctx=32)
    lengths = [5, 2]
    prompt, tokens = torch.randn(2, P, 16), torch.randn(2, 6, 16)
    kpm = torch.arange(P) >= P - torch.tensor(lengths)[:, None]  # (B, P) True = real
    with torch.no_grad():
        cache = hw.KVCache.sliding(2, 4, W, 4)
        out = [m(prompt, attention_mask=kpm, cache=cache)] + [m(tokens[:, i : i + 1], cache=cache) for i in range(6)]
        got = torch.cat(out, dim=1)  # (B, P + 6, C)
        assert not got.isnan().any()
        for b, n in enumerate(lengths):
            alone = torch.cat([prompt[b : b + 1, P - n :], tokens[b : b + 1]], dim=1)  # (1, n + 6, C)
            torch.testing.assert_close(got[b : b + 1, P - n :], m(alone), atol=1e-5, rtol=0)


@pytest.mark.parametrize("W", [1, 17, 64, 100])
@pytest.mark.parametrize("T,S", [(150, 150), (100, 230)], ids=["a prompt", "a chunk after 130 cached keys"])
@pytest.mark.parametrize("terms", ["none", "padding", "sinks"])
def test_a_long_windowed_prompt_runs_in_blocks_over_its_windows_and_equals_the_reference(W, T, S, terms):
    """More queries than a block (``plan.window_rows``): blocks of queries, each over the keys its window reaches, with
    padding or sinks folded in per block; the outputs and every gradient are the float64 reference's."""
    from reference_variants import variant_attention

    from headwise.backends import plan as plan_table

    g = torch.Generator().manual_seed(W + T)
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, S, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    extra = {
        "none": {},
        "padding": {"attention_mask": torch.arange(S)[None] >= torch.tensor([[0], [S - T + 30]])},  # row 1 padded on the left
        "sinks": {"sinks": torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)},
    }[terms]
    assert hw.plan(q, k, v, causal=True, window=W, **extra).runner == f"sdpa window blocks of {plan_table.window_rows(W)} queries"
    got = hw.attention(q, k, v, causal=True, window=W, **extra)
    want = variant_attention(q, k, v, causal=True, window=W, **extra)
    if terms == "padding":  # a query that sees no real key: zeros (the reference's row is not a number)
        want = torch.nan_to_num(want)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    grad = torch.randn(got.shape, generator=g, dtype=torch.float64)
    inputs = [q, k, v, *([extra["sinks"]] if terms == "sinks" else [])]
    for ours, theirs in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-9)
