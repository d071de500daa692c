"""Peak forward memory: on the CPU each implementation in a fresh subprocess (``python -m headwise.bench
--_memory-child``), max RSS; on CUDA in this process, ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from .cases import Case, Progress, Row
from .peers import IMPLS, Impl, prepare, skip_reason


def _status_mib(field_name: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Linux: make VmHWM (max RSS) start again from the current RSS; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_mib("VmHWM") is not None


def memory_child(name: str, case: Case) -> dict:
    """Runs in the subprocess: build, then one forward; max RSS during it minus RSS before.

    Linux resets the max-RSS mark just before the forward (imports and construction may have
    peaked higher than the forward itself); elsewhere ``ru_maxrss`` after minus before.
    """
    impl = next(i for i in IMPLS if i.name == name)
    _module, call, x = prepare(impl, case)
    gc.collect()
    if _reset_peak():
        before, peak = _status_mib("VmRSS") or 0.0, lambda: _status_mib("VmHWM") or 0.0
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux (bytes on macOS)
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    with torch.no_grad():
        call(x)
    return {"peak_mib": peak() - before}


def cuda_peak_mib(impl: Impl, case: Case) -> float:
    """The most GPU memory one forward allocates beyond what was allocated before it (module, input), MiB."""
    module, call, x = prepare(impl, case)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        call(x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del module, call, x
    return peak / 2**20


def memory_case(impls: Sequence[Impl], case: Case, *, max_scores_gib: float = 8.0, progress: Progress | None = None) -> list[Row]:
    """Peak forward memory of each implementation: each in its own fresh Python process on the CPU, in this one on CUDA."""
    rows = []
    for n, impl in enumerate(impls):
        if progress:
            progress(n, len(impls), f"memory {case.label}: {impl.name}")
        note = skip_reason(impl, case, max_scores_gib)
        if note:
            rows.append(Row(impl.name, impl.peer, "memory", case, note=note))
            continue
        if case.device == "cuda":
            try:
                rows.append(Row(impl.name, impl.peer, "memory", case, peak_mib=cuda_peak_mib(impl, case)))
            except Exception as e:  # a peer that cannot run this case is reported, not fatal
                rows.append(Row(impl.name, impl.peer, "memory", case, note=f"failed: {type(e).__name__}: {str(e)[:120]}"))
            continue
        spec = json.dumps({"impl": impl.name, "case": asdict(case)})
        proc = subprocess.run([sys.executable, "-m", "headwise.bench", "--_memory-child", spec], capture_output=True, text=True)
        try:
            peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]
            rows.append(Row(impl.name, impl.peer, "memory", case, peak_mib=peak))
        except (IndexError, KeyError, json.JSONDecodeError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(Row(impl.name, impl.peer, "memory", case, note=f"failed: {tail[:120]}"))
    return rows
