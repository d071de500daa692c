"""The run: every requested (mode, preset, tokens, dtype) case of the layer benchmark."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import GPT2Config
from ..linear import describe
from .cases import DTYPES, MODES, PRESETS, Case, Progress, Report
from .compile import compile_case
from .decode import decode_latency
from .host import gpu, machine
from .memory import memory_case
from .peers import select
from .timing import measure_ceiling, time_case


def run(
    *,
    presets: Sequence[str] = ("small",),
    tokens: Sequence[int] = (1024,),
    batch: int = 4,
    dtypes: Sequence[str] = ("fp32",),
    modes: Sequence[str] = ("forward", "backward"),
    impls: Sequence[str] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    max_scores_gib: float = 8.0,
    ceiling: bool = True,
    progress: Progress | None = None,
    device: str = "cpu",
) -> Report:
    """Run every requested (mode, preset, tokens, dtype) case; see the module docstring.

    Args:
        presets: names in ``PRESETS`` ("small" = GPT-2 small's C=768, H=12; "medium" = 1024, 16).
        tokens: T values; each case has ``batch`` sequences of T tokens.
        dtypes: "fp32", "bf16".
        modes: any of "forward", "backward" (forward + backward), "memory", "decode", "compile" (headwise's modules and
            the fused layer under ``torch.compile``, forward and forward + backward, beside their eager selves).
        impls: substrings of implementation names (default: all but torch.compile).
        repeats, warmup: timed and untimed calls per implementation and case.
        max_scores_gib: skip implementations whose (B, H, T, T) scores need more.
        ceiling: measure the machine's GEMM ceiling per dtype first (``timing.measure_ceiling``).
        device: "cpu" or "cuda" (timed with CUDA events; memory from ``torch.cuda.max_memory_allocated``).

    Returns:
        A ``Report``.
    """
    for name, values, valid in (("presets", presets, PRESETS), ("dtypes", dtypes, DTYPES), ("modes", modes, MODES)):
        bad = [v for v in values if v not in valid]
        if bad:
            raise ValueError(f"{name} must be among {list(valid)}, got {bad}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tokens) or batch < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"tokens, batch and repeats must be positive ints and warmup >= 0, got {list(tokens)}, {batch}, {repeats}, {warmup}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a GPU that torch can see; torch.cuda.is_available() is False here")
    if device == "cuda" and "decode" in modes:
        raise ValueError("mode 'decode' runs on the CPU only (the decode benchmark is a CPU latency study), got device='cuda'")
    if "decode" in modes and any(t < 2 or t > GPT2Config().n_positions for t in tokens):  # before anything is measured
        raise ValueError(f"mode 'decode' takes contexts in [2, {GPT2Config().n_positions}] (GPT-2's n_positions), got {list(tokens)}")
    chosen = select(impls)
    report = Report(machine() if device == "cpu" else f"{machine()}; {gpu()}", linear=describe())
    if ceiling:
        for dtype in dtypes:
            report.ceilings += measure_ceiling(dtype, device=device)
    for mode in modes:
        if mode == "decode":
            report.decode += _decode(presets, tokens, batch, repeats, warmup, progress)
            continue
        for preset in presets:
            for dtype in dtypes:
                for t in tokens:
                    case = Case(preset, batch, t, dtype, device)
                    if mode == "compile":
                        for timed in ("forward", "backward"):
                            report.compiled += compile_case(case, timed, repeats=repeats, warmup=warmup, progress=progress)
                    elif mode == "memory":
                        report.rows += memory_case(chosen, case, max_scores_gib=max_scores_gib, progress=progress)
                    else:
                        report.rows += time_case(chosen, case, mode, repeats=repeats, warmup=warmup, max_scores_gib=max_scores_gib,
                                                 ceiling=report.ceiling(dtype), progress=progress)
    return report


def _decode(presets: Sequence[str], tokens: Sequence[int], batch: int, repeats: int, warmup: int, progress: Progress | None) -> list:
    """A 12-layer decode step per preset at each context in ``tokens`` (batch ``batch``), one context at a time."""
    rows, done, total = [], 0, len(presets) * len(tokens)
    for preset in presets:
        width, heads = PRESETS[preset]
        for t in tokens:
            if progress:
                progress(done, total, f"decode {preset} B={batch} context {t}")
            rows += decode_latency((t,), n_embd=width, n_head=heads, batch_size=batch, repeats=repeats, warmup=warmup)
            done += 1
    if progress:
        progress(done, total, "decode done")
    return rows
