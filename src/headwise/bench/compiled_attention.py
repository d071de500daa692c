"""A decode step's attention, compiled three ways or eager two, side by side: the C++ kernel, inductor's loops, neither.

``generate(..., compile=True)`` traces its decode step with the plan's compiled-decode rules: the
C++ decode kernel (``backends.decode_kernel``) where it computes the call, else "math, products
summed (compiled)": one query per row as broadcast products and sums, which inductor fuses into
loops (``backends.math``, ``summed``). Here, for each model, precision and batch at one context,
three compiled steps of one checkpoint are timed interleaved, each on caches of its own (as
``bench.model_decode`` times its compiled step): one traced with the plan's table as it is
("kernel"), one with the kernel's rule left out ("summed"), one with both left out ("without"),
where the step's attention takes the rules after them (the fused kernel, its rows or the row twice,
float32 matmuls). Each step runs under the table it was traced with, so a recompile reads the same
rules. With ``eager``, ``generate``'s eager step (unchecked) two ways: the table as it is (the C++
kernel takes the step's attention eagerly too) and without the kernel's rule ("neither": the rules
an eager step took before it).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

import torch

from .. import _argtypes
from ..backends import plan
from .model_decode import _rel, _steps
from .models import MODELS, PRECISIONS, check, checkpoint, headwise_model
from .timing import interleaved

SUMMED = "math, products summed (compiled)"
T = TypeVar("T")


@dataclass(frozen=True)
class Row:
    """Median ms of one step each way (``summed_ms`` None for an eager step: that rule is a compiled step's), and how
    far apart the logits of the others are from the kernel's (relative L2, the larger)."""

    model: str
    dtype: str
    batch: int
    context: int
    kernel_ms: float
    summed_ms: float | None
    without_ms: float
    logits_rel: float
    compiled: bool = True


def _under(rules: tuple, call: Callable[[], T]) -> Callable[[], T]:
    """``call`` run with ``plan.RULES`` set to ``rules``."""

    def run() -> T:
        kept, plan.RULES = plan.RULES, rules
        try:
            return call()
        finally:
            plan.RULES = kept

    return run


def compiled_attention(
    models: Sequence[str] = MODELS, dtypes: Sequence[str] = ("fp32", "bf16"), batches: Sequence[int] = (1, 8), *,
    context: int = 512, repeats: int = 10, warmup: int = 3, seed: int = 0, tiny: bool = False, root: Path | None = None,
    progress: Callable[[str], None] | None = None, eager: bool = False,
) -> list[Row]:
    """Time the compiled step with the plan's table, without the kernel's rule, and without the products-summed one too;
    with ``eager``, the eager step with the table and without the kernel's rule (the module docstring).

    Each compiled case compiles three steps (inductor, weights frozen: a minute or more each on 2 cores). ``tiny``:
    the models' two-layer shapes (``bench.models.checkpoint``).
    """
    for name in models:
        for dtype in dtypes:
            check(name, dtype)
    rules = {"kernel": plan.RULES, "summed": tuple(r for r in plan.RULES if r.runner != plan.DECODE_KERNEL)}
    rules["without"] = tuple(r for r in rules["summed"] if r.runner != SUMMED)
    if eager:  # the products-summed rule is a traced step's: eagerly the same table as "without"
        del rules["summed"]
    kind = "headwise" if eager else "compiled"  # _steps' name of generate's step
    rows = []
    for name in models:
        directory = checkpoint(name, root, tiny=tiny, seed=seed, positions=context)
        for dtype in dtypes:
            for batch in batches:
                if progress:
                    progress(f"{name} {dtype} B={batch} context {context}")
                steps, firsts = {}, {}
                built = {way: headwise_model(directory, dtype) for way in rules}  # a model per way, each keeping its own compiled step
                with torch.inference_mode():  # the models built outside it, as a user builds them: their steps freeze the weights
                    for way, table in rules.items():
                        gen = torch.Generator().manual_seed(seed)  # each way the same cache contents and token
                        made, first = _under(table, partial(_steps, built[way], None, batch, context, repeats + warmup, gen,
                                                            compile=not eager))()
                        steps[way], firsts[way] = _under(table, made[kind]), first[kind]
                    times = interleaved(steps, repeats=repeats, warmup=warmup)
                med = {way: 1e3 * statistics.median(ts) for way, ts in times.items()}
                apart = max(_rel(firsts[way], firsts["kernel"]) for way in rules if way != "kernel")
                rows.append(Row(name, dtype, batch, context, med["kernel"], med.get("summed"), med["without"], apart, not eager))
    return rows


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| model | dtype | B | context | step | C++ kernel (ms) | products summed (ms) | neither (ms) | kernel / summed | "
             "kernel / neither | logits apart |", "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        summed = ("—", "—") if r.summed_ms is None else (f"{r.summed_ms:.2f}", f"{r.kernel_ms / r.summed_ms:.2f}x")
        lines.append(f"| {r.model} | {r.dtype} | {r.batch} | {r.context} | {'compiled' if r.compiled else 'eager'} | "
                     f"{r.kernel_ms:.2f} | {summed[0]} | {r.without_ms:.2f} | {summed[1]} | {r.kernel_ms / r.without_ms:.2f}x | "
                     f"{r.logits_rel:.1e} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.compiled_attention``: the table, the machine first."""
    import sys

    from .host import command, load_average, machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.compiled_attention", description=__doc__.splitlines()[0])
    positive = _argtypes.integer(1)
    p.add_argument("--models", type=_argtypes.listing(_argtypes.choice(MODELS), "models"), default=list(MODELS))
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(PRECISIONS), "dtypes"), default=["fp32", "bf16"])
    p.add_argument("--batches", type=_argtypes.listing(positive, "positive ints"), default=[1, 8])
    p.add_argument("--context", type=_argtypes.integer(2), default=512)
    p.add_argument("--repeats", type=positive, default=20, help="timed rounds (default 20)")
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--eager", action="store_true", help="the eager step, with and without the C++ kernel's rule")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{machine()}; load average {load_average():.1f}\nCommand: {command('python -m headwise.bench.compiled_attention', argv)}\n",
          flush=True)
    say = lambda what: print(what, file=sys.stderr, flush=True)  # noqa: E731
    rows = compiled_attention(args.models, args.dtypes, args.batches, context=args.context, repeats=args.repeats, progress=say,
                              eager=args.eager)
    print(markdown(rows))


if __name__ == "__main__":
    main()
