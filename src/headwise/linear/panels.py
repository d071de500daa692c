"""A compiled decode step's float32 projections as one C++ GEMM over the weight packed in panels (``panels.cpp``).

- ``headwise::pack_panels(weight)``: (N, K) float32 -> (ceil(N / 32), K, 32), each panel 32 output
  columns k-major, the last zero-padded. In a graph whose weights inductor freezes, its constant
  folding packs each weight once, when the graph is compiled: the step itself never packs.
- ``headwise::panels_linear(x, panels, bias, n)``: (..., K) x panels (+ bias (n,)) -> (..., n), ``F.linear``'s
  numbers to float32 rounding (sums over k in order, in float32). Each panel is read once for every
  8 rows of x, whose 8 x 32 sums stay in registers; the panels are split between torch's threads.

At the few rows of a decode step the GEMM reads the weights at the rate of a plain read of memory,
where oneDNN's kernels (inductor's choice at 2 to 8 rows) run short of it at 8 rows; the decoding
performance page has the measurements. ``takes`` holds it to what was measured: CPUs whose torch
kernels run AVX-512 (32 vector registers: 8 rows x 2 of sums), where the library is built
(``headwise.native``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from ..machine import cpu

WIDTH = 32  # output columns per panel

torch.library.define("headwise::pack_panels", "(Tensor weight) -> Tensor")
torch.library.define("headwise::panels_linear", "(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor")


@torch.library.register_fake("headwise::pack_panels")
def _packed_shape(weight: Tensor) -> Tensor:
    return weight.new_empty(-(-weight.shape[0] // WIDTH), weight.shape[1], WIDTH)  # (ceil(N / 32), K, 32)


@torch.library.register_fake("headwise::panels_linear")
def _out_shape(x: Tensor, panels: Tensor, bias: Tensor | None, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)  # (..., n)


def runs_on(facts: dict) -> bool:
    """Whether a compiled step's float32 projections take the panels on a CPU with these facts (``machine.cpu()``):
    torch's kernels on AVX-512, where the GEMM was measured (its 8 x 2 registers of sums need AVX-512's 32)."""
    return facts["capability"] == "AVX512"


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether ``linear`` runs here: ``runs_on`` this CPU and the library built (built at the first call; a constant
    in a compiled graph)."""
    return runs_on(cpu()) and native.built()


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``linear`` computes ``F.linear(x, weight, bias)`` here: float32 CPU tensors, x (..., K) with K > 0,
    weight (N, K), bias (N,) or None, and ``available()``."""
    return (
        x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.device.type == "cpu"
        and x.ndim >= 1 and weight.ndim == 2 and x.shape[-1] == weight.shape[1] and weight.shape[1] > 0
        and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu" and tuple(bias.shape) == (weight.shape[0],)))
        and available()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for operands ``takes`` accepts: (..., K) x (N, K) (+ (N,)) -> (..., N). The weight
    is packed on every call: this is for graphs whose weights inductor freezes, where the packing is done once."""
    return torch.ops.headwise.panels_linear(x, torch.ops.headwise.pack_panels(weight), bias, weight.shape[0])  # (..., N)
