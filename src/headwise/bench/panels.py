"""The compiled step's few-row GEMM alone (``headwise.linear.panels``) beside torch's kernel for the same operands.

GPT-2 small's four block weights for 12 layers (85 M weights), cycled so that every call reads its weight
from memory. For each pair of operands (x by weight: ``CASES``) and row count, one pass over all the
weights on each way and a ``sum`` of 512 MiB (the machine's read rate), interleaved rounds, medians:
GB/s of weights, and the panels' share of the ``sum``. torch's kernel for the same operands: ``F.linear``
(float32, bfloat16), ``aten._weight_int8pack_mm`` (int8 weights, bfloat16 x: ``Int8Linear``'s eager decode
kernel) and ``torch._int_mm`` (int8 x int8: ``activations="int8"``'s). Before timing, each case's outputs
are compared: the same integers for int8 x, within a few bfloat16 or float32 roundings otherwise.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _argtypes
from ..linear import panels
from ..quantize import int8_mm_takes
from .host import ReadProbe
from .timing import interleaved

#: case -> (x dtype, weight dtype), as ``panels.OPERANDS`` names them
CASES = {"fp32": (torch.float32, torch.float32), "bf16": (torch.bfloat16, torch.bfloat16),
         "int8": (torch.bfloat16, torch.int8), "int8-a8": (torch.int8, torch.int8)}
#: GPT-2 small's block weights as (N, K): Q/K/V stacked, attention output, MLP up and down
SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072))


@dataclass(frozen=True)
class Row:
    """One case at one row count: GB/s of weights read by each way, and the ``sum``'s."""

    case: str
    rows: int
    panels_gbps: float
    torch_gbps: float
    sum_gbps: float

    @property
    def ratio(self) -> float:
        """The panels' rate over torch's kernel's (> 1: the panels read faster)."""
        return self.panels_gbps / self.torch_gbps


def _weights(case: str, shapes: Sequence[tuple[int, int]], gen: torch.Generator) -> list[Tensor]:
    w_dtype = CASES[case][1]
    if w_dtype == torch.int8:
        return [torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8) for shape in shapes]  # (N, K)
    return [(torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(w_dtype) for shape in shapes]  # (N, K)


def _rows(case: str, rows: int, k: int, gen: torch.Generator) -> Tensor:
    x_dtype = CASES[case][0]
    if x_dtype == torch.int8:
        return torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8)  # (M, K)
    return torch.randn(rows, k, generator=gen).to(x_dtype)  # (M, K)


def _theirs(case: str, x: Tensor, weight: Tensor, ones: Tensor) -> Tensor:
    """torch's kernel for the case's operands: (M, K) x (N, K) -> (M, N)."""
    if case == "int8":
        if not int8_mm_takes(x, weight):  # its guard: the kernel reads past what it cannot take
            raise ValueError(f"torch's int8 kernel cannot read x {tuple(x.shape)} by weight {tuple(weight.shape)}")
        return torch.ops.aten._weight_int8pack_mm(x, weight, ones)  # bfloat16 sums, unit scales
    if case == "int8-a8":
        return torch._int_mm(x, weight.t())  # int32
    return F.linear(x, weight)


def _agree(case: str, ours: Tensor, theirs: Tensor) -> bool:
    if case == "int8-a8":
        return torch.equal(ours, theirs)
    scale = theirs.double().abs().max().item() + 1e-30
    return (ours.double() - theirs.double()).abs().max().item() <= (2**-6 if ours.dtype == torch.bfloat16 else 1e-4) * scale


@torch.no_grad()
def rates(case: str, rows: int, *, layers: int = 12, shapes: Sequence[tuple[int, int]] = SHAPES, repeats: int = 7) -> Row:
    """Time one pass over ``layers`` copies of ``shapes``' weights on the panels and on torch's kernel, and the ``sum``.

    Raises:
        ValueError: the panels do not take the case's operands here, or the two ways' outputs disagree.
    """
    x_dtype, w_dtype = CASES[case]
    if (x_dtype, w_dtype) not in panels.operands(compiled=False):
        raise ValueError(f"case {case!r}: the panels do not run {x_dtype} x by {w_dtype} weights on this CPU "
                         f"(they run {panels.operands(compiled=False)})")
    gen = torch.Generator().manual_seed(0)
    weights = _weights(case, list(shapes) * layers, gen)
    packed = [torch.ops.headwise.pack_panels(w, x_dtype) for w in weights]
    xs = {k: _rows(case, rows, k, gen) for k in {w.shape[1] for w in weights}}  # K -> (M, K)
    ones = {n: torch.ones(n, dtype=torch.bfloat16) for n in {w.shape[0] for w in weights}}  # N -> unit scales

    def ours() -> list[Tensor]:
        return [torch.ops.headwise.panels_linear(xs[w.shape[1]], p, None, w.shape[0]) for w, p in zip(weights, packed, strict=True)]

    def theirs() -> list[Tensor]:
        return [_theirs(case, xs[w.shape[1]], w, ones[w.shape[0]]) for w in weights]

    if not all(_agree(case, a, b) for a, b in zip(ours()[: len(shapes)], theirs()[: len(shapes)], strict=True)):
        raise ValueError(f"case {case!r}, {rows} rows: the panels' outputs disagree with torch's kernel's")
    probe = ReadProbe()
    times = interleaved({"panels": ours, "torch": theirs, "sum": probe}, repeats=repeats, warmup=1)
    median = {way: statistics.median(ts) for way, ts in times.items()}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return Row(case, rows, nbytes / median["panels"] / 1e9, nbytes / median["torch"] / 1e9, probe.gbps(median["sum"]))


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.panels``: one table, a row per case and row count."""
    from .host import machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.panels", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch threads (default: torch's)")
    p.add_argument("--cases", type=_argtypes.listing(_argtypes.choice(tuple(CASES)), "cases"), default=list(CASES),
                   help="comma-separated: fp32, bf16, int8 (bf16 x), int8-a8 (int8 x) (default all)")
    p.add_argument("--rows", type=_argtypes.listing(_argtypes.integer(1), "rows"), default=[1, 2, 4, 8, 16],
                   help="comma-separated row counts (default 1,2,4,8,16)")
    p.add_argument("--layers", type=_argtypes.integer(1), default=12, help="copies of the four weights (default 12)")
    p.add_argument("--repeats", type=_argtypes.integer(1), default=7, help="timed rounds (default 7)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"The panels GEMM alone, GPT-2 small's block weights x {args.layers} layers; {machine()}; GB/s of weights, medians\n")
    print("| case | rows | panels | torch's kernel | panels / torch | sum | panels / sum |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for case in args.cases:
        if CASES[case] not in panels.operands(compiled=False):
            print(f"| {case} | — | not on this CPU | | | | |", flush=True)
            continue
        for rows in args.rows:
            r = rates(case, rows, layers=args.layers, repeats=args.repeats)
            print(f"| {case} | {rows} | {r.panels_gbps:.1f} | {r.torch_gbps:.1f} | {r.ratio:.2f}x | {r.sum_gbps:.1f} | "
                  f"{r.panels_gbps / r.sum_gbps:.2f} |", flush=True)


if __name__ == "__main__":
    main()
