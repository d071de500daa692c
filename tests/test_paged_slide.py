"""PagedKVCache(window=W).slide: the blocks wholly before every future query's window go back, and
attention over what stays equals the float64 reference over every key; crop and fork after a slide."""

from __future__ import annotations

import pytest
import torch
from reference import reference_attention

import headwise as hw
from headwise.cache import PagedKVCache

D, W, Hkv = 8, 5, 2


def test_sliding_sequences_hold_their_window_and_attend_as_over_every_key():
    torch.manual_seed(0)
    paged = PagedKVCache(12, 2, Hkv, D, dtype=torch.float64, window=W)
    paged.add(0)
    paged.add(1)
    keys = {0: [], 1: []}
    values = {0: [], 1: []}
    for step, counts in enumerate([[7, 3], [1, 6], *[[1, 1]] * 30, [4, 1]]):
        T = sum(counts)
        q = torch.randn(1, 4, T, D, dtype=torch.float64)
        k, v = torch.randn(1, Hkv, T, D, dtype=torch.float64), torch.randn(1, Hkv, T, D, dtype=torch.float64)
        out = hw.attention(q, k, v, causal=True, window=W, cache=paged.batch([0, 1], counts))
        row = 0
        for seq_id, n in enumerate(counts):
            keys[seq_id].append(k[:, :, row : row + n])
            values[seq_id].append(v[:, :, row : row + n])
            every_k, every_v = torch.cat(keys[seq_id], 2), torch.cat(values[seq_id], 2)  # (1, Hkv, length, D): every key written
            expected = reference_attention(q[:, :, row : row + n], every_k, every_v, causal=True, window=W)
            torch.testing.assert_close(out[:, :, row : row + n], expected, rtol=0, atol=1e-12, msg=f"step {step}, sequence {seq_id}")
            row += n
        for seq_id in (0, 1):
            paged.slide(seq_id)
            length, first = paged.length(seq_id), paged.first_held(seq_id)
            assert length == sum(t.shape[2] for t in keys[seq_id])  # positions keep counting
            assert first <= max(0, length - W + 1) < first + 2  # every key a query to come sees is held; no whole block before them
            assert len(paged.blocks(seq_id)) == -(-length // 2) - first // 2
    assert paged.first_held(0) > 20 and paged.free_blocks >= 12 - 2 * 4  # each holds about W + 1 slots, not its 40 tokens
    paged.free(0)
    paged.free(1)
    assert paged.free_blocks == 12


def test_slide_needs_a_window_and_crop_keeps_the_window_of_the_next_query():
    paged = PagedKVCache(8, 2, 1, D, window=3)
    plain = PagedKVCache(8, 2, 1, D)
    for cache in (paged, plain):
        cache.add(0)
        kv = torch.randn(1, 1, 9, D)
        cache.batch([0], [9]).append(kv, kv)
    with pytest.raises(ValueError, match=r"slide needs a cache made with window=W \(sliding-window attention\), got window=None"):
        plain.slide(0)
    assert paged.slide(0) == 3 and paged.first_held(0) == 6 and paged.blocks_needed(0, 2) == 1  # positions 6..8 held: blocks 3, 4
    assert paged.slide(0) == 0  # nothing more before the window
    with pytest.raises(ValueError, match=r"length \(seq_id 0 holds 9 tokens, keys from position 6 on\) must be an int in \[8, 9\], got 7"):
        paged.crop(0, 7)  # the next query, at 7, would see key 5, given back
    paged.crop(0, 8)
    assert paged.length(0) == 8 and paged.first_held(0) == 6 and len(paged.blocks(0)) == 1
    with pytest.raises(ValueError, match=r"window must be a positive int or None, got 0"):
        PagedKVCache(8, 2, 1, D, window=0)


def test_a_fork_after_a_slide_shares_the_held_blocks_and_each_goes_on():
    torch.manual_seed(1)
    paged = PagedKVCache(10, 2, 1, D, dtype=torch.float64, window=3)
    paged.add(0)
    prompt = torch.randn(1, 1, 7, D, dtype=torch.float64)
    paged.batch([0], [7]).append(prompt, prompt)
    paged.slide(0)
    free = paged.free_blocks
    paged.fork(0, 1)
    assert paged.blocks(1) == paged.blocks(0) and paged.first_held(1) == 4 and paged.free_blocks == free
    new = torch.randn(1, 1, 2, D, dtype=torch.float64)
    q = torch.randn(1, 1, 2, D, dtype=torch.float64)
    out = hw.attention(q, new, new, causal=True, window=3, cache=paged.batch([0, 1], [1, 1]))
    assert paged.blocks(0)[0] == paged.blocks(1)[0] and paged.blocks(0)[1] != paged.blocks(1)[1]  # the shared tail copied
    for i in range(2):
        every = torch.cat([prompt, new[:, :, i : i + 1]], 2)
        expected = reference_attention(q[:, :, i : i + 1], every, every, causal=True, window=3)
        torch.testing.assert_close(out[:, :, i : i + 1], expected, rtol=0, atol=1e-12)
    paged.slide(0)
    paged.slide(1)
    paged.free(0)
    paged.free(1)
    assert paged.free_blocks == 10
