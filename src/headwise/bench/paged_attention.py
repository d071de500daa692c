"""A decode step's attention over many sequences of a paged cache, five ways, timed interleaved.

N sequences of seeded context lengths (default GPT-2 small's heads: H = Hkv = 12, D = 64, fp32 or
bf16, block_size 16), each adding one token, through one layer's ``PagedKVCache``:

- ``views``: what the ``Batcher`` does: each sequence's blocks set aside as one run
  (``add(..., reserve=)``), so ``attention`` reads its keys and values as a view of the pool,
  one SDPA call per sequence;
- ``gathers``: the sequences written together without a reservation, so their blocks
  interleave and every read gathers (``index_select``) 2·Hkv·S·D elements, one SDPA call per
  sequence (a fragmented pool);
- ``padded``: the same reserved pool read by ONE gather into (N, Hkv, S_max, D) and ONE SDPA
  call with a key-padding mask: fewer calls, but a copy of every key and value, padded to the
  longest;
- ``one call``, over the reserved pool and over the interleaved one: the batch made with
  ``compile=True``, every sequence's query over its own blocks read in place, one call
  (``backends.paged``): the C++ decode kernel where it is built;
- ``one call, loops``: the same over the reserved pool with the kernel left out, inductor's
  compiled loops (compiled before the timed rounds). The plan takes them over bfloat16 pools
  only: over float32 ones this column times one call per sequence again.

All give the same outputs (tests/bench/test_serving.py); the times say which to use.

``--terms`` times a step with a softcap, a sink per head and ALiBi slopes (Gemma 2's, gpt-oss's and
BLOOM's terms) two ways over the reserved pool: one call (the C++ kernel computes them), and one
call per sequence (each sequence through the decode kernel over its view, the way such a step ran
before the one call took them); beside the one call without the terms.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Sequence
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _argtypes, functional
from ..backends import decode_kernel
from ..cache import PagedKVCache
from ..functional import attention
from .cases import DTYPES
from .timing import interleaved


def filled(lengths: Sequence[int], *, reserve: bool, heads: int = 12, head_dim: int = 64, block_size: int = 16,
           spare: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0) -> PagedKVCache:
    """A pool holding sequences 0..N-1 of ``lengths`` tokens (seeded keys/values), written a block at a time
    together (their blocks interleave) unless ``reserve`` set a run aside for each (``spare`` more tokens)."""
    g = torch.Generator().manual_seed(seed)
    paged = PagedKVCache(sum(-(-(n + spare) // block_size) for n in lengths) + 1, block_size, heads, head_dim, dtype=dtype)
    for s, n in enumerate(lengths):
        paged.add(s, reserve=n + spare if reserve else 0)
    for start in range(0, max(lengths), block_size):
        ids = [s for s, n in enumerate(lengths) if n > start]
        counts = [min(block_size, lengths[s] - start) for s in ids]
        kv = torch.randn(1, heads, sum(counts), head_dim, generator=g, dtype=dtype)  # (1, Hkv, T, D)
        paged.batch(ids, counts).append(kv, kv)
    return paged


def per_sequence(paged: PagedKVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(1, H, N, D) one new token of each open sequence -> (1, H, N, D): the library's path, one SDPA per sequence."""
    ids = paged.sequences
    return attention(q, k, v, causal=True, cache=paged.batch(ids, [1] * len(ids)))


