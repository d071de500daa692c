"""The machine a benchmark runs on: what it is, how loaded it is, how fast it reads memory.

- ``machine()``: the CPU (name, vendor, family/model, the flags that matter), cores, torch and
  its threads, Python; ``gpu()`` the GPU a CUDA run uses;
- ``command(prog, argv)``: the command line a report prints, quoted so that it pastes back into a shell;
- ``Load`` / ``loaded(fn)``: the 1-minute load average (``os.getloadavg``) just before and just
  after a measurement, so that a table says how busy the machine was while each row was taken;
- ``busy(n)``: ``n`` processes spinning on a core each while a block runs (``--busy N``): a
  background load to measure under;
- ``ReadProbe``: a 512 MiB float32 ``sum``, timed in the same interleaved rounds as what it is
  compared with, so that a share of the read bandwidth is taken under the same load.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import torch

from .. import _argtypes, _checks

T = TypeVar("T")


def machine() -> str:
    """CPU (name, vendor, family/model, the flags that matter), cores, torch, its threads and kernel ISA, Python."""
    from ..machine import cpu

    facts = cpu()
    flags = {"AVX-512": "avx512f", "AVX512-bf16": "avx512_bf16", "AMX": "amx_tile"}
    have = ", ".join(f"{name} {'yes' if flag in facts['flags'] else 'no'}" for name, flag in flags.items())
    where = f"{facts['vendor']} family {facts['family']} model {facts['model']}" if facts["vendor"] else platform.machine()
    return (f"{facts['name']} ({where}; {have}), {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads, {facts['capability']} kernels), Python {platform.python_version()}")


def gpu() -> str:
    """``"GPU NVIDIA H100 80GB HBM3 (79 GiB, sm_90), CUDA 12.8"`` for the current device."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}), CUDA {torch.version.cuda}"


def command(prog: str, argv: Sequence[str] | None = None) -> str:
    """``prog`` and its arguments (``sys.argv[1:]`` when ``argv`` is None), each quoted for a POSIX shell.

    An empty argument prints as ``''`` and one with a space inside quotes, so that ``shlex.split``
    of what follows ``prog`` gives the arguments back. ``prog`` (``"headwise bench"``) is written as is.

    Example:
        >>> command("headwise bench", ["--plot", "", "--out", "my runs/a.json"])
        "headwise bench --plot '' --out 'my runs/a.json'"
    """
    args = sys.argv[1:] if argv is None else argv
    return " ".join([prog, *map(shlex.quote, args)])


@dataclass(frozen=True)
class Load:
    """The 1-minute load average just before and just after one measurement."""

    before: float
    after: float

    def __str__(self) -> str:
        return f"{self.before:.1f}→{self.after:.1f}"


def load_average() -> float:
    """The 1-minute load average (runnable processes, averaged); 0.0 where the OS does not say."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def loaded(measure: Callable[[], T]) -> tuple[T, Load]:
    """``measure()`` and the load average just before and just after it."""
    before = load_average()
    result = measure()
    return result, Load(before, load_average())


@contextmanager
def busy(processes: int) -> Iterator[None]:
    """``processes`` Python processes, each spinning in a loop, while the block runs; killed when it ends.

    Example:
        >>> with busy(0):
        ...     pass
    """
    _checks.integer("processes", processes, low=0)
    spinners: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            spinners.append(subprocess.Popen([sys.executable, "-S", "-c", "while True: pass"]))
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def add_busy_flag(parser: argparse.ArgumentParser) -> None:
    """``--busy N``: the command runs with N spinning processes beside it (``busy``)."""
    parser.add_argument("--busy", type=_argtypes.busy, default=0,
                        help="run with N processes spinning beside the benchmark, a background load (default 0)")


class ReadProbe:
    """A ``sum`` over 512 MiB of float32: the machine's read bandwidth, timed beside what it is compared with."""

    BYTES = 512 * 2**20

    def __init__(self, repeats: int = 1) -> None:
        self.repeats = repeats
        self.data = torch.ones(self.BYTES // 4)  # (128 Mi,) float32

    def __call__(self) -> None:
        for _ in range(self.repeats):
            self.data.sum()

    def gbps(self, seconds: float) -> float:
        """GB/s read by one call that took ``seconds``."""
        return self.repeats * self.BYTES / seconds / 1e9
