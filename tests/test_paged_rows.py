"""A paged batch's one-token rows in one call (``backends.paged``): against the float64 reference, beside the
per-sequence path, in the plan, under the ``Batcher``, and what it refuses; in C++ (``backends.decode_kernel``) and as
inductor's loops where the kernel is not built and the batch is made with ``compile=True`` (the ``decode_way`` fixture)."""

from __future__ import annotations

import pytest
import torch
from reference import reference_attention
from reference_variants import variant_attention

import headwise as hw
from headwise.backends import decode_kernel
from headwise.backends import paged as paged_runner
from headwise.backends.plan import ROWS_IN_ONE_CALL
from headwise.backends.spec import Spec
from headwise.cache.static import dequantize_rows, quantize_rows

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def pool_of(lengths, *, Hkv=2, D=8, block_size=4, dtype=torch.float32, scattered=True, window=None, seed=0):
    """A pool holding sequences 0..N-1 with ``lengths`` keys, written together a block at a time (their blocks
    interleave) or each in a run set aside for it; and each sequence's keys and values as written, (1, Hkv, n, D)."""
    g = torch.Generator().manual_seed(seed)
    pool = hw.PagedKVCache(sum(-(-(n + 8) // block_size) for n in lengths) + 2, block_size, Hkv, D, dtype=dtype, window=window)
    keys: dict[int, list] = {s: [] for s in range(len(lengths))}
    values: dict[int, list] = {s: [] for s in range(len(lengths))}
    for s, n in enumerate(lengths):
        pool.add(s, reserve=0 if scattered else n + 8)
    for start in range(0, max(lengths), block_size):
        ids = [s for s, n in enumerate(lengths) if n > start]
        counts = [min(block_size, lengths[s] - start) for s in ids]
        k, v = (torch.randn(1, Hkv, sum(counts), D, generator=g).to(pool.dtype) for _ in range(2))  # (1, Hkv, T, D): an 8-bit pool takes float32
        pool.batch(ids, counts).append(k, v)
        at = 0
        for s, n in zip(ids, counts, strict=True):
            keys[s].append(k[:, :, at : at + n])
            values[s].append(v[:, :, at : at + n])
            at += n
    return pool, {s: torch.cat(keys[s], 2) for s in keys}, {s: torch.cat(values[s], 2) for s in values}


@pytest.mark.parametrize("way", ["eager", "C++"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,window", [(1, None), (3, None), (2, 5)])
def test_rows_over_blocks_against_the_float64_reference(dtype, G, window, way):
    if way == "C++" and not decode_kernel.available():
        pytest.skip("the C++ decode kernel could not be built here")
    rows_over_blocks = paged_runner.rows_over_blocks if way == "eager" else decode_kernel.paged
    lengths = [5, 17, 1, 9]
    pool, keys, values = pool_of(lengths, dtype=dtype)
    Hkv, _, D = pool.k.shape
    assert not all(pool.blocks(s) == list(range(pool.blocks(s)[0], pool.blocks(s)[0] + len(pool.blocks(s)))) for s in range(4))
    width = max(len(pool.blocks(s)) for s in range(4))
    tables = torch.tensor([pool.blocks(s) + [0] * (width - len(pool.blocks(s))) for s in range(4)])  # (N, nb)
    seen_to = torch.tensor(lengths)
    seen_from = torch.zeros(4, dtype=torch.long) if window is None else (seen_to - window).clamp(min=0)
    q = torch.randn(4, Hkv, G, D, generator=torch.Generator().manual_seed(1)).to(dtype)  # (N, Hkv, G, D)
    got = rows_over_blocks(q, pool.k, pool.v, tables, seen_from, seen_to, pool.block_size, D**-0.5)
    assert got.shape == (4, Hkv, G, D) and got.dtype == dtype
    for s in range(4):
        want = reference_attention(q[s].reshape(1, Hkv * G, 1, D).double(), keys[s].double(), values[s].double(), causal=True, window=window)
        torch.testing.assert_close(got[s].reshape(1, Hkv * G, 1, D).double(), want, **TOL[dtype])


@pytest.mark.parametrize("lengths", [[5, 40, 1, 9, 23, 3, 31], [1, 3, 5, 9, 23, 31, 40]], ids=["gathered", "sorted, sliced"])
@pytest.mark.parametrize("window", [None, 7])
def test_rows_in_groups_of_similar_length_against_the_float64_reference(window, lengths, decode_way):
    pool, keys, values = pool_of(lengths, scattered=False)
    Hkv, _, D = pool.k.shape
    width = max(len(pool.blocks(s)) for s in range(7))
    tables = torch.tensor([pool.blocks(s) + [0] * (width - len(pool.blocks(s))) for s in range(7)])  # (N, nb)
    q = torch.randn(7, Hkv, 2, D, generator=torch.Generator().manual_seed(4))  # (N, Hkv, G, D)
    got = paged_runner.attend(q, pool.k, pool.v, tables, torch.tensor(lengths), block_size=pool.block_size, scale=0.3, window=window,
                              groups=3, rows_per_group=2)  # one C++ call, or three compiled ones, each table cut to its group's longest
    for s in range(7):
        want = reference_attention(q[s].reshape(1, Hkv * 2, 1, D).double(), keys[s].double(), values[s].double(), causal=True,
                                   window=window, scale=0.3)
        torch.testing.assert_close(got[s].reshape(1, Hkv * 2, 1, D).double(), want, **TOL[torch.float32])


def step_inputs(counts, *, H, Hkv, D, dtype, seed=2):
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    return torch.randn(1, H, T, D, generator=g).to(dtype), *(torch.randn(1, Hkv, T, D, generator=g).to(dtype) for _ in range(2))


@pytest.mark.parametrize("dtype,stored", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("H,window", [(2, None), (4, 6)])
def test_a_compiled_batch_attends_as_each_sequence_alone(dtype, stored, H, window, decode_way):
    lengths, counts = [5, 17, 1, 9], [1, 3, 1, 1]  # three one-token rows in one call, one run of three beside them
    q, k, v = step_inputs(counts, H=H, Hkv=2, D=8, dtype=dtype)
    outs = {}
    for compile in (True, False):
        pool, keys, values = pool_of(lengths, dtype=stored, window=window)
        batch = pool.batch([0, 1, 2, 3], counts, compile=compile)
        runner = hw.plan(q, k, v, causal=True, window=window, cache=batch).runner
        assert (ROWS_IN_ONE_CALL in runner) == (decode_way or (compile and stored == torch.bfloat16))  # float32 loops: per sequence
        assert ("C++ kernel" in runner) == decode_way
        outs[compile] = hw.attention(q, k, v, causal=True, window=window, cache=batch)  # (1, H, T, D)
        assert [pool.length(s) for s in range(4)] == [n + c for n, c in zip(lengths, counts, strict=True)]
    at = 0
    for s, c in enumerate(counts):
        ks = torch.cat([keys[s], k[:, :, at : at + c].to(stored)], 2).double()  # as the pool holds them
        vs = torch.cat([values[s], v[:, :, at : at + c].to(stored)], 2).double()
        want = reference_attention(q[:, :, at : at + c].to(stored).double(), ks, vs, causal=True, window=window)
        torch.testing.assert_close(outs[True][:, :, at : at + c].double(), want, **TOL[stored])
        at += c
    assert outs[True].dtype == dtype
    torch.testing.assert_close(outs[True], outs[False], **TOL[stored])


def test_the_plan_takes_one_call_only_where_it_computes_every_term(decode_way):
    pool, _, _ = pool_of([5, 9], dtype=torch.bfloat16)
    q, k, v = step_inputs([1, 1], H=2, Hkv=2, D=8, dtype=torch.float32)
    one = hw.plan(q, k, v, causal=True, cache=pool.batch([0, 1], [1, 1], compile=True))
    runner = f"{ROWS_IN_ONE_CALL} ({'C++ kernel' if decode_way else 'compiled'})"
    assert (one.runner, one.backend) == (runner, "auto")
    mixed = hw.plan(*step_inputs([1, 2], H=2, Hkv=2, D=8, dtype=torch.float32), causal=True, cache=pool.batch([0, 1], [1, 2], compile=True))
    assert mixed.runner.startswith(f"per sequence: {runner}; ")
    for kw in ({"backend": "sdpa"}, {"backend": "math"}):
        assert ROWS_IN_ONE_CALL not in hw.plan(q, k, v, causal=True, cache=pool.batch([0, 1], [1, 1], compile=True), **kw).runner
    for kw in ({"softcap": 30.0}, {"alibi_slopes": torch.ones(2)}, {"sinks": torch.zeros(2)}):  # the C++ kernel's terms, not the loops'
        in_one = ROWS_IN_ONE_CALL in hw.plan(q, k, v, causal=True, cache=pool.batch([0, 1], [1, 1], compile=True), **kw).runner
        assert in_one == decode_way
    trained = torch.zeros(2, requires_grad=True)  # a sink that wants its gradient: the kernel gives none
    assert ROWS_IN_ONE_CALL not in hw.plan(q, k, v, causal=True, sinks=trained, cache=pool.batch([0, 1], [1, 1])).runner
    assert (ROWS_IN_ONE_CALL in hw.plan(q, k, v, causal=True, cache=pool.batch([0, 1], [1, 1])).runner) == decode_way  # C++: any batch
    assert [pool.length(s) for s in (0, 1)] == [5, 9]  # a plan writes nothing
    float32_pool, _, _ = pool_of([5, 9])  # over float32 views the fused kernel per sequence beat inductor's loops, not the C++ kernel
    float32_plan = hw.plan(q, k, v, causal=True, cache=float32_pool.batch([0, 1], [1, 1], compile=True))
    assert (ROWS_IN_ONE_CALL in float32_plan.runner) == decode_way


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,window", [(1, None), (3, None), (2, 5)])
@pytest.mark.parametrize("slopes_per", ["head", "sequence and head"])
def test_the_kernel_takes_a_softcap_sinks_and_alibi_over_each_sequences_blocks(dtype, G, window, slopes_per):
    """The terms of ``decode_kernel.paged`` against the float64 reference: each sequence's query at its last key's
    position (ALiBi's distances from there), a sink per query head, scores capped, within a window or not."""
    if not decode_kernel.available():
        pytest.skip("the C++ decode kernel could not be built here")
    lengths = [5, 17, 1, 9]
    pool, keys, values = pool_of(lengths, dtype=dtype)
    Hkv, _, D = pool.k.shape
    H, g = Hkv * G, torch.Generator().manual_seed(5)
    width = max(len(pool.blocks(s)) for s in range(4))
    tables = torch.tensor([pool.blocks(s) + [0] * (width - len(pool.blocks(s))) for s in range(4)])  # (N, nb)
    seen_to = torch.tensor(lengths)
    seen_from = torch.zeros(4, dtype=torch.long) if window is None else (seen_to - window).clamp(min=0)
    q = (torch.randn(4, Hkv, G, D, generator=g) * 3).to(dtype)  # (N, Hkv, G, D): scores past the cap
    sinks, slopes = torch.randn(H, generator=g), torch.rand(1 if slopes_per == "head" else 4, H, generator=g)  # (H,), (1 or N, H)
    got = decode_kernel.paged(q, pool.k, pool.v, tables, seen_from, seen_to, pool.block_size, D**-0.5, 2.0, sinks, slopes)
    for s in range(4):
        want = variant_attention(q[s].reshape(1, H, 1, D), keys[s], values[s], causal=True, window=window, softcap=2.0, sinks=sinks,
                                 alibi_slopes=slopes[s if slopes.shape[0] > 1 else 0])
        torch.testing.assert_close(got[s].reshape(1, H, 1, D).double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype,stored", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("window", [None, 6])
def test_a_batch_with_a_softcap_sinks_and_alibi_gives_each_sequence_its_numbers_alone(dtype, stored, window):
    """With the terms, a paged batch's one-token rows still take the one C++ call, and each row equals the decode kernel
    over its sequence's keys alone bit for bit (and the float64 reference within the dtype's tolerance)."""
    if not decode_kernel.available():
        pytest.skip("the C++ decode kernel could not be built here")
    lengths, H, Hkv, D = [5, 17, 1, 9, 30], 6, 2, 64
    pool, keys, values = pool_of(lengths, dtype=stored, Hkv=Hkv, D=D, window=window)
    q, k, v = step_inputs([1] * 5, H=H, Hkv=Hkv, D=D, dtype=dtype)
    g = torch.Generator().manual_seed(6)
    terms = {"softcap": 1.5, "sinks": torch.randn(H, generator=g), "alibi_slopes": torch.rand(H, generator=g)}
    batch = pool.batch(list(range(5)), [1] * 5)
    assert ROWS_IN_ONE_CALL in hw.plan(q, k, v, causal=True, window=window, cache=batch, **terms).runner
    got = hw.attention(q, k, v, causal=True, window=window, cache=batch, **terms)  # (1, H, N, D)
    for s in range(5):
        ks = torch.cat([keys[s], k[:, :, s : s + 1].to(stored)], 2)  # (1, Hkv, n + 1, D): as the pool holds them
        vs = torch.cat([values[s], v[:, :, s : s + 1].to(stored)], 2)
        spec = Spec(1, ks.shape[2], causal=True, window=window, softcap=1.5, sinks=terms["sinks"], alibi=terms["alibi_slopes"][None],
                    scale=D**-0.5)
        alone = decode_kernel.run(q[:, :, s : s + 1].to(stored), ks, vs, spec)
        assert torch.equal(got[:, :, s : s + 1], alone.to(dtype))
        want = variant_attention(q[:, :, s : s + 1].to(stored), ks, vs, causal=True, window=window, **terms)
        torch.testing.assert_close(got[:, :, s : s + 1].double(), want, **TOL[stored])


def test_its_plans_run_is_the_same_call_over_each_rows_own_keys(decode_way):
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    for window in (None, 4):
        got = paged_runner.rows_over_own_keys(q, k, v, Spec(1, 11, causal=True, window=window, scale=8**-0.5))
        torch.testing.assert_close(got.double(), reference_attention(q.double(), k.double(), v.double(), causal=True, window=window))
    if decode_way:  # the C++ kernel's terms: a row of slopes per batch row
        sinks, slopes = torch.randn(4, generator=g), torch.rand(2, 4, generator=g)
        got = paged_runner.rows_over_own_keys(q, k, v, Spec(1, 11, causal=True, softcap=2.0, sinks=sinks, alibi=slopes, scale=8**-0.5))
        want = variant_attention(q, k, v, causal=True, softcap=2.0, sinks=sinks, alibi_slopes=slopes)
        torch.testing.assert_close(got.double(), want)


def test_a_refused_call_changes_nothing():
    pool, _, _ = pool_of([5, 9], dtype=torch.bfloat16)
    before = (pool.k.clone(), [pool.length(s) for s in (0, 1)], pool.free_blocks)
    q, k, v = step_inputs([1, 1], H=2, Hkv=2, D=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="shape"):
        hw.attention(q, k[:, :, :1], v[:, :, :1], causal=True, cache=pool.batch([0, 1], [1, 1], compile=True))
    assert torch.equal(pool.k, before[0]) and [pool.length(s) for s in (0, 1)] == before[1] and pool.free_blocks == before[2]


def test_compile_must_be_a_bool():
    pool, _, _ = pool_of([5])
    with pytest.raises(TypeError, match="compile must be True or False, got int 1"):
        pool.batch([0], [1], compile=1)
    model = hw.models.GPT2LMHeadModel(hw.GPT2Config(vocab_size=11, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    with pytest.raises(TypeError, match="compile must be True or False, got str 'yes'"):
        hw.models.Batcher(model, num_blocks=4, compile="yes")


def test_append_rows_gives_the_one_token_rows_fewest_keys_first_and_the_longer_runs_apart():
    """The rows come sorted by the keys each sees (the one call groups them in that order, as slices), each with its own
    place in the packed row, its own block table and key count; a sequence of several new tokens is a run of its own."""
    pool, _, _ = pool_of([9, 2, 30, 5])
    Hkv, _, D = pool.k.shape
    batch = pool.batch([0, 1, 2, 3], [1, 3, 1, 1], compile=True)  # rows 0 | 1 2 3 | 4 | 5 of T = 6
    k, v = (torch.randn(1, Hkv, 6, D) for _ in range(2))
    runs, rows = batch.append_rows(k, v)
    assert rows.seen_to.tolist() == [6, 10, 31] and rows.rows.tolist() == [5, 0, 4]  # sequences 3, 0, 2
    for n, s in enumerate([3, 0, 2]):
        blocks = pool.blocks(s)
        assert rows.tables[n, : len(blocks)].tolist() == blocks
    assert [run.rows for run in runs] == [slice(1, 4)] and runs[0].keys.shape == (1, Hkv, 5, D)  # sequence 1: 2 + 3 keys


def test_the_tables_of_runs_and_of_scattered_blocks_in_one_batch():
    """Sequences whose blocks are consecutive (their tables made from the first block) and sequences whose blocks are
    not (their own lists) in one batch: each row's table is its blocks, padded with block 0, and its keys land in them."""
    pool = hw.PagedKVCache(40, 4, 2, 8)
    for s, reserve in enumerate([0, 20, 0, 12]):  # 0 and 2 take blocks as they come (interleaved), 1 and 3 a run each
        pool.add(s, reserve=reserve)
    for counts in ([3, 5, 2, 4], [4, 6, 3, 4], [1, 1, 1, 1]):
        k, v = (torch.randn(1, 2, sum(counts), 8) for _ in range(2))
        _, rows = pool.batch([0, 1, 2, 3], counts).append_rows(k, v)
    assert [pool.blocks(s) == list(range(pool.blocks(s)[0], pool.blocks(s)[0] + len(pool.blocks(s)))) for s in range(4)] == [False, True, False, True]
    order = [2, 0, 3, 1]  # fewest keys first: 6, 8, 9, 12
    assert rows.seen_to.tolist() == [pool.length(s) for s in order] and rows.rows.tolist() == [2, 0, 3, 1]
    width = max(len(pool.blocks(s)) for s in order)
    assert rows.tables.tolist() == [pool.blocks(s) + [0] * (width - len(pool.blocks(s))) for s in order]
    for n, s in enumerate(order):  # the token just written sits at the slot its table gives its position
        j = pool.length(s) - 1
        slot = rows.tables[n, j // 4].item() * 4 + j % 4
        assert torch.equal(pool.k[:, slot], k[0, :, rows.rows[n]]) and torch.equal(pool.v[:, slot], v[0, :, rows.rows[n]])


@pytest.mark.parametrize("scattered", [True, False])
@pytest.mark.parametrize("dtype,stored", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("lengths,D", [([5, 17, 1, 9], 64), ([5, 17, 1, 9, 30, 2, 44, 12, 8, 25, 3, 19], 64), ([30, 2, 44, 12, 8, 25, 3, 19], 80)],
                         ids=["4 sequences", "12 sequences (each thread's next item)", "8 sequences, D=80"])
def test_the_one_call_gives_each_sequence_its_numbers_alone_bit_for_bit(dtype, stored, scattered, lengths, D):
    """Each one-token row of the one C++ call equals the same query over its sequence's keys alone in a dense cache (the
    kernel ``generate`` runs), bit for bit: the query in the pool's dtype, the same sums in the same order, whether its
    blocks lie apart (a run a block) or in one run (read as one). With 8 items or more a thread (2 threads here), each
    thread takes its next (sequence, key head) ahead and asks that item's first run of keys in: the same bits."""
    if not decode_kernel.available():
        pytest.skip("the C++ decode kernel could not be built here")
    N = len(lengths)
    pool, keys, values = pool_of(lengths, dtype=stored, Hkv=2, D=D, scattered=scattered)
    q, k, v = step_inputs([1] * N, H=6, Hkv=2, D=D, dtype=dtype)
    batch = pool.batch(list(range(N)), [1] * N)
    assert ROWS_IN_ONE_CALL in hw.plan(q, k, v, causal=True, cache=batch).runner
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # 2 N items: taken ahead from 8 sequences on
    try:
        got = hw.attention(q, k, v, causal=True, cache=batch)  # (1, H, N, D)
    finally:
        torch.set_num_threads(threads)
    for s in range(N):
        ks = torch.cat([keys[s], k[:, :, s : s + 1].to(stored)], 2)  # (1, Hkv, n + 1, D): as the pool holds them
        vs = torch.cat([values[s], v[:, :, s : s + 1].to(stored)], 2)
        alone = decode_kernel.run(q[:, :, s : s + 1].to(stored), ks, vs, Spec(1, ks.shape[2], causal=True, scale=D**-0.5))
        assert torch.equal(got[:, :, s : s + 1], alone.to(dtype))


def read_back(x: torch.Tensor) -> torch.Tensor:
    """Keys or values as an 8-bit pool holds them, read back in float32 (its rows' values times their scales)."""
    return dequantize_rows(quantize_rows(x))


@pytest.mark.parametrize("G,window", [(1, None), (3, None), (2, 5)])
@pytest.mark.parametrize("D", [64, 80])
def test_the_kernel_reads_an_8_bit_pool_as_its_rows_read_back(G, window, D):
    """Float32 queries over a pool of 8-bit rows, read in place: against the float64 reference over the rows read back,
    and bit for bit the kernel over the same rows of the float32 pool they read back as."""
    if not decode_kernel.available():
        pytest.skip("the C++ decode kernel could not be built here")
    lengths = [5, 17, 1, 9]
    pool, keys, values = pool_of(lengths, dtype=torch.int8, D=D)
    assert pool.k.dtype == torch.int8 and pool.k.shape[2] == D + 4 and pool.dtype == torch.float32 and pool.head_dim == D
    width = max(len(pool.blocks(s)) for s in range(4))
    tables = torch.tensor([pool.blocks(s) + [0] * (width - len(pool.blocks(s))) for s in range(4)])  # (N, nb)
    seen_to = torch.tensor(lengths)
    seen_from = torch.zeros(4, dtype=torch.long) if window is None else (seen_to - window).clamp(min=0)
    q = torch.randn(4, 2, G, D, generator=torch.Generator().manual_seed(1))  # (N, Hkv, G, D)
    got = decode_kernel.paged(q, pool.k, pool.v, tables, seen_from, seen_to, pool.block_size, D**-0.5)
    assert got.shape == (4, 2, G, D) and got.dtype == torch.float32
    wide = decode_kernel.paged(q, dequantize_rows(pool.k), dequantize_rows(pool.v), tables, seen_from, seen_to, pool.block_size, D**-0.5)
    assert torch.equal(got, wide)
    for s in range(4):
        want = reference_attention(q[s].reshape(1, 2 * G, 1, D).double(), read_back(keys[s]).double(), read_back(values[s]).double(),
                                   causal=True, window=window)
        torch.testing.assert_close(got[s].reshape(1, 2 * G, 1, D).double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("scattered", [True, False])
@pytest.mark.parametrize("counts", [[1, 1, 1, 1], [1, 3, 1, 1]], ids=["one-token rows", "and a run of three"])
def test_a_batch_over_an_8_bit_pool_gives_each_sequence_its_8_bit_cache_numbers_bit_for_bit(scattered, counts, decode_way):
    """Each sequence of a batch over 8-bit rows: the numbers of its tokens through a ``KVCache(dtype=torch.int8)``
    holding the same keys, bit for bit (one-token rows in the one C++ call where it is built, else sequence by
    sequence; a run of several tokens over its rows read back); what the pool stores is ``quantize_rows``'s rows."""
    lengths, H, D = [5, 17, 1, 9], 4, 64
    pool, keys, values = pool_of(lengths, dtype=torch.int8, D=D, scattered=scattered)
    q, k, v = step_inputs(counts, H=H, Hkv=2, D=D, dtype=torch.float32)
    batch = pool.batch([0, 1, 2, 3], counts)
    assert (ROWS_IN_ONE_CALL in hw.plan(q, k, v, causal=True, cache=batch).runner) == decode_way
    got = hw.attention(q, k, v, causal=True, cache=batch)  # (1, H, T, D)
    assert got.dtype == torch.float32
    at = 0
    for s, c in enumerate(counts):
        cache = hw.KVCache(1, 2, 32, D, dtype=torch.int8)
        hw.attention(torch.zeros(1, H, lengths[s], D), keys[s], values[s], causal=True, cache=cache)  # the same keys held
        alone = hw.attention(q[:, :, at : at + c], k[:, :, at : at + c], v[:, :, at : at + c], causal=True, cache=cache)
        assert torch.equal(got[:, :, at : at + c], alone)
        slots = [pool.blocks(s)[j // 4] * 4 + j % 4 for j in range(pool.length(s))]
        assert torch.equal(pool.k[:, slots], cache.k[0, :, : pool.length(s)]) and torch.equal(pool.v[:, slots], cache.v[0, :, : pool.length(s)])
        at += c


def test_an_8_bit_pool_refuses_what_it_cannot_hold_before_anything_is_written():
    pool = hw.PagedKVCache(8, 4, 2, 8, dtype=torch.int8)
    pool.add(0)
    k = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=r"the PagedKVCache holds torch.int8; k is torch.bfloat16 \(an 8-bit pool takes float32\)"):
        pool.batch([0], [3]).append(k.bfloat16(), k.bfloat16())
    with pytest.raises(TypeError, match=r"the cache holds 8-bit rows of float32 or bfloat16 keys and values; they are torch.float16"):
        hw.attention(torch.randn(1, 2, 3, 8).half(), k.half(), k.half(), causal=True, cache=pool.batch([0], [3]))
    with pytest.raises(ValueError, match=r"k requires grad, but a PagedKVCache serves inference only"):
        pool.batch([0], [3]).append(k.requires_grad_(), k.detach())
    assert pool.length(0) == 0 and not pool.k.any() and pool.free_blocks == 8
    with pytest.raises(ValueError, match=r"8-bit rows in a paged pool are read in one call by the C\+\+ decode kernel only"):
        paged_runner.attend(torch.randn(1, 2, 1, 8).bfloat16(), pool.k, pool.v, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                            block_size=4, scale=1.0, window=None, groups=1, rows_per_group=1)


def test_forks_of_an_8_bit_pool_copy_the_rows_they_share_on_write():
    """Copy-on-write copies a shared block's 8-bit rows whole (values and scales): each fork reads its own keys."""
    pool, keys, _ = pool_of([6], dtype=torch.int8, D=8, scattered=False)
    pool.fork(0, 1)
    k0, k1 = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    pool.batch([0], [1]).append(k0, k0)
    pool.batch([1], [1]).append(k1, k1)
    for s, new in ((0, k0), (1, k1)):
        held, _ = pool.batch([s], [1])._read(s)  # (1, Hkv, 7, D) read back
        torch.testing.assert_close(held, read_back(torch.cat([keys[0], new], 2)), rtol=0, atol=0)
