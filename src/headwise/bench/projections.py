"""One projection's GEMM on each path ``headwise.linear`` chooses between, at the rows a prompt, a decode step and a serving step give it.

For GPT-2 small's projections (C = 768) and its tied LM head (50,257 x 768), inference, each row
count times ``F.linear`` (torch's own GEMM: MKL for float32, oneDNN for bfloat16, packing the plain
weight on each call), oneDNN's inner product on the weight packed once (``headwise.linear.onednn``)
and, where they run, the panels GEMM on the weight packed once (``headwise.linear.panels``),
interleaved, medians (oneDNN's only where its private ops work in that dtype: ``onednn.ops_error``; on CPUs without
AVX-512 they refuse bfloat16); ``auto`` names the path the rule takes for that call on this machine
(``headwise.linear.path_for``); for bfloat16 on a CPU without native bfloat16 dot products the float32 GEMM of the
operands widened (``widened``) is timed too. ``--int8``: each projection as an ``Int8Linear`` with bfloat16
activations, its weight widened to bfloat16 on each call (torch's GEMM) against the panels over the int8 weight.
``--gelu``: GPT-2's MLP input projection with its GELU after (``project(c_fc, x, act)``), four ways: ``F.linear`` then
``F.gelu``, oneDNN's GEMM with the GELU inside, the panels with the GELU inside (``panels_linear_gelu``) and the panels
then torch's GELU over their output in place (how the panels ran it before they computed it inside). Nothing here
decides anything: the rule reads CPU facts only.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import _argtypes
from ..linear import onednn, panels, path_for, rule
from ..linear.projection import widened
from ..machine import bf16_flags_on
from .cases import DTYPES
from .timing import interleaved

#: GPT-2 small's projections as (N, K): Q/K/V stacked, attention output, MLP up and down, the tied LM head.
SHAPES = {"c_attn": (2304, 768), "attn.c_proj": (768, 768), "c_fc": (3072, 768), "mlp.c_proj": (768, 3072), "lm_head": (50257, 768)}


@dataclass(frozen=True)
class Row:
    """One projection at one row count: median ms on each path (``onednn_ms``, ``panels_ms`` None where they do not
    run) and the path the rule takes."""

    name: str
    rows: int
    torch_ms: float
    onednn_ms: float | None
    auto: str
    panels_ms: float | None = None
    widened_ms: float | None = None  # bfloat16 on a CPU without its dot products: ``widened``

    @property
    def ratio(self) -> float | None:
        """oneDNN's packed weight over F.linear's time (< 1: the packed weight is the faster); None where it does not run."""
        return None if self.onednn_ms is None else self.onednn_ms / self.torch_ms


@torch.no_grad()
def projection(name: str, rows: int, dtype: torch.dtype, *, shape: tuple[int, int] | None = None, repeats: int = 15, seed: int = 0) -> Row:
    """Time ``rows`` rows through projection ``name`` (``shape`` (N, K) overrides ``SHAPES``) on each path."""
    N, K = shape or SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)  # (N, K)
    bias = None if name == "lm_head" else torch.randn(N, generator=g).to(dtype)  # (N,)
    x = torch.randn(1, rows, K, generator=g).to(dtype)  # (1, rows, K)
    ways = {"torch": lambda: F.linear(x, weight, bias)}
    if onednn.ops_error(dtype) is None:
        packed = onednn.packed(weight)
        ways["onednn"] = lambda: onednn.inner_product(x, packed, bias)
    if panels.takes(x, weight, bias):
        ways["panels"] = lambda: panels.run(x, weight, bias)  # the weight packed at the first call, kept
    auto = path_for(x, weight, bias)
    if dtype == torch.bfloat16 and not bf16_flags_on(rule.cpu()):  # the facts the rule reads
        ways["widened"] = lambda: widened(x, weight, bias)
    times = interleaved(ways, repeats=repeats, warmup=1)
    ms = {path: 1000 * statistics.median(ts) for path, ts in times.items()}
    return Row(name, rows, ms["torch"], ms.get("onednn"), auto, ms.get("panels"), ms.get("widened"))


@torch.no_grad()
def int8_projection(name: str, rows: int, dtype: torch.dtype, *, repeats: int = 15, seed: int = 0) -> tuple[float, float | None, bool]:
    """``rows`` rows of ``dtype`` through projection ``name`` as an ``Int8Linear`` with bfloat16 activations, two ways:
    torch's GEMM of the weight widened to bfloat16 on each call (``quantize._gemm``) and the panels GEMM over the int8
    weight packed once (None where they do not take it), the same arithmetic. Returns (widened ms, panels ms, whether
    the layer's own rule takes the panels for this call)."""
    from .. import quantize

    N, K = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    layer = quantize.Int8Linear(torch.randn(N, K, generator=g) / K**0.5, None if name == "lm_head" else torch.randn(N, generator=g))
    layer.bias = None if layer.bias is None else layer.bias.to(dtype)
    x = torch.randn(rows, K, generator=g).to(dtype)  # (rows, K)
    ways = {"widened": lambda: quantize._gemm(x, layer.weight, layer.scales, layer.bias)}
    if quantize.panel_sums(quantize._kernel_rows(x), layer.weight) is not None:
        ways["panels"] = lambda: quantize._scaled(quantize.panel_sums(quantize._kernel_rows(x), layer.weight), layer.scales, layer.bias, dtype)
    times = interleaved(ways, repeats=repeats, warmup=1)
    ms = {way: 1000 * statistics.median(ts) for way, ts in times.items()}
    return ms["widened"], ms.get("panels"), layer.uses_panels(x)


#: ``gelu_projection``'s ways, in its table's order
GELU_WAYS = ("F.linear, F.gelu", "oneDNN, GELU inside", "panels, GELU inside", "panels, then GELU")


@torch.no_grad()
def gelu_projection(rows: int, dtype: torch.dtype, approximate: str = "tanh", *, repeats: int = 15, seed: int = 0) -> tuple[dict[str, float], str]:
    """``rows`` rows of ``dtype`` through GPT-2's ``c_fc`` and GELU (``approximate``) each way of ``GELU_WAYS`` that runs
    here: median ms by way, and the path the rule takes for the call."""
    N, K = SHAPES["c_fc"]
    g = torch.Generator().manual_seed(seed)
    weight, bias = (torch.randn(N, K, generator=g) / K**0.5).to(dtype), torch.randn(N, generator=g).to(dtype)  # (N, K), (N,)
    x = torch.randn(1, rows, K, generator=g).to(dtype)  # (1, rows, K)
    ways = {GELU_WAYS[0]: lambda: F.gelu(F.linear(x, weight, bias), approximate=approximate)}
    if onednn.ops_error(dtype) is None:
        packed = onednn.packed(weight)
        ways[GELU_WAYS[1]] = lambda: onednn.inner_product_gelu(x, packed, bias, approximate)
    if panels.takes(x, weight, bias):
        ways[GELU_WAYS[2]] = lambda: panels.run(x, weight, bias, approximate)  # the weight packed at the first call, kept
        ways[GELU_WAYS[3]] = lambda: torch.ops.aten.gelu_(panels.run(x, weight, bias), approximate=approximate)
    times = interleaved(ways, repeats=repeats, warmup=1)
    return {way: 1000 * statistics.median(ts) for way, ts in times.items()}, path_for(x, weight, bias)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.projections``: a table per dtype, one row per projection and row count."""
    from .host import machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.projections", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(tuple(DTYPES)), "dtypes"), default=["bf16"], help="comma-separated: fp32, bf16 (default bf16)")
    p.add_argument("--rows", type=_argtypes.listing(_argtypes.integer(1), "rows"), default=[1, 8, 16, 17, 32, 64, 256, 1024],
                   help="comma-separated row counts (default 1,8,16,17,32,64,256,1024)")
    p.add_argument("--names", type=_argtypes.listing(_argtypes.choice(tuple(SHAPES)), "names"), default=list(SHAPES),
                   help=f"comma-separated projections (default all: {', '.join(SHAPES)})")
    instead = p.add_mutually_exclusive_group()
    instead.add_argument("--int8", action="store_true", help="Int8Linear's bfloat16-activation calls instead: the weight widened on each call against the panels")
    instead.add_argument("--gelu", choices=("tanh", "none"), default=None,
                         help="c_fc with its GELU (this approximation) after, four ways, instead (--names does not apply)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gelu:
        print(f"GPT-2 small's c_fc (3072 x 768) and GELU (approximate={args.gelu!r}), inference; {machine()}; median ms, and each "
              f"way's time over oneDNN's\n")
        print(f"| dtype | rows | {' | '.join(GELU_WAYS)} | the rule takes |")
        print(f"|---|---:|{'---:|' * len(GELU_WAYS)}---|")
        for dtype in args.dtypes:
            for rows in args.rows:
                ms, auto = gelu_projection(rows, DTYPES[dtype], args.gelu)
                base = ms.get(GELU_WAYS[1])
                cells = [f"{ms[w]:.3f}" + (f" ({ms[w] / base:.2f}x)" if base else "") if w in ms else "—" for w in GELU_WAYS]
                print(f"| {dtype} | {rows} | {' | '.join(cells)} | {auto} |", flush=True)
        return
    if args.int8:
        print(f"One Int8Linear projection (bfloat16 activations), inference, GPT-2 small's shapes; {machine()}; median ms\n")
        print("| activations | projection | rows | weight widened each call | panels, packed once | panels / widened | Int8Linear takes |")
        print("|---|---|---:|---:|---:|---:|---|")
        for dtype in args.dtypes:
            for name in args.names:
                for rows in args.rows:
                    wide, ours, takes = int8_projection(name, rows, DTYPES[dtype], repeats=5 if name == "lm_head" else 15)
                    cells = f"{ours:.3f} | {ours / wide:.2f}x" if ours is not None else "— | —"
                    print(f"| {dtype} | {name} | {rows} | {wide:.3f} | {cells} | {'panels' if takes else 'widened'} |", flush=True)
        return
    print(f"One projection's GEMM, inference, GPT-2 small's shapes; {machine()}; median ms\n")
    print("| dtype | projection | rows | F.linear | oneDNN, packed once | packed / F.linear | panels, packed once | panels / F.linear "
          "| widened | widened / F.linear | the rule takes |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for dtype in args.dtypes:
        for name in args.names:
            for rows in args.rows:
                r = projection(name, rows, DTYPES[dtype], repeats=5 if name == "lm_head" else 15)
                theirs = f"{r.onednn_ms:.3f} | {r.ratio:.2f}x" if r.onednn_ms is not None else "— | —"
                ours = f"{r.panels_ms:.3f} | {r.panels_ms / r.torch_ms:.2f}x" if r.panels_ms is not None else "— | —"
                wide = f"{r.widened_ms:.3f} | {r.widened_ms / r.torch_ms:.2f}x" if r.widened_ms is not None else "— | —"
                print(f"| {dtype} | {name} | {rows} | {r.torch_ms:.3f} | {theirs} | {ours} | {wide} | {r.auto} |", flush=True)


if __name__ == "__main__":
    main()
