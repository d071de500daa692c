"""The math backend's decode-shaped half-precision path on the CPU (float32 matmuls, keys converted a
block at a time) against the float64 reference: at least as close as the plain half matmuls."""

import math

import pytest
import torch
from reference import reference_attention

import headwise as hw
from headwise import KVCache, attention
from headwise.backends import math as math_backend
from headwise.backends import plan


def half_yardstick(q, k, v, real, *, window=None):
    """The half matmuls with a float32 softmax (GQA by repeating keys): the error any half path may have."""
    H, T, D = q.shape[1:]
    S, G = k.shape[2], H // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # (B, H, S, D) x2
    logits = (q @ k.transpose(-2, -1)).float() / math.sqrt(D)  # (B, H, T, S)
    pos = torch.arange(S - T, S)[:, None]  # (T, 1) the queries' positions
    keys = torch.arange(S)[None]  # (1, S)
    ok = (keys <= pos) & (real[:, None, None, :] if real is not None else True)  # (B?, 1?, T, S)
    if window is not None:
        ok = ok & (keys > pos - window)
    w = torch.softmax(logits.masked_fill(~ok, -math.inf), dim=-1)  # (B, H, T, S)
    return w.to(q.dtype) @ v  # (B, H, T, D)


def steps(dtype, *, B=3, H=6, Hkv=2, D=16, prompt=7, new=5, T=1, padded=True, window=None, seed=0):
    """Yield (q, keys, values, real) of each decode step after a (left-padded) prompt, and the cache it used."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(B, Hkv, prompt + new * T, D, dtype=dtype) if window is None else KVCache.sliding(B, Hkv, window, D, dtype=dtype)
    real = torch.ones(B, prompt, dtype=torch.bool)  # (B, prompt)
    if padded:
        real[1, :3] = False  # row 1 left-padded
        real[2, :1] = False
    k, v = (torch.randn(B, Hkv, prompt, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, H, prompt, D, generator=g).to(dtype)
    attention(q, k, v, causal=True, window=window, attention_mask=real, cache=cache)  # the prompt
    keys, values = k, v
    for _ in range(new):
        q = torch.randn(B, H, T, D, generator=g).to(dtype)
        k, v = (torch.randn(B, Hkv, T, D, generator=g).to(dtype) for _ in range(2))
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)  # (B, Hkv, S, D) x2
        real = torch.cat([real, torch.ones(B, T, dtype=torch.bool)], 1)  # (B, S)
        yield q, k, v, keys, values, real, cache


def errors(got, q, keys, values, real, window=None):
    want = reference_attention(q, keys, values, causal=True, window=window, attention_mask=real)  # (B, H, T, D) float64
    ours = float((got.double() - want).abs().max())
    plain = float((half_yardstick(q, keys, values, real, window=window).double() - want).abs().max())
    return ours, plain


@pytest.mark.parametrize(("dtype", "backend"), [(torch.bfloat16, "auto"), (torch.bfloat16, "math"), (torch.float16, "math")])
@pytest.mark.parametrize("T", [1, 2])
def test_decode_steps_through_a_padded_cache_match_float64(dtype, backend, T):
    for q, k, v, keys, values, real, cache in steps(dtype, T=T):
        got = attention(q, k, v, causal=True, cache=cache, backend=backend)  # (B, H, T, D)
        assert got.dtype == dtype and got.shape == q.shape
        ours, plain = errors(got, q, keys, values, real)
        assert ours <= max(plain, 2**-8), (ours, plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_sliding_window_ring_cache_matches_float64(dtype):
    for q, k, v, keys, values, real, cache in steps(dtype, prompt=3, new=9, padded=False, window=4):
        got = attention(q, k, v, causal=True, window=4, cache=cache, backend="math")  # (B, H, 1, D)
        ours, plain = errors(got, q, keys, values, real, window=4)
        assert ours <= max(plain, 2**-8), (ours, plain)


def test_keys_converted_a_block_at_a_time_give_the_same_numbers(monkeypatch):
    q, _, _, keys, values, real, _ = list(steps(torch.bfloat16, prompt=30, new=1))[-1]  # 31 keys
    one = attention(q, keys, values, causal=True, attention_mask=real, backend="math")  # (B, H, 1, D): one block
    monkeypatch.setattr(plan, "FLOAT32_KEY_ELEMENTS", 3 * 2 * 16 * 5)  # 5 keys a block at B * Hkv * D = 3 * 2 * 16: 7 blocks
    assert len(math_backend._key_blocks(keys, plan.FLOAT32_KEY_ELEMENTS)) == 7
    blocks = attention(q, keys, values, causal=True, attention_mask=real, backend="math")
    ours, plain = errors(blocks, q, keys, values, real)
    assert ours <= max(plain, 2**-8)
    assert float((blocks.double() - one.double()).abs().max()) <= 2**-7  # sums in another order, one bf16 rounding


def test_which_products_run_in_float32():
    """The plan's rule: half matmuls on the CPU of at most FLOAT32_ROWS query rows per key head run in float32."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 2, 40, 16, generator=g)  # (B, Hkv, S, D)
    for dtype in (torch.bfloat16, torch.float16):
        for H, T, float32 in ((6, 1, True), (2, 8, True), (2, 9, False)):  # 3 rows a key head, 8 (still few), a prompt's 9
            q = torch.randn(2, H, T, 16).to(dtype)
            keys = plan.float32_keys(q, k.to(dtype), T)
            assert (keys is not None) == float32, (dtype, H, T)
            assert math_backend.scores(q, k.to(dtype), keys).dtype == torch.float32  # half scores: float16's range, bfloat16's rounding
            assert ("float32" in hw.plan(q, k.to(dtype), k.to(dtype), backend="math").runner) == (float32 and dtype == torch.bfloat16 and T == 1)
    q = torch.randn(2, 6, 1, 16, generator=g)
    want = q.reshape(2, 2, 3, 16) @ k.transpose(-2, -1)  # float32 as before, bit for bit
    assert torch.equal(math_backend.scores(q, k), want.view(2, 6, 1, 40))


def test_gradients_flow_through_the_float32_path():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 16, generator=g).to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, 2, 9, 16, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(2))
    attention(q, k, v, backend="math").float().sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference_attention(qd, kd, vd).sum().backward()
    for ours, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert ours.dtype == torch.bfloat16
        assert float((ours.double() - want).abs().max()) <= 2**-5 * max(1.0, float(want.abs().max()))
