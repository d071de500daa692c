"""Interleaved timing (the one loop every benchmark and the demo use), and the machine's GEMM ceiling.

On the CPU a call is timed by the wall clock around it. On CUDA, where a call only queues
kernels, it is timed by a pair of CUDA events recorded in the stream around it, and the
elapsed times are read once, after one synchronisation at the end; the warm-up rounds are
waited for before the timed ones start.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cases import DTYPES, Case, Ceiling, Progress, Row
from .host import loaded
from .peers import Impl, prepare, skip_reason


def keeping(step: Callable[[], Tensor], outs: dict[str, Tensor], name: str) -> Callable[[], None]:
    """``step`` for ``interleaved``, keeping its latest output in ``outs[name]`` (to compare the results after)."""

    def call() -> None:
        outs[name] = step()

    return call


def interleaved(
    steps: dict[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 0,
    progress: Progress | None = None,
    what: str = "",
    device: str = "cpu",
) -> dict[str, list[float]]:
    """Seconds per call of each step, timed interleaved: A B C, B C A, C A B, ...

    One call of each per round, the order rotated every round, so that noise from other jobs
    on the machine hits every step alike; ``warmup`` untimed rounds first.

    Args:
        steps: name -> a call to time.
        repeats: timed rounds.
        warmup: untimed rounds before them.
        progress: called as ``progress(done, total, what)`` before each timed call.
        what: a label for ``progress``.
        device: "cpu" (wall clock) or "cuda" (CUDA events on the current stream).

    Returns:
        name -> ``repeats`` durations in seconds, in round order.

    Example:
        >>> times = interleaved({"a": lambda: sum(range(100)), "b": lambda: sum(range(10))}, repeats=3)
        >>> sorted(times), len(times["a"])
        (['a', 'b'], 3)
    """
    items = list(steps.items())
    times: dict[str, list[float]] = {name: [] for name in steps}
    cuda = torch.device(device).type == "cuda"
    events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    done, total = 0, repeats * len(items)
    for i in range(warmup + repeats):
        if cuda and i == warmup:
            torch.cuda.synchronize()  # the warm-up's kernels are done before the first timed one is queued
        shift = i % max(len(items), 1)
        for name, step in items[shift:] + items[:shift]:
            if i >= warmup and progress:
                progress(done, total, f"{what}: {name}" if what else name)
            if cuda and i >= warmup:
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
                step()
                end_event.record()
                events.append((name, start_event, end_event))
                done += 1
                continue
            start = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                done += 1
    if cuda:
        torch.cuda.synchronize()
        for name, start_event, end_event in events:
            times[name].append(start_event.elapsed_time(end_event) / 1e3)  # ms -> s
    return times


def _step(mode: str, module: nn.Module, call: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor | None) -> Callable[[], None]:
    if mode == "forward":

        def forward() -> None:
            with torch.no_grad():
                call(x)

        return forward
    params = [p for p in module.parameters() if p.requires_grad]
    xg = x.detach().requires_grad_(True)

    def forward_backward() -> None:
        for p in params:
            p.grad = None
        xg.grad = None
        call(xg).backward(grad)

    return forward_backward


def _quartiles(ts: list[float]) -> tuple[float, float, float]:
    if len(ts) < 2:
        return ts[0], ts[0], ts[0]
    q1, q2, q3 = statistics.quantiles(ts, n=4, method="inclusive")
    return q2, q1, q3


def time_case(
    impls: Sequence[Impl],
    case: Case,
    mode: str,
    *,
    repeats: int = 5,
    warmup: int = 2,
    max_scores_gib: float = 8.0,
    ceiling: float | None = None,
    progress: Progress | None = None,
) -> list[Row]:
    """Time every implementation on one case, interleaved; one Row each (in ``impls`` order)."""
    if mode not in ("forward", "backward"):
        raise ValueError(f"mode must be 'forward' or 'backward' here, got {mode!r}")
    steps: dict[str, Callable[[], None]] = {}
    notes: dict[str, str] = {}
    for impl in impls:
        note = skip_reason(impl, case, max_scores_gib)
        if note:
            notes[impl.name] = note
            continue
        try:
            module, call, x = prepare(impl, case)
            grad = torch.randn(case.batch, case.tokens, case.width).to(x) if mode == "backward" else None  # (B, T, C)
            step = _step(mode, module, call, x, grad)
            for _ in range(warmup):
                step()
            steps[impl.name] = step
        except Exception as e:  # a peer that cannot run this case is reported, not fatal
            notes[impl.name] = f"failed: {type(e).__name__}: {' '.join(str(e).split())[:120]}"  # (one table row: one line)
    times, load = loaded(lambda: interleaved(steps, repeats=repeats, progress=progress, what=f"{mode} {case.label}", device=case.device))
    rows = []
    for impl in impls:
        if impl.name not in times:
            rows.append(Row(impl.name, impl.peer, mode, case, note=notes.get(impl.name, ""), load=load))
            continue
        med, q1, q3 = _quartiles(times[impl.name])
        rate = case.flops(mode, impl.out_proj) / med / 1e9
        pct = 100 * rate / ceiling if ceiling else None
        rows.append(Row(impl.name, impl.peer, mode, case, med, q1, q3, repeats, rate, pct, load=load))
    return rows


def _ceiling_paths(dtype: str, size: int, device: str) -> dict[str, Callable[[], Tensor]]:
    """The GEMMs a ceiling is measured with: ``F.linear`` (torch's BLAS; cuBLAS on CUDA) and, on the CPU, oneDNN's inner
    product and, where they run, headwise's panels GEMM (over the weight packed once)."""
    from ..linear import panels
    from ..linear.onednn import inner_product, ops_error

    t = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=t)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=t)
    paths: dict[str, Callable[[], Tensor]] = {"F.linear": lambda: F.linear(a, b)}
    if torch.device(device).type == "cpu" and ops_error(t) is None:
        paths["oneDNN inner product"] = lambda: inner_product(a, b, None)
    if torch.device(device).type == "cpu" and panels.takes(a, b, None):
        paths["panels GEMM"] = lambda: panels.run(a, b)
    return paths


def measure_ceiling(dtype: str, *, size: int | None = None, repeats: int = 3, device: str = "cpu") -> list[Ceiling]:
    """The best rate of a size^3 GEMM per path (``_ceiling_paths``), timed interleaved on ``device``.

    ``size`` defaults to 2048 on the CPU and 8192 on CUDA (where a smaller GEMM cannot fill the
    GPU). On CUDA, float32 runs as ``torch.get_float32_matmul_precision()`` says (tf32 unless "highest").
    """
    size = size or (8192 if torch.device(device).type == "cuda" else 2048)
    paths = _ceiling_paths(dtype, size, device)
    with torch.no_grad():
        for name, fn in list(paths.items()):
            try:
                fn()
            except RuntimeError:
                del paths[name]
        times = interleaved(paths, repeats=repeats, device=device)
    return [Ceiling(dtype, name, 2 * size**3 / min(ts) / 1e9) for name, ts in times.items()]
