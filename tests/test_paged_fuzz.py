"""PagedKVCache driven at random: sequences added (some with a run set aside), forked, written in
ragged batches, cropped, slid and freed in any order, and writes and crops that must be refused,
over small pools of small blocks. After every event each open sequence's keys and values read
through its slots are those written for it, its attention is the float64 reference over them, every
block is held as often as the tables say, free or held and never both, and a refused call changed
nothing. Each case is one seed; a failure prints the events up to it."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from reference import reference_attention

import headwise as hw
from headwise.cache import PagedKVCache

D, H = 4, 2


def state(paged: PagedKVCache) -> tuple:
    """Everything a call may change: the pools and the bookkeeping."""
    books = {name: copy.deepcopy(getattr(paged, name)) for name in ("_free", "_set_aside", "_plan", "_refs", "_tables", "_gone", "_lens", "_run")}
    slots = {s: t.tolist() for s, t in paged._slots.items()}
    return paged.k.clone(), paged.v.clone(), books, slots


def same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:]


def check(paged: PagedKVCache, written: dict[int, tuple[list, list]], events: list[str]) -> None:
    """The invariants: each sequence's held keys and values as written, the blocks' holds as the tables say."""
    holds = [0] * paged.num_blocks
    for s, (ks, vs) in written.items():
        length, first = paged.length(s), paged.first_held(s)
        assert length == len(ks), events
        slots = paged._slots[s][: length - first]  # the pool slot of each held position
        if length > first:
            assert torch.equal(paged.k[:, slots], torch.stack(ks[first:], 1)), events  # (Hkv, held, D)
            assert torch.equal(paged.v[:, slots], torch.stack(vs[first:], 1)), events
        table = paged.blocks(s)
        assert len(table) == -(-length // paged.block_size) - first // paged.block_size, events  # memory follows the tokens
        assert all(int(slot) // paged.block_size in table for slot in slots), events
        for block in table:
            holds[block] += 1
    assert holds == paged._refs, events
    free = paged._free + list(paged._set_aside)
    assert len(free) == len(set(free)) == paged.free_blocks, events
    assert set(free) == {b for b, n in enumerate(holds) if n == 0}, events  # free exactly when no one holds it


def run(seed: int) -> None:
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    Hkv = rng.choice([1, 2])
    num_blocks, block_size, window = rng.randint(3, 16), rng.choice([1, 2, 3, 4]), rng.choice([None, None, 2, 5])
    paged = PagedKVCache(num_blocks, block_size, Hkv, D, dtype=torch.float64, window=window)
    events = [f"{num_blocks} blocks of {block_size}, Hkv {Hkv}, window {window}"]
    written: dict[int, tuple[list, list]] = {}  # seq_id -> the (Hkv, D) key and value rows of each position
    next_id = 0
    for _ in range(60):
        open_ids, r = sorted(written), rng.random()
        before = state(paged)
        if r < 0.2 or not open_ids:
            reserve = rng.choice([0, 0, rng.randint(1, 3 * block_size)])
            paged.add(next_id, reserve=reserve)
            written[next_id] = ([], [])
            events.append(f"add {next_id} reserve {reserve}")
            next_id += 1
        elif r < 0.3:
            s = rng.choice(open_ids)
            paged.fork(s, next_id)
            written[next_id] = (list(written[s][0]), list(written[s][1]))
            events.append(f"fork {s} -> {next_id}")
            next_id += 1
        elif r < 0.4 or (paged.free_blocks < 2 and r < 0.8):  # (a full pool mostly frees: writes go on)
            s = rng.choice(open_ids)
            paged.free(s)
            del written[s]
            events.append(f"free {s}")
        elif r < 0.5:
            s = rng.choice(open_ids)
            length, first = paged.length(s), paged.first_held(s)
            low = first + window - 1 if first else 0
            to = rng.randint(0, length)
            events.append(f"crop {s} to {to} (of {length}, low {low})")
            if to < low:
                with pytest.raises(ValueError, match="length"):
                    paged.crop(s, to)
                assert same(state(paged), before), events
            else:
                paged.crop(s, to)
                del written[s][0][to:], written[s][1][to:]
        elif r < 0.6 and window is not None:
            s = rng.choice(open_ids)
            events.append(f"slide {s}: {paged.slide(s)} blocks back")
        else:  # a ragged batch: some sequences, 1-5 new tokens each, packed in a random order
            ids = rng.sample(open_ids, rng.randint(1, len(open_ids)))
            counts = [rng.choice([1, 1, 2, 5]) for _ in ids]
            T = sum(counts)
            q = torch.randn(1, H * Hkv, T, D, generator=gen, dtype=torch.float64)
            k, v = (torch.randn(1, Hkv, T, D, generator=gen, dtype=torch.float64) for _ in range(2))
            need = sum(paged.blocks_needed(s, n) for s, n in zip(ids, counts, strict=True))
            events.append(f"write {dict(zip(ids, counts, strict=True))}: {need} blocks needed, {paged.free_blocks} free")
            try:
                out = hw.attention(q, k, v, causal=True, window=window, cache=paged.batch(ids, counts))  # (1, H, T, D)
            except ValueError as e:  # refused (not enough blocks): nothing changed
                assert "block" in str(e), (e, events)
                assert need > paged.free_blocks, (e, events)  # refused only without room
                assert same(state(paged), before), events
            else:
                row = 0
                for s, n in zip(ids, counts, strict=True):
                    written[s][0].extend(k[0, :, row + i] for i in range(n))
                    written[s][1].extend(v[0, :, row + i] for i in range(n))
                    every_k, every_v = (torch.stack(rows, 1)[None] for rows in written[s])  # (1, Hkv, length, D)
                    want = reference_attention(q[:, :, row : row + n], every_k, every_v, causal=True, window=window)
                    torch.testing.assert_close(out[:, :, row : row + n], want, rtol=0, atol=1e-12, msg=lambda m: f"{m} {events}")
                    row += n
        check(paged, written, events)
    for s in list(written):
        paged.free(s)
    assert paged.free_blocks == num_blocks and not paged._set_aside and not paged._plan and not any(paged._refs)


@pytest.mark.parametrize("seed", range(200))
def test_a_random_run_keeps_every_sequences_keys_and_every_block_accounted_for(seed):
    run(seed)