def one_call(paged: PagedKVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(1, H, N, D) -> (1, H, N, D): the batch made with ``compile=True``: one call over every sequence's blocks."""
    ids = paged.sequences
    return attention(q, k, v, causal=True, cache=paged.batch(ids, [1] * len(ids), compile=True))


def one_call_loops(paged: PagedKVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``one_call`` with the C++ kernel left out: inductor's compiled loops (over a bfloat16 pool; else per sequence)."""
    built, decode_kernel.available = decode_kernel.available, lambda: False
    try:
        return one_call(paged, q, k, v)
    finally:
        decode_kernel.available = built


def padded(paged: PagedKVCache, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(1, H, N, D) -> (1, H, N, D): the tokens appended, then one gather to (N, Hkv, S_max, D) and one masked SDPA."""
    ids = paged.sequences
    paged.batch(ids, [1] * len(ids)).append(k, v)
    lengths = [paged.length(s) for s in ids]
    S, Hkv, D = max(lengths), paged.k.shape[0], paged.k.shape[2]
    slots = torch.zeros(len(ids), S, dtype=torch.long)  # (N, S): padding reads slot 0, masked out
    for i, (s, n) in enumerate(zip(ids, lengths, strict=True)):
        slots[i, :n] = paged._slots[s][:n]
    real = torch.arange(S)[None] < torch.tensor(lengths)[:, None]  # (N, S)
    keys = paged.k.index_select(1, slots.view(-1)).view(Hkv, len(ids), S, D).transpose(0, 1)  # (N, Hkv, S, D)
    values = paged.v.index_select(1, slots.view(-1)).view(Hkv, len(ids), S, D).transpose(0, 1)  # (N, Hkv, S, D)
    out = F.scaled_dot_product_attention(q[0].transpose(0, 1)[:, :, None], keys, values, attn_mask=real[:, None, None], enable_gqa=True)  # (N, H, 1, D)
    return out[:, :, 0].transpose(0, 1)[None]  # (1, H, N, D)


@torch.no_grad()
def paged_attention(sequences: int = 32, context: tuple[int, int] = (50, 1300), *, repeats: int = 15, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Median ms of one decode step's attention (one layer) over ``sequences`` sequences of contexts uniform in ``context``."""
    rng = random.Random(seed)
    lengths = [rng.randint(*context) for _ in range(sequences)]
    pools = {name: filled(lengths, reserve=reserve, dtype=dtype, spare=64 + 3)
             for name, reserve in (("views", True), ("gathers", False), ("padded", True), ("one call, views", True), ("one call, gathers", False),
                                   ("one call, loops", True))}
    ways: dict[str, Callable[[PagedKVCache, Tensor, Tensor, Tensor], Tensor]] = {
        "views": per_sequence, "gathers": per_sequence, "padded": padded, "one call, views": one_call, "one call, gathers": one_call,
        "one call, loops": one_call_loops}
    g = torch.Generator().manual_seed(seed)

    def step(name: str) -> Callable[[], Tensor]:
        def run() -> Tensor:
            q, k, v = (torch.randn(1, 12, sequences, 64, generator=g, dtype=dtype) for _ in range(3))  # (1, H, N, D)
            return ways[name](pools[name], q, k, v)
        return run

    step("one call, views")(), step("one call, gathers")(), step("one call, loops")()  # built or compiled here, not in a timed round

    times = interleaved({name: step(name) for name in ways}, repeats=repeats, warmup=1)  # each call adds a token: 64 spare
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


@torch.no_grad()
def paged_terms(sequences: int = 32, context: tuple[int, int] = (50, 1300), *, repeats: int = 15, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Median ms of one decode step's attention (one layer, views) with a softcap, sinks and ALiBi: in one call, one
    call per sequence, and in one call without the terms."""
    rng = random.Random(seed)
    lengths = [rng.randint(*context) for _ in range(sequences)]
    g = torch.Generator().manual_seed(seed)
    terms = {"softcap": 30.0, "sinks": torch.randn(12, generator=g), "alibi_slopes": torch.rand(12, generator=g) / 8}
    ways = {"one call": terms, "per sequence": terms, "one call, no terms": {}}
    pools = {name: filled(lengths, reserve=True, dtype=dtype, spare=64 + 3) for name in ways}

    def step(name: str) -> Callable[[], Tensor]:
        def run() -> Tensor:
            q, k, v = (torch.randn(1, 12, sequences, 64, generator=g, dtype=dtype) for _ in range(3))  # (1, H, N, D)
            batch = pools[name].batch(pools[name].sequences, [1] * sequences)
            if name != "per sequence":
                return attention(q, k, v, causal=True, cache=batch, **ways[name])
            with mock.patch.object(functional, "rows_in_one_call", lambda *a: False):  # each sequence its own plan
                return attention(q, k, v, causal=True, cache=batch, **ways[name])
        return run

    times = interleaved({name: step(name) for name in ways}, repeats=repeats, warmup=1)
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.paged_attention``: the three ways at 8 and 32 sequences."""
    from .host import machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.paged_attention", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(tuple(DTYPES)), "dtypes"), default=["fp32"], help="comma-separated: fp32, bf16 (default fp32)")
    p.add_argument("--terms", action="store_true", help="a step with a softcap, sinks and ALiBi: one call against one per sequence")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.terms:
        print(f"A decode step's attention with a softcap, sinks and ALiBi, one layer, H = Hkv = 12, D = 64, block_size 16, views; {machine()}; ms\n")
        print("| dtype | sequences | contexts | one call | one call per sequence | one call, no terms |")
        print("|---|---:|---|---:|---:|---:|")
        for dtype in args.dtypes:
            for n, context in ((8, (50, 1300)), (32, (50, 1300)), (32, (16, 64))):
                ms = paged_terms(n, context, dtype=DTYPES[dtype])
                per, plain = ms["per sequence"], ms["one call, no terms"]
                print(f"| {dtype} | {n} | {context[0]}..{context[1]} | {ms['one call']:.2f} | {per:.2f} ({per / ms['one call']:.2f}x) | "
                      f"{plain:.2f} ({plain / ms['one call']:.2f}x) |")
        return
    print(f"A decode step's attention, one layer, H = Hkv = 12, D = 64, block_size 16; {machine()}; ms (over the views' time)\n")
    print("| dtype | sequences | contexts | one SDPA per sequence, views | ... gathers | one padded SDPA | one call, views | one call, gathers | "
          "one call, loops |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for dtype in args.dtypes:
        for n, context in ((8, (50, 1300)), (32, (50, 1300)), (32, (16, 64))):
            ms = paged_attention(n, context, dtype=DTYPES[dtype])
            ways = ("gathers", "padded", "one call, views", "one call, gathers", "one call, loops")
            others = " | ".join(f"{ms[w]:.2f} ({ms[w] / ms['views']:.2f}x)" for w in ways)
            print(f"| {dtype} | {n} | {context[0]}..{context[1]} | {ms['views']:.2f} | {others} |")


if __name__ == "__main__":
    main()
