"""A cache's keys under the terms that number them, and calls a cache cannot serve.

A mask is numbered over every key, cached and new (S = cached + T_kv), as documents are, whichever
keys a window keeps or a ring still holds; a ring cannot serve queries older than its new keys; a
paged batch's queries are its new tokens. Oracle: the float64 reference over the same keys with no
cache at all.
"""

from __future__ import annotations

import pytest
import torch
from reference import reference_attention

import headwise as hw


def caches(W: int) -> dict[str, hw.KVCache]:
    return {"linear": hw.KVCache(2, 2, 32, 8), "ring": hw.KVCache.sliding(2, 2, W, 8)}


@pytest.mark.parametrize("kind", ["linear", "ring"])
@pytest.mark.parametrize("steps", [[6, 1], [6, 1, 1, 1], [3, 2, 1], [5, 3]], ids=str)
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_a_mask_over_a_windowed_cache_is_numbered_over_every_key(kind, steps, mask_kind):
    torch.manual_seed(0)
    W, S = 4, sum(steps)
    q, k, v = torch.randn(2, 4, S, 8), torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)  # two query heads a key head
    mask = torch.rand(2, 1, S, S) > 0.3  # (B, 1, S, S): each query's keys, by position
    if mask_kind == "float":
        mask = torch.where(mask, torch.randn(2, 1, S, S), -torch.inf)
    want = reference_attention(q, k, v, causal=True, window=W, mask=mask)  # (B, H, S, D) float64
    cache, t0 = caches(W)[kind], 0
    for t in steps:
        rows = slice(t0, t0 + t)
        got = hw.attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], causal=True, window=W, cache=cache, mask=mask[:, :, rows, : t0 + t])
        torch.testing.assert_close(got.double(), want[:, :, rows], atol=1e-6, rtol=1e-6)
        t0 += t


def test_a_mask_as_wide_as_the_kept_keys_is_refused_naming_the_width_it_needs():
    cache = hw.KVCache.sliding(1, 1, 4, 8)
    q = torch.randn(1, 1, 6, 8)
    hw.attention(q, q, q, causal=True, window=4, cache=cache)
    before = (cache.k.clone(), len(cache))
    with pytest.raises(ValueError, match=r"mask must broadcast to \(B, H, T, cached \+ T_kv\) = \(1, 1, 1, 7\), got shape \(4,\)"):
        hw.attention(q[:, :, :1], q[:, :, :1], q[:, :, :1], causal=True, window=4, cache=cache, mask=torch.ones(4, dtype=torch.bool))
    assert torch.equal(cache.k, before[0]) and len(cache) == before[1]


def test_a_ring_refuses_queries_older_than_its_new_keys_and_writes_nothing():
    cache = hw.KVCache.sliding(1, 1, 4, 8)
    q = torch.randn(1, 1, 7, 8)
    hw.attention(q[:, :, :6], q[:, :, :6], q[:, :, :6], causal=True, window=4, cache=cache)
    before = cache.k.clone()
    with pytest.raises(ValueError, match=r"a sliding cache keeps only the keys its newest tokens see: q may hold at most the T_kv = 1 new"):
        hw.attention(q[:, :, 5:], q[:, :, 6:], q[:, :, 6:], causal=True, window=4, cache=cache)  # query 5 needs key 2, gone
    assert torch.equal(cache.k, before) and len(cache) == 6
    linear = hw.KVCache(1, 1, 16, 8)  # a linear cache holds them all: the same call is attention over every key
    hw.attention(q[:, :, :6], q[:, :, :6], q[:, :, :6], causal=True, window=4, cache=linear)
    got = hw.attention(q[:, :, 5:], q[:, :, 6:], q[:, :, 6:], causal=True, window=4, cache=linear)
    torch.testing.assert_close(got.double(), reference_attention(q, q, q, causal=True, window=4)[:, :, 5:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("T", "new"), [(7, [2, 3]), (3, [2, 3]), (1, [1, 1])])
def test_a_paged_batch_refuses_queries_that_are_not_its_new_tokens_and_writes_nothing(T, new):
    pool = hw.PagedKVCache(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
    pool.add(0), pool.add(1)
    S = sum(new)
    with torch.no_grad(), pytest.raises(ValueError, match=rf"a paged batch of {S} new tokens takes q of shape \(1, H, T={S}, D\)"):
        hw.attention(torch.randn(1, 4, T, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8), causal=True, cache=pool.batch([0, 1], new))
    assert (pool.length(0), pool.length(1), pool.free_blocks) == (0, 0, 6)


@pytest.mark.parametrize("holders", [2, 3])
def test_forks_written_in_one_batch_copy_their_shared_block_only_while_another_holds_it(holders):
    pool = hw.PagedKVCache(num_blocks=holders, block_size=4, num_kv_heads=1, head_dim=8)
    pool.add(0)
    torch.manual_seed(0)
    k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 2, 8)
    with torch.no_grad():
        hw.attention(k, k, v, causal=True, cache=pool.batch([0], [2]))
        for s in range(1, holders):
            pool.fork(0, s)
        new_k, new_v = torch.randn(1, 1, holders, 8), torch.randn(1, 1, holders, 8)
        # holders - 1 copies fit in the holders - 1 free blocks: the last writer keeps the shared block
        out = hw.attention(new_k, new_k, new_v, causal=True, cache=pool.batch(list(range(holders)), [1] * holders))
    assert pool.free_blocks == 0
    for s in range(holders):  # each sequence: the two shared keys, then its own
        keys = torch.cat([k, new_k[:, :, s : s + 1]], dim=2)
        values = torch.cat([v, new_v[:, :, s : s + 1]], dim=2)
        want = reference_attention(new_k[:, :, s : s + 1], keys, values, causal=True)
        torch.testing.assert_close(out[:, :, s : s + 1].double(), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["auto", "math", "sdpa"])
def test_float16_scores_past_its_range_stay_finite_in_every_backend(backend):
    torch.manual_seed(0)
    q = (40 + torch.randn(1, 2, 9, 64)).half()  # q·q reaches ~100,000: past float16's 65,504 before the scale
    v = torch.randn(1, 2, 9, 64).half()
    got = hw.attention(q, q, v, causal=True, backend=backend)
    want = reference_attention(q, q, v, causal=True)
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)
    weights = hw.attention_weights(q, q, causal=True)
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights.double().sum(-1), torch.ones(1, 2, 9, dtype=torch.float64), atol=1e-3, rtol=0)
