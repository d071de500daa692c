"""Greedy's token choice on the CPU: torch's ``argmax`` against ``headwise.models.generate.greedy``, side by side.

``python -m headwise.bench.greedy``: for each vocabulary (GPT-2's 50257, a Llama's 32000,
Qwen's 151936) and rows B, microseconds per call of torch's argmax, of ``greedy_by_chunks`` and of ``greedy`` (headwise's
op where its library builds, else the chunks), interleaved (``timing.interleaved``), medians; every call's indices
compared (they must be equal).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import _argtypes, native
from ..models.generate import greedy, greedy_by_chunks
from .timing import interleaved


@dataclass(frozen=True)
class GreedySpeed:
    """Median microseconds per call at one vocabulary and batch."""

    vocab: int
    batch: int
    argmax_us: float
    chunks_us: float
    greedy_us: float
    op: bool  # greedy ran headwise's op (its library built here)


def greedy_speeds(vocabs: Sequence[int] = (50257, 32000, 151936), batches: Sequence[int] = (1, 8, 32), *, repeats: int = 200,
                  seed: int = 0) -> list[GreedySpeed]:
    """Time ``argmax(dim=-1)``, ``greedy_by_chunks`` and ``greedy`` on (B, vocab) random float32 logits; RuntimeError if
    any index differs."""
    op = native.built()  # (greedy's op where the library builds)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for vocab in vocabs:
        for batch in batches:
            logits = torch.randn(batch, vocab, generator=g)  # (B, vocab)
            want = logits.argmax(dim=-1)
            if not (torch.equal(greedy(logits), want) and torch.equal(greedy_by_chunks(logits), want)):
                raise RuntimeError(f"greedy and argmax chose different tokens at vocab {vocab}, B = {batch}")
            ways = {"argmax": lambda x=logits: x.argmax(dim=-1), "chunks": lambda x=logits: greedy_by_chunks(x), "greedy": lambda x=logits: greedy(x)}
            times = interleaved(ways, repeats=repeats, warmup=10)
            rows.append(GreedySpeed(vocab, batch, *(1e6 * statistics.median(times[k]) for k in ways), op))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (the machine in its header)."""
    from .host import machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.greedy", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=_argtypes.integer(1), default=200, help="timed calls of each (default 200)")
    p.add_argument("--vocabs", type=_argtypes.listing(_argtypes.integer(2), "ints >= 2"), default=[50257, 32000, 151936])
    p.add_argument("--batches", type=_argtypes.listing(_argtypes.integer(1), "positive ints"), default=[1, 8, 32])
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"Greedy's choice of token, median µs per call; {machine()}\n")
    rows = greedy_speeds(args.vocabs, args.batches, repeats=args.repeats)
    way = "headwise's op" if rows and rows[0].op else "the chunks: headwise's library did not build"
    print(f"| vocab | B | argmax (µs) | chunks (µs) | greedy (µs; {way}) | argmax / greedy | chunks / greedy |\n|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r.vocab} | {r.batch} | {r.argmax_us:.1f} | {r.chunks_us:.1f} | {r.greedy_us:.1f} | {r.argmax_us / r.greedy_us:.2f}x | "
              f"{r.chunks_us / r.greedy_us:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
