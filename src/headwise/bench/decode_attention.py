"""A decode step's attention on the CPU, seven ways to run it, timed side by side.

One query per row (T = 1) over the first S keys of a preallocated (B, Hkv, L, D) cache (a slice:
not contiguous across heads), S growing by one every step as in generation:

- ``half``: q·k and weights·v in the half type, k and v read in place (a plain matmul);
- ``half, copied``: the same with k and v copied contiguous first;
- ``float32``: the math backend's way (``backends.math.scores`` / ``context``; the plan's runner at
  G = 1 elsewhere): both matmuls in float32, keys and values converted a block at a time;
- ``sdpa``: torch's fused kernel, one query row per query head (``enable_gqa``; the plan's runner at
  G = 1 where MKL runs its AVX-512 kernels, ``backends.plan.mkl_avx512``);
- ``sdpa, grouped rows``: the fused kernel with each key head's G query heads as G rows
  (``backends.sdpa.grouped_rows``; the same call as ``sdpa`` when G = 1);
- ``sdpa, row twice``: the fused kernel with each query row twice, the first kept (``backends.sdpa.row_twice``;
  the plan's runner at G = 1 where MKL runs no AVX-512 kernels, when the next is not built);
- ``C++ kernel``: headwise's decode kernel (``backends.decode_kernel``: one pass per key head, float32 sums; the
  plan's runner wherever it is built), left out where it could not be built.

The first three feed the same float32 softmax; the kernel keeps its own. A new S is a new shape every step, and oneDNN's
bfloat16 matmul builds a kernel per shape: each way gets shapes no other way uses, and runs
``rounds`` consecutive steps before the next way's turn (the first of each run is not timed:
it pays for the page faults the previous way's kernel builds leave behind).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _argtypes
from ..backends import decode_kernel, plan, sdpa
from ..backends import math as math_backend
from ..backends.spec import Spec

Way = Callable[[Tensor, Tensor, Tensor], Tensor]


def half(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """(B, H, 1, D) x (B, Hkv, S, D) x2 -> (B, H, 1, D): both matmuls in q's dtype, k and v read in place."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    raw = (q.reshape(B, Hkv, (H // Hkv) * T, D) @ k.transpose(-2, -1)).view(B, H, T, S)  # (B, H, T, S)
    w = torch.softmax(raw.float() / math.sqrt(D), dim=-1)  # (B, H, T, S) float32
    return (w.to(v.dtype).reshape(B, Hkv, (H // Hkv) * T, S) @ v).view(B, H, T, v.shape[3])  # (B, H, T, Dv)


def copied(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``half`` with k and v copied contiguous first."""
    return half(q, k.contiguous(), v.contiguous())


def wide(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The math backend's ``scores`` and ``context`` (float32 matmuls for these shapes)."""
    keys = plan.float32_keys(q, k, q.shape[2])  # the plan's rule: float32 for these decode shapes
    w = torch.softmax(math_backend.scores(q, k, keys).float() / math.sqrt(q.shape[-1]), dim=-1)  # (B, H, T, S) float32
    return math_backend.context(w, v, 0.0, keys)  # (B, H, T, Dv)


def fused(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """torch's fused kernel, one row per query head."""
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])  # (B, H, 1, Dv)


def _spec(q: Tensor, k: Tensor) -> Spec:
    """The step's terms as the plan's runners take them: causal, every key seen, 1/sqrt(D)."""
    return Spec(T=q.shape[2], S=k.shape[2], causal=True, scale=1 / math.sqrt(q.shape[-1]))


def grouped(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The fused kernel over each key head's query heads as rows (the plan's runner for G >= 2)."""
    return sdpa.grouped_rows(q, k, v, _spec(q, k))


def twice(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The fused kernel over each query row twice, the first kept (the plan's runner at G = 1 off MKL's AVX-512)."""
    return sdpa.row_twice(q, k, v, _spec(q, k))


def kernel(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """headwise's C++ decode kernel (the plan's runner wherever it is built)."""
    return decode_kernel.run(q, k, v, _spec(q, k))


WAYS: dict[str, Way] = {
    "half": half, "half, copied": copied, "float32": wide, "sdpa": fused, "sdpa, grouped rows": grouped, "sdpa, row twice": twice,
    "C++ kernel": kernel,
}


def ways(dtype: torch.dtype) -> dict[str, Way]:
    """``WAYS`` for operands of ``dtype``, less the C++ kernel where it could not be built or does not read them."""
    return {name: way for name, way in WAYS.items() if way is not kernel or (dtype in decode_kernel.DTYPES and decode_kernel.available())}


@dataclass(frozen=True)
class Result:
    """Median microseconds per step of each way (thread CPU time at 1 thread, else wall) for one shape."""

    dtype: str
    batch: int
    context: int
    group: int
    head_dim: int
    us: dict[str, float]


@torch.no_grad()
def decode_attention(
    batch: int = 1, context: int = 512, *, group: int = 3, kv_heads: int = 4, head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16, steps: int = 24, rounds: int = 6, seed: int = 0,
) -> Result:
    """Time ``ways(dtype)`` on ``steps`` decode steps each, from ``context`` keys on: one new S per call, none shared.

    Args:
        batch: B. context: the first step's S. group: query heads per key head (H = group * kv_heads).
        kv_heads: Hkv. head_dim: D. dtype: float32 or a half type. steps: timed steps per way.
        rounds: consecutive steps a way runs before the next way's turn (the first one untimed).
    """
    chosen = ways(dtype)
    n = len(chosen)
    turns = -(-steps // (rounds - 1))  # runs per way
    g = torch.Generator().manual_seed(seed)
    L = context + n * turns * rounds + 1
    K = torch.randn(batch, kv_heads, L, head_dim, generator=g).to(dtype)  # (B, Hkv, L, D): the cache's buffers
    V = torch.randn(batch, kv_heads, L, head_dim, generator=g).to(dtype)
    q = torch.randn(batch, group * kv_heads, 1, head_dim, generator=g).to(dtype)  # (B, H, 1, D)
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in chosen}
    S = context
    for turn in range(turns):
        order = list(chosen.items())[turn % n:] + list(chosen.items())[: turn % n]  # who goes first rotates
        for name, way in order:
            for r in range(rounds):
                S += 1  # every call a length no call had before
                start = clock()
                way(q, K[:, :, :S], V[:, :, :S])
                if r:
                    times[name].append(clock() - start)
    us = {name: 1e6 * statistics.median(ts[:steps]) for name, ts in times.items()}
    return Result(str(dtype).removeprefix("torch."), batch, context, group, head_dim, us)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.decode_attention``: the ways over B, S, G, D, with ratios to float32."""
    from .host import machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.decode_attention", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_argtypes.threads, default=1, help="torch threads (default 1: thread CPU time)")
    p.add_argument("--steps", type=_argtypes.integer(1), default=24, help="timed steps per way and shape")
    p.add_argument("--contexts", type=_argtypes.listing(_argtypes.integer(1), "positive ints"), default=[128, 512, 2048])
    p.add_argument("--batches", type=_argtypes.listing(_argtypes.integer(1), "positive ints"), default=[1, 8])
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(("bf16", "fp16", "fp32")), "dtypes"), default=["bf16"])
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"A decode step's attention (T = 1) over a cache slice, Hkv = 4, median µs per step ({clock}); {machine()}\n")
    types = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    names = list(WAYS)
    print("| dtype | B | S | G | D | " + " | ".join(f"{n} (µs)" for n in names) + " |")
    print("|---|---:|---:|---:|---:|" + "---:|" * len(names))
    for dtype in args.dtypes:
        for batch in args.batches:
            for context in args.contexts:
                for group in (1, 3):
                    for head_dim in (64, 128):
                        r = decode_attention(batch, context, group=group, head_dim=head_dim, dtype=types[dtype], steps=args.steps)
                        base = r.us["float32"]
                        cells = " | ".join(
                            "—" if n not in r.us else f"{r.us[n]:.0f}" + ("" if n == "float32" else f" ({r.us[n] / base:.1f}x)") for n in names
                        )
                        print(f"| {dtype} | {batch} | {context} | {group} | {head_dim} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
