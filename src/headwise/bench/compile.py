"""``torch.compile``: compiled headwise modules beside the compiled fused Linear + SDPA + Linear layer.

Each implementation is compiled with inductor (``torch.compile(module)``, defaults), once per
case and mode: forward under ``torch.no_grad()`` and forward + backward are different graphs.
``compile_s`` is the first call (Dynamo's trace plus inductor's code generation; inductor's
on-disk cache can make a later run's shorter) minus the median of the timed calls. Then the
compiled modules and the same modules run eagerly are timed interleaved in one loop
(``timing.interleaved``), so that ``vs compiled fused`` and ``compile speedup`` (eager /
compiled) are ratios of numbers taken side by side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .cases import Case, Progress, seconds
from .host import Load, loaded
from .peers import IMPLS, Impl, prepare
from .timing import _quartiles, _step, interleaved

#: The implementations compiled: headwise's modules and the plain fused layer they are held to.
COMPILED = ("headwise MultiHeadAttention", "headwise GPT2MultiHeadAttention", "fused Linear + SDPA + Linear")
REFERENCE = "fused Linear + SDPA + Linear"


@dataclass(frozen=True)
class CompileRow:
    """One implementation in one case and mode, compiled and eager.

    Attributes:
        impl: the implementation's name (``peers.IMPLS``).
        mode: "forward" or "backward" (forward + backward).
        case: the shape and dtype.
        compile_s: seconds the first compiled call took beyond a steady one.
        median_s, q1_s, q3_s: the compiled call's median and quartiles.
        eager_median_s: the same module's median, eager, from the same loop.
        repeats: timed calls behind each median.
        load: the load average before and after the interleaved rounds.
    """

    impl: str
    mode: str
    case: Case
    compile_s: float
    median_s: float
    q1_s: float
    q3_s: float
    eager_median_s: float
    repeats: int
    load: Load | None = None

    @property
    def speedup(self) -> float:
        """Eager time / compiled time (above 1: compiling pays)."""
        return self.eager_median_s / self.median_s


def compile_case(
    case: Case, mode: str, *, impls: Sequence[str] = COMPILED, repeats: int = 5, warmup: int = 2, progress: Progress | None = None
) -> list[CompileRow]:
    """Compile each implementation for ``case`` and ``mode``; time compiled and eager side by side.

    Args:
        case: the shape (B, T, C, H) and dtype.
        mode: "forward" (no grad, eval) or "backward" (forward + backward of a fixed gradient).
        impls: names in ``peers.IMPLS`` (default: headwise's modules and the fused layer).
        repeats, warmup: timed and untimed rounds after the compiling call.
        progress: called as ``progress(done, total, what)``.

    Returns:
        One ``CompileRow`` per implementation, in ``impls`` order.
    """
    if mode not in ("forward", "backward"):
        raise ValueError(f"mode must be 'forward' or 'backward' here, got {mode!r}")
    chosen: list[Impl] = []
    for name in impls:
        impl = next((i for i in IMPLS if i.name == name), None)
        if impl is None:
            raise ValueError(f"impls must name implementations in headwise.bench.IMPLS, got {name!r}")
        chosen.append(impl)
    steps: dict[str, Callable[[], None]] = {}
    first: dict[str, float] = {}
    for i, impl in enumerate(chosen):
        module, call, x = prepare(impl, case)
        grad = torch.randn(case.batch, case.tokens, case.width).to(x) if mode == "backward" else None  # (B, T, C)
        compiled: Callable[[Tensor], Tensor] = torch.compile(call)
        if progress:
            progress(i, len(chosen), f"compiling {mode} {case.label}: {impl.name}")
        step = _step(mode, module, compiled, x, grad)
        start = time.perf_counter()
        step()  # compiles
        first[impl.name] = time.perf_counter() - start
        steps[impl.name] = step
        steps[impl.name + " (eager)"] = _step(mode, module, call, x, grad)
    times, load = loaded(lambda: interleaved(steps, repeats=repeats, warmup=warmup, progress=progress, what=f"compiled {mode} {case.label}"))
    rows = []
    for impl in chosen:
        med, q1, q3 = _quartiles(times[impl.name])
        eager = statistics.median(times[impl.name + " (eager)"])
        rows.append(CompileRow(impl.name, mode, case, max(first[impl.name] - med, 0.0), med, q1, q3, eager, repeats, load))
    return rows


def markdown(rows: Sequence[CompileRow]) -> list[str]:
    """The compiled table: one line per (case, mode, implementation), ratios to the compiled fused layer."""
    if not rows:
        return []
    out = ["| compiled: case | mode | implementation | compile s | median s | IQR s | eager s | compile speedup | vs compiled fused | load |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        ref = next((x for x in rows if x.case == r.case and x.mode == r.mode and x.impl == REFERENCE), None)
        ratio = f"{r.median_s / ref.median_s:.2f}x" if ref else ""
        name = r.impl if r.impl == REFERENCE else f"**{r.impl}**"
        out.append(f"| {r.case.label} | {r.mode} | {name} | {r.compile_s:.1f} | {seconds(r.median_s)} | {seconds(r.q1_s)}–{seconds(r.q3_s)} | "
                   f"{seconds(r.eager_median_s)} | {r.speedup:.2f}x | {ratio} | {r.load} |")
    return [*out, ""]
