"""A causal prompt's attention on the CPU: torch's one ``is_causal`` call, blocks of queries, headwise's C++ prefill kernel.

One layer's attention (GPT-2 small's heads: H = 12, D = 64) over a causal prompt of T tokens,
inference: ``sdpa.masked_blocks`` at each block size asked for (each block of queries over the keys
it may see, one kernel call a block), torch's fused kernel in one call, and headwise's C++ prefill
kernel (``backends.prefill_kernel``, where it is built, whether or not the plan takes it on this
machine), interleaved, medians. ``auto`` names the runner ``headwise.plan`` takes for the call on
this machine. Run it quiet and with ``--busy 1`` (a core taken by another process): every call waits for
its slowest thread, so the number of calls is what contention charges. ``--cached N`` puts N keys
before the prompt (a chunk after a cache: one call then takes the bottom-right causal mask, and there
are no blocks). ``--window W`` gives each query its last W keys only: one call then folds the (T, S)
band into its mask, and the blocks are ``sdpa.masked_blocks`` (each over the keys its window reaches).
The outputs are compared with one call's before timing (float32 within 1e-5, bfloat16 within 2e-2).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .. import _argtypes
from ..backends import prefill_kernel, sdpa
from ..backends.spec import Spec
from ..functional import plan as headwise_plan
from .cases import DTYPES
from .host import add_busy_flag, busy, machine
from .timing import interleaved


@dataclass(frozen=True)
class Row:
    """One prompt length and dtype: median ms of one call, of each block size and of the C++ kernel (None where it is
    not built), and what the plan takes."""

    dtype: str
    tokens: int
    one_call_ms: float
    blocks_ms: dict[int, float]
    auto: str
    kernel_ms: float | None = None
    cached: int = 0  # keys before the prompt
    window: int | None = None  # each query's last W keys (None: every earlier key)

    def markdown(self, sizes: Sequence[int]) -> str:
        times = [self.blocks_ms.get(r) for r in sizes] + [self.kernel_ms]
        cells = " | ".join("—" if t is None else f"{t:.2f} ({t / self.one_call_ms:.2f}x)" for t in times)
        return f"| {self.dtype} | {self.tokens} | {self.one_call_ms:.2f} | {cells} | {self.auto} |"


@torch.inference_mode()
def causal_prompt(dtype: str, tokens: int, sizes: Sequence[int], *, batch: int = 4, repeats: int = 9, seed: int = 0, cached: int = 0,
                  window: int | None = None) -> Row:
    """Time one layer's causal attention over ``tokens`` queries (``dtype`` a key of ``DTYPES``) after ``cached`` keys, each
    over its last ``window`` keys where given: one call, blocks of each of ``sizes`` queries (none after cached keys but
    with a window) and the C++ prefill kernel."""
    g = torch.Generator().manual_seed(seed)
    S = cached + tokens
    q = torch.randn(batch, tokens, 12, 64, generator=g).to(DTYPES[dtype]).transpose(1, 2)  # (B, H, T, D), strided as split heads
    k, v = (torch.randn(batch, 12, S, 64, generator=g).to(DTYPES[dtype]) for _ in range(2))  # (B, H, S, D)
    spec = Spec(T=tokens, S=S, causal=True, window=window if window is not None and window < S else None, scale=64**-0.5)
    if spec.window is not None:
        mask = spec.allowed((0, tokens), (0, S), q.device)  # (T, S): the causal band of W keys
        ways = {"one": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}  # (B, H, T, D)
        ways |= {rows: partial(sdpa.masked_blocks, q, k, v, spec, rows=rows) for rows in sizes}
    elif cached:
        mask = torch.ones(tokens, S, dtype=torch.bool).tril(cached)  # (T, S): query i at position cached + i
        ways = {"one": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)}  # (B, H, T, D)
        sizes = []
    else:
        ways = {"one": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)}  # (B, H, T, D)
        ways |= {rows: partial(sdpa.masked_blocks, q, k, v, spec, rows=rows) for rows in sizes}
    if prefill_kernel.available():
        ways["kernel"] = partial(prefill_kernel.run, q, k, v, spec)
    want = ways["one"]().float()
    for name in [name for name in ways if name != "one"]:
        error = float((ways[name]().float() - want).abs().max())
        if error > (1e-5 if dtype == "fp32" else 2e-2):
            what = "the C++ prefill kernel is" if name == "kernel" else f"blocks of {name} queries are"
            raise RuntimeError(f"{what} {error:.2g} from one call ({dtype}, T = {tokens})")
    times = interleaved({str(name): run for name, run in ways.items()}, repeats=repeats, warmup=2)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    auto = headwise_plan(q, k, v, causal=True, window=spec.window).runner
    return Row(dtype, tokens, ms["one"], {r: ms[str(r)] for r in sizes}, auto, ms.get("kernel"), cached, spec.window)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.causal_blocks``: one table, a row per dtype and prompt length."""
    p = argparse.ArgumentParser(prog="python -m headwise.bench.causal_blocks", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(tuple(DTYPES)), "dtypes"), default=list(DTYPES),
                   help="comma-separated: fp32, bf16 (default both)")
    p.add_argument("--tokens", type=_argtypes.listing(_argtypes.integer(2), "prompt lengths"), default=[256, 512, 1024],
                   help="comma-separated prompt lengths (default 256,512,1024)")
    p.add_argument("--rows", type=_argtypes.listing(_argtypes.integer(1), "block sizes"), default=[64, 128, 256],
                   help="comma-separated queries per block (default 64,128,256)")
    p.add_argument("--repeats", type=_argtypes.integer(1), default=9, help="timed rounds (default 9)")
    p.add_argument("--cached", type=_argtypes.integer(0), default=0, help="keys before the prompt (default 0; then no blocks)")
    p.add_argument("--window", type=_argtypes.integer(1), default=None, help="each query's last W keys only (default: every key)")
    add_busy_flag(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("A causal prompt's attention, B = 4, H = 12, D = 64, inference" + (f", after {args.cached} cached keys" if args.cached else "")
          + (f", a window of {args.window} keys" if args.window else "")
          + f"; {machine()}"
          + (f"; {args.busy} busy processes beside it" if args.busy else "") + "; median ms (x one call's time)\n")
    print("| dtype | T | one call | " + " | ".join(f"blocks of {r}" for r in args.rows) + " | C++ prefill kernel | the plan takes |")
    print("|---|---:|---:|" + "---:|" * (len(args.rows) + 1) + "---|")
    with busy(args.busy):
        for dtype in args.dtypes:
            for tokens in args.tokens:
                row = causal_prompt(dtype, tokens, args.rows, repeats=args.repeats, cached=args.cached, window=args.window)
                print(row.markdown(args.rows), flush=True)


if __name__ == "__main__":
    main()
