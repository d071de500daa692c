"""PagedKVCache: ragged batches through attention equal a KVCache per sequence and the float64
reference, wherever the blocks sit; forks share blocks until written; errors leave the pool as it was."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from reference import reference_attention

import headwise as hw
from headwise.cache import PagedKVCache

D = 8


def scramble(paged: PagedKVCache, rng: random.Random) -> None:
    """Take every free block with one-token sequences, then free them in random order: the
    blocks handed out next come from all over the pool, in no order."""
    ids = list(range(-paged.free_blocks, 0))
    for seq_id in ids:
        paged.add(seq_id)
    Hkv = paged.k.shape[0]
    kv = torch.zeros(1, Hkv, len(ids), D, dtype=paged.dtype)
    hw.attention(torch.zeros(1, Hkv, len(ids), D, dtype=paged.dtype), kv, kv, cache=paged.batch(ids, [1] * len(ids)))
    rng.shuffle(ids)
    for seq_id in ids:
        paged.free(seq_id)


# (step, [(sequence, new tokens), ...]): prefills, decode steps, a sequence joining, one leaving
SCHEDULE = [
    [(0, 20), (1, 7)],
    [(0, 1), (1, 1)],
    [(1, 1), (2, 33), (0, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(2, 5), (0, 1)],
    [(2, 1), (0, 1), (1, 1)],
]


def fragment(paged: PagedKVCache) -> None:
    """Hold every other block of a fresh pool with one-token sequences: no two free blocks are consecutive."""
    ids = list(range(-paged.free_blocks, 0))
    for seq_id in ids:
        paged.add(seq_id)
    kv = torch.zeros(1, paged.k.shape[0], len(ids), D, dtype=paged.k.dtype)
    paged.batch(ids, [1] * len(ids)).append(kv, kv)  # a fresh pool: id i takes block i + len(ids)
    for seq_id in ids[::2]:
        paged.free(seq_id)


def consecutive(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("placement", ["in order", "random", "reserved", "reserved, fragmented"])
def test_ragged_batches_equal_a_kvcache_per_sequence_and_the_reference(block_size, H, Hkv, window, placement):
    rng, gen = random.Random(block_size * 7 + H + Hkv), torch.Generator().manual_seed(block_size)
    blocks = {1: 96, 16: 12, 128: 6}[block_size]
    paged = PagedKVCache(2 * blocks if placement == "reserved, fragmented" else blocks, block_size, Hkv, D, dtype=torch.float64)
    if placement == "random":
        scramble(paged, rng)
    if placement == "reserved, fragmented":
        fragment(paged)
    totals = {s: sum(n for step in SCHEDULE for t, n in step if t == s) for s in range(3)}  # the tokens each sequence reaches
    static = {i: hw.KVCache(1, Hkv, 64, D, dtype=torch.float64) for i in range(3)}
    seen: dict[int, tuple[list, list]] = {i: ([], []) for i in range(3)}
    for step in SCHEDULE:
        ids, counts = [s for s, _ in step], [n for _, n in step]
        for s in ids:
            if s not in paged.sequences:
                paged.add(s, reserve=totals[s] if placement.startswith("reserved") else 0)
        T = sum(counts)
        q = torch.randn(1, H, T, D, generator=gen, dtype=torch.float64)  # packed: sequences one after another
        k = torch.randn(1, Hkv, T, D, generator=gen, dtype=torch.float64)
        v = torch.randn(1, Hkv, T, D, generator=gen, dtype=torch.float64)
        out = hw.attention(q, k, v, causal=True, window=window, cache=paged.batch(ids, counts))  # (1, H, T, D)
        row = 0
        for s, n in step:
            rows = slice(row, row + n)
            alone = hw.attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], causal=True, window=window, cache=static[s])
            torch.testing.assert_close(out[:, :, rows], alone, rtol=0, atol=1e-12)
            seen[s][0].append(k[:, :, rows])
            seen[s][1].append(v[:, :, rows])
            keys, values = torch.cat(seen[s][0], 2), torch.cat(seen[s][1], 2)  # (1, Hkv, S, D)
            want = reference_attention(q[:, :, rows], keys, values, causal=True, window=window)
            torch.testing.assert_close(out[:, :, rows], want, rtol=0, atol=1e-12)
            row += n
    for s in range(3):
        assert paged.length(s) == len(static[s])
        held = paged.blocks(s)
        assert len(held) == -(-paged.length(s) // block_size)  # ceil: memory follows the tokens held
    runs = [consecutive(paged.blocks(s)) for s in range(3)]
    if placement == "reserved":
        assert all(runs)  # every sequence read as a view
    elif placement != "in order" and block_size < 128:  # 128: every sequence fits in one block
        assert not all(runs)  # the gather path ran


def test_reserve_sets_a_run_aside_that_others_take_only_when_nothing_else_is_free():
    torch.manual_seed(0)
    paged = PagedKVCache(10, 4, 1, D, dtype=torch.float64)
    paged.add(0, reserve=12)  # blocks 0, 1, 2 set aside
    paged.add(1)
    assert paged.free_blocks == 10
    seen = {0: [], 1: []}
    for _ in range(6):  # both grow together: without the reserve their blocks would interleave
        kv = torch.randn(1, 1, 4, D, dtype=torch.float64)
        parts = paged.batch([0, 1], [2, 2]).append(kv, kv)
        seen[0].append(kv[:, :, :2])
        seen[1].append(kv[:, :, 2:])
    assert paged.blocks(0) == [0, 1, 2] and paged.blocks(1) == [3, 4, 5]
    assert parts[0].keys.untyped_storage().data_ptr() == paged.k.untyped_storage().data_ptr()  # read in place
    torch.testing.assert_close(parts[0].keys, torch.cat(seen[0], 2), rtol=0, atol=0)
    paged.free(0)
    paged.add(2, reserve=8)  # blocks 0, 1 set aside: the lowest run that holds 8 tokens
    paged.add(3, reserve=40)  # 10 blocks: no run that long, so nothing set aside
    kv = torch.randn(1, 1, 4, D, dtype=torch.float64)
    paged.batch([2], [4]).append(kv, kv)
    assert paged.blocks(2) == [0] and paged.free_blocks == 6  # block 1 still set aside for 2
    big = torch.randn(1, 1, 24, D, dtype=torch.float64)
    (part,) = paged.batch([3], [24]).append(big, big)  # 6 blocks: the 5 set aside for no one, then block 1
    assert paged.blocks(3) == [2, 6, 7, 8, 9, 1] and paged.free_blocks == 0
    torch.testing.assert_close(part.keys, big, rtol=0, atol=0)  # gathered, in order
    kv = torch.randn(1, 1, 4, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"pool is exhausted"):  # 2's set-aside block went to 3
        paged.batch([2], [4]).append(kv, kv)
    paged.free(2)
    paged.free(3)
    assert paged.free_blocks == 10 - 3
    with pytest.raises(ValueError, match=r"reserve must be an int >= 0, got -1"):
        paged.add(4, reserve=-1)
    assert 4 not in paged.sequences


def test_blocks_in_order_are_read_as_a_view_and_scattered_ones_gathered():
    paged = PagedKVCache(8, 4, 2, D)
    paged.add(0)
    kv = torch.randn(1, 2, 10, D)
    (part,) = paged.batch([0], [10]).append(kv, kv)
    assert part.keys.data_ptr() == paged.k.data_ptr()  # blocks 0, 1, 2: a view of the pool
    paged.add(1)
    paged.batch([1], [1]).append(kv[:, :, :1], kv[:, :, :1])  # block 3
    (part,) = paged.batch([0], [3]).append(kv[:, :, :3], kv[:, :, :3])  # 13 tokens: blocks 0, 1, 2, 4
    assert paged.blocks(0) == [0, 1, 2, 4]
    assert part.keys.data_ptr() != paged.k.data_ptr()
    torch.testing.assert_close(part.keys[:, :, :10], kv)


def test_fork_shares_blocks_until_written():
    torch.manual_seed(0)
    paged = PagedKVCache(16, 4, 2, D, dtype=torch.float64)
    paged.add(0)
    prompt = torch.randn(1, 2, 10, D, dtype=torch.float64)
    hw.attention(torch.randn(1, 2, 10, D, dtype=torch.float64), prompt, prompt, causal=True, cache=paged.batch([0], [10]))
    free = paged.free_blocks
    paged.fork(0, 1)
    assert paged.blocks(1) == paged.blocks(0) and paged.length(1) == 10
    assert paged.free_blocks == free  # nothing copied yet
    a, b = torch.randn(1, 2, 2, D, dtype=torch.float64), torch.randn(1, 2, 2, D, dtype=torch.float64)
    q = torch.randn(1, 2, 2, D, dtype=torch.float64)
    out = hw.attention(q, torch.cat([a[:, :, :1], b[:, :, :1]], 2), torch.cat([a[:, :, 1:], b[:, :, 1:]], 2), cache=paged.batch([0, 1], [1, 1]))
    parent, child = paged.blocks(0), paged.blocks(1)
    assert parent[:2] == child[:2]  # the two full blocks stay shared
    assert parent[2] != child[2]  # the partly filled one was copied for the child's write
    assert paged.free_blocks == free - 1
    for i, (new_k, new_v) in enumerate([(a[:, :, :1], a[:, :, 1:]), (b[:, :, :1], b[:, :, 1:])]):
        keys, values = torch.cat([prompt, new_k], 2), torch.cat([prompt, new_v], 2)  # each sees the prompt and its own token
        torch.testing.assert_close(out[:, :, i : i + 1], reference_attention(q[:, :, i : i + 1], keys, values), rtol=0, atol=1e-12)
    paged.free(0)
    assert paged.free_blocks == free - 1 + 1  # only the parent's own last block came back
    paged.free(1)
    assert paged.free_blocks == 16


def test_fork_at_a_block_boundary_copies_nothing():
    paged = PagedKVCache(8, 4, 1, D)
    paged.add(0)
    kv = torch.randn(1, 1, 8, D)
    paged.batch([0], [8]).append(kv, kv)
    paged.fork(0, 1)
    paged.batch([1], [1]).append(kv[:, :, :1], kv[:, :, :1])
    assert paged.blocks(1)[:2] == paged.blocks(0) and len(paged.blocks(1)) == 3
    assert paged.free_blocks == 8 - 3


def state(paged: PagedKVCache) -> tuple:
    return paged.free_blocks, {s: (paged.length(s), paged.blocks(s)) for s in paged.sequences}, paged.k.clone()


def test_an_exhausted_pool_raises_and_writes_nothing():
    paged = PagedKVCache(4, 4, 1, D)
    paged.add(0)
    paged.add(1)
    kv = torch.randn(1, 1, 9, D)
    paged.batch([0], [9]).append(kv, kv)  # 3 blocks
    before = state(paged)
    with pytest.raises(ValueError, match=r"pool is exhausted: writing 8 tokens needs 2 free blocks, 1 of 4 are free .*Nothing was written"):
        paged.batch([0, 1], [4, 4]).append(kv[:, :, :8], kv[:, :, :8])
    after = state(paged)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2])
    paged.batch([1], [4]).append(kv[:, :, :4], kv[:, :, :4])  # what fits still goes in
    assert paged.free_blocks == 0


def test_unknown_ids_double_free_and_reused_ids():
    paged = PagedKVCache(4, 4, 1, D)
    paged.add(0)
    with pytest.raises(ValueError, match=r"seq_id 0 is already in the cache"):
        paged.add(0)
    paged.free(0)
    with pytest.raises(ValueError, match=r"seq_id 0 is not in the cache \(freed already, or never added\); open ids: \[\]"):
        paged.free(0)
    with pytest.raises(ValueError, match=r"seq_id 7 is not in the cache"):
        paged.batch([7], [1])
    with pytest.raises(ValueError, match=r"seq_id 7 is not in the cache"):
        paged.fork(7, 8)
    paged.add(1)
    for wrong in (True, np.int64(1), "1"):  # never "not in the cache" for what is not an id at all
        with pytest.raises(TypeError, match=rf"seq_id must be an int \(as add took it\), got {type(wrong).__name__}"):
            paged.length(wrong)
        with pytest.raises(TypeError, match=r"seq_id must be an int"):
            paged.batch([wrong], [1])
    paged.free(1)
    with pytest.raises(TypeError, match=r"seq_id must be an int"):
        paged.add("a")
    assert paged.free_blocks == 4 and paged.sequences == []


def test_bad_batches():
    paged = PagedKVCache(4, 4, 1, D)
    paged.add(0)
    paged.add(1)
    kv = torch.randn(1, 1, 3, D)
    q = torch.randn(1, 2, 3, D)
    with pytest.raises(ValueError, match=r"seq_ids must not repeat"):
        paged.batch([0, 0], [1, 2])
    with pytest.raises(ValueError, match=r"new_tokens must give one count per seq_id \(2 ids, at least one\), got 1 counts"):
        paged.batch([0, 1], [3])
    with pytest.raises(ValueError, match=r"new_tokens \(each count\) must be"):
        paged.batch([0, 1], [3, 0])
    with pytest.raises(ValueError, match=r"takes k of shape \(1, Hkv=1, T=4, D=8\), got \(1, 1, 3, 8\)"):
        hw.attention(torch.randn(1, 2, 4, D), kv, kv, cache=paged.batch([0, 1], [2, 2]))
    with pytest.raises(ValueError, match=r"a paged batch of 4 new tokens takes q of shape \(1, H, T=4, D\) \(its queries are the new tokens\), got \(1, 2, 3, 8\)"):
        hw.attention(q, kv, kv, cache=paged.batch([0, 1], [2, 2]))
    with pytest.raises(TypeError, match=r"the cache is torch.float32, but the keys and values are torch.float64"):
        hw.attention(q.double(), kv.double(), kv.double(), cache=paged.batch([0, 1], [2, 1]))
    with pytest.raises(ValueError, match=r"packs real tokens only: pass attention_mask=None"):
        hw.attention(q, kv, kv, cache=paged.batch([0, 1], [2, 1]), attention_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask cannot go with a paged batch"):
        hw.attention(q, kv, kv, cache=paged.batch([0, 1], [2, 1]), mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"got PagedKVCache: pass paged.batch\(seq_ids, new_tokens\)"):
        hw.attention(q, kv, kv, cache=paged)
    with pytest.raises(ValueError, match=r"k requires grad, but a PagedKVCache serves inference only"):
        hw.attention(q, kv.requires_grad_(), kv, cache=paged.batch([0, 1], [2, 1]))
    kv = kv.detach()
    step = paged.batch([0, 1], [2, 1])
    hw.attention(q, kv, kv, cache=step)
    with pytest.raises(ValueError, match=r"this PagedBatch was used already"):
        hw.attention(q, kv, kv, cache=step)
    stale = paged.batch([0], [1])
    paged.batch([0], [1]).append(kv[:, :, :1], kv[:, :, :1])
    with pytest.raises(ValueError, match=r"seq_id 0 holds 3 tokens, not the 2 it held when this batch was made"):
        stale.append(kv[:, :, :1], kv[:, :, :1])
    assert (paged.length(0), paged.length(1)) == (3, 1)
    for name in ["num_blocks", "block_size", "num_kv_heads", "head_dim"]:
        args = {"num_blocks": 4, "block_size": 4, "num_kv_heads": 1, "head_dim": D} | {name: 0}
        with pytest.raises(ValueError, match=name):
            PagedKVCache(**args)


def test_a_layer_runs_packed_sequences_through_its_own_paged_cache():
    torch.manual_seed(0)
    m = hw.MultiHeadAttention(16, 16, 64, 0.0, num_heads=4, num_kv_heads=2).double().eval()
    paged = PagedKVCache(16, 4, 2, 4, dtype=torch.float64)
    xs = [torch.randn(1, n, 16, dtype=torch.float64) for n in (5, 9)]
    for s in (0, 1):
        paged.add(s)
    with torch.no_grad():
        out = m(torch.cat(xs, 1), cache=paged.batch([0, 1], [5, 9]))  # (1, 14, 16)
        torch.testing.assert_close(out, torch.cat([m(x) for x in xs], 1), rtol=0, atol=1e-12)
        other = hw.MultiHeadAttention(16, 16, 64, 0.0, num_heads=4, num_kv_heads=2).double()
        with pytest.raises(ValueError, match=r"this PagedKVCache belongs to MultiHeadAttention"):
            other(xs[0][:, :1], cache=paged.batch([0], [1]))


REFUSED = {  # attention arguments refused only once each sequence's keys would be known
    "softcap": ({"softcap": -1.0}, ValueError, r"softcap must be"),
    "sinks": ({"sinks": torch.randn(3)}, ValueError, r"sinks must have shape"),
    "alibi": ({"alibi_slopes": torch.randn(5)}, ValueError, r"alibi_slopes must have shape"),
    "keys of another count": ({"kv": torch.randn(1, 1, 2, D)}, ValueError, r"takes k of shape"),
    "pool exhausted": ({"new_tokens": [9, 4]}, ValueError, r"pool is exhausted"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_attention_call_leaves_the_pool_as_it_was(case):
    torch.manual_seed(0)
    paged = PagedKVCache(4, 4, 1, D)
    paged.add(0, reserve=8)
    paged.add(1)
    hw.attention(*(torch.randn(1, 1, 5, D) for _ in range(3)), causal=True, cache=paged.batch([0, 1], [3, 2]))
    before = state(paged)
    kwargs, error, match = REFUSED[case]
    args = {"new_tokens": [1, 2]} | kwargs
    T = sum(args["new_tokens"])
    q, kv = torch.randn(1, 1, T, D), args.pop("kv", torch.randn(1, 1, T, D))
    with pytest.raises(error, match=match):
        hw.attention(q, kv, kv, causal=True, cache=paged.batch([0, 1], args.pop("new_tokens")), **args)
    after = state(paged)
    assert before[:2] == after[:2] and torch.equal(before[2], after[2]) and paged._set_aside == {1: 0}


def test_crop_gives_blocks_back_and_the_sequence_continues_as_if_never_written():
    torch.manual_seed(0)
    paged = PagedKVCache(8, 4, 1, D, dtype=torch.float64)
    paged.add(0, reserve=12)  # blocks 0, 1, 2 set aside
    paged.add(1)
    kv = torch.randn(1, 1, 14, D, dtype=torch.float64)
    paged.batch([0, 1], [6, 4]).append(kv[:, :, :10], kv[:, :, :10])  # 0: blocks 0, 1; 1: block 3
    paged.batch([0], [4]).append(kv[:, :, 10:], kv[:, :, 10:])  # 0 reaches 10 tokens: block 2
    assert paged.blocks(0) == [0, 1, 2] and paged.free_blocks == 4
    paged.crop(0, 6)  # block 2 goes back to 0's run
    assert paged.length(0) == 6 and paged.blocks(0) == [0, 1] and paged.free_blocks == 5 and paged._set_aside == {2: 0}
    new = torch.randn(1, 1, 5, D, dtype=torch.float64)
    (part,) = paged.batch([0], [5]).append(new, new)
    assert paged.blocks(0) == [0, 1, 2]  # the same run: read in place
    torch.testing.assert_close(part.keys, torch.cat([kv[:, :, :6], new], 2), rtol=0, atol=0)
    paged.crop(1, 0)
    assert paged.blocks(1) == [] and paged.length(1) == 0 and paged.free_blocks == 5
    with pytest.raises(ValueError, match=r"length \(seq_id 0 holds 11 tokens\) must be an int in \[0, 11\], got 12"):
        paged.crop(0, 12)
    with pytest.raises(ValueError, match=r"seq_id 5 is not in the cache"):
        paged.crop(5, 0)


def test_bad_pool_arguments():
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype .*got torch.int64"):
        PagedKVCache(4, 4, 1, D, dtype=torch.int64)
    paged = PagedKVCache(4, 4, 1, D)
    paged.add(0)
    with pytest.raises(ValueError, match=r"new_tokens must be an int >= 0, got -3"):
        paged.blocks_needed(0, -3)
    assert paged.blocks_needed(0, 0) == 0 and paged.blocks_needed(0, 5) == 2
    paged.add(1)
    with pytest.raises(ValueError, match=r"seq_id 7 is not in the cache"):
        paged.check_room([0, 7], [1, 1])
    with pytest.raises(ValueError, match=r"counts\[0\] must be an int >= 0, got -100"):
        paged.check_room([0, 1], [-100, 40])  # (a negative count would cancel another sequence's need)
    with pytest.raises(ValueError, match=r"seq_ids and counts must be the same length, got 2 ids and 1 counts"):
        paged.check_room([0, 1], [1])
    with pytest.raises(ValueError, match=r"the PagedKVCache pool is exhausted: writing 40 tokens needs 10 free blocks"):
        paged.check_room([0, 1], [0, 40])
    with pytest.raises(ValueError, match=r"seq_ids must not repeat \(one count per sequence\), got \[0, 0\]"):
        paged.check_room([0, 0], [3, 3])  # (each count would be taken from the length now, as if the other were not written)
    assert paged.check_room((0, 1), (4, 5)) == [(1, False), (2, False)] and paged.free_blocks == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_batch_like_another_pools_takes_its_placement_only_where_the_blocks_agree(dtype):
    # three pools driven by the same steps, as a model's layers are: B's blocks lie elsewhere (scrambled), C's where A's do
    rng, gen = random.Random(3), torch.Generator().manual_seed(3)
    pools = {name: PagedKVCache(24, 4, 2, D, dtype=dtype) for name in "ABC"}
    alone = {name: PagedKVCache(24, 4, 2, D, dtype=dtype) for name in "ABC"}  # the same, each batch made on its own
    scramble(pools["B"], rng)
    scramble(alone["B"], random.Random(3))
    for step in SCHEDULE:
        ids, counts = [s for s, _ in step], [n for _, n in step]
        T = sum(counts)
        q, k, v = (torch.randn(1, 4 if i == 0 else 2, T, D, generator=gen) for i in range(3))
        first = None
        for name in "ABC":
            for cache in (pools[name], alone[name]):
                for s in ids:
                    if s not in cache.sequences:
                        cache.add(s)
            batch = pools[name].batch(ids, counts, like=first)
            out = hw.attention(q, k, v, causal=True, cache=batch)  # (1, 4, T, D)
            want = hw.attention(q, k, v, causal=True, cache=alone[name].batch(ids, counts))
            torch.testing.assert_close(out, want, rtol=0, atol=0)  # the same numbers, placed as its own pool holds them
            shared = batch._where_at is first._where_at if first is not None else False
            assert shared == (name == "C"), (name, step)  # made once where the blocks agree, made again where they do not
            first = first or batch
    for name in "ABC":
        assert pools[name].blocks(2) == alone[name].blocks(2)
    with pytest.raises(TypeError, match=r"like must be another pool's PagedBatch of the same forward pass, or None, got PagedKVCache"):
        pools["A"].batch([0], [1], like=pools["B"])
    first = pools["A"].batch([0], [1])
    pools["B"].free(0)
    with pytest.raises(ValueError, match=r"seq_id 0 is not in the cache"):  # like's lists, but a sequence this pool lacks
        pools["B"].batch([0], [1], like=first)
    with pytest.raises(ValueError, match=r"new_tokens \(each count\) must be a positive int, got 0"):  # other lists: checked
        pools["C"].batch([0], [0], like=first)
