"""What a benchmark run is made of: presets, cases, result rows, ceilings and the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .host import Load

PRESETS: dict[str, tuple[int, int]] = {"small": (768, 12), "medium": (1024, 16), "tiny": (64, 4)}  # name -> (C, H)
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("forward", "backward", "memory", "decode", "compile")

Progress = Callable[[int, int, str], None]  # (done, total, what is running now)


@dataclass(frozen=True)
class Case:
    """One shape: ``preset`` names (C, H); B sequences of T tokens in ``dtype`` ("fp32" / "bf16") on ``device``."""

    preset: str
    batch: int
    tokens: int
    dtype: str = "fp32"
    device: str = "cpu"  # or "cuda"

    @property
    def width(self) -> int:
        return PRESETS[self.preset][0]

    @property
    def heads(self) -> int:
        return PRESETS[self.preset][1]

    @property
    def label(self) -> str:
        return f"{self.preset} B={self.batch} T={self.tokens} {self.dtype}" + ("" if self.device == "cpu" else f" {self.device}")

    def flops(self, mode: str, out_proj: bool = True) -> float:
        """Useful FLOPs of one call in ``mode`` (causal attention at half)."""
        B, T, C = self.batch, self.tokens, self.width
        forward = 2 * B * T * C * (3 * C + (C if out_proj else 0)) + 2 * B * T * T * C
        return 3 * forward if mode == "backward" else forward


@dataclass(frozen=True)
class Row:
    """One implementation in one case and mode. ``note`` says why a row has no numbers."""

    impl: str
    peer: bool
    mode: str
    case: Case
    median_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    repeats: int = 0
    gflops: float | None = None
    pct_of_ceiling: float | None = None
    peak_mib: float | None = None
    note: str = ""
    load: Load | None = None  # the load average before and after the case's interleaved rounds


@dataclass(frozen=True)
class Ceiling:
    """The rate of a large GEMM (2048^3) in ``dtype`` through one of torch's paths."""

    dtype: str
    path: str
    gflops: float


@dataclass
class Report:
    """One run: the machine, the linear path headwise took, the ceilings, the rows."""

    machine: str
    ceilings: list[Ceiling] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    decode: list = field(default_factory=list)  # headwise.bench.decode.DecodeRow, one per context
    compiled: list = field(default_factory=list)  # headwise.bench.compile.CompileRow, per case, mode and implementation
    command: str = ""
    linear: dict = field(default_factory=dict)  # headwise.linear.describe(): the projection path per dtype and why

    def ceiling(self, dtype: str) -> float | None:
        rates = [c.gflops for c in self.ceilings if c.dtype == dtype]
        return max(rates) if rates else None


def seconds(value: float) -> str:
    """A time in seconds for a table: four decimals, or three significant digits under 10 ms (GPU kernels, small cases)."""
    return f"{value:.4f}" if value >= 0.01 else f"{value:.3g}"
