"""A compiled decode step's projections as one C++ GEMM over the weight packed in panels (``panels.cpp``).

- ``headwise::pack_panels(weight)``: (N, K) -> (ceil(N / 32), K', 32), each panel 32 output columns
  k-major, the last zero-padded: float32 K' = K; bfloat16 K' = K + K % 2, each step of the panel a
  pair of k for every column. In a graph whose weights inductor freezes, its constant folding packs
  each weight once, when the graph is compiled: the step itself never packs.
- ``headwise::panels_linear(x, panels, bias, n)``: (..., K) x panels (+ bias (n,)) -> (..., n) in x's dtype.
  float32: ``F.linear``'s numbers to float32 rounding (sums over k in order, in float32). bfloat16:
  each pair's two products (exact in float32) added to float32 sums by one AVX512-BF16 instruction,
  the sum plus the bias rounded to bfloat16 once, as oneDNN's bf16 GEMM does on the same CPUs. Each
  panel is read once for every 8 rows of x, whose 8 x 32 sums stay in registers; the panels are
  split between torch's threads.

At the few rows of a decode step the GEMM reads the weights at about the rate of a plain read of
memory, where oneDNN's kernels (inductor's choice at 2 to 8 rows) run short of it; the decoding
performance page has the measurements. ``takes`` holds it to what was measured: CPUs whose torch
kernels run AVX-512 (32 vector registers: 8 rows x 2 of sums), for bfloat16 those with AVX512-BF16
and more than one row (at one row inductor's own GEMM read faster), where the library is built
(``headwise.native``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import native
from ..machine import cpu

WIDTH = 32  # output columns per panel

torch.library.define("headwise::pack_panels", "(Tensor weight) -> Tensor")
torch.library.define("headwise::panels_linear", "(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor")


@torch.library.register_fake("headwise::pack_panels")
def _packed_shape(weight: Tensor) -> Tensor:
    k = weight.shape[1] + (weight.shape[1] % 2 if weight.dtype == torch.bfloat16 else 0)  # bfloat16: k in pairs
    return weight.new_empty(-(-weight.shape[0] // WIDTH), k, WIDTH)  # (ceil(N / 32), K', 32)


@torch.library.register_fake("headwise::panels_linear")
def _out_shape(x: Tensor, panels: Tensor, bias: Tensor | None, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)  # (..., n)


def dtypes_on(facts: dict) -> tuple[torch.dtype, ...]:
    """The dtypes whose compiled-step projections take the panels on a CPU with these facts (``machine.cpu()``):
    float32 where torch's kernels run AVX-512, where the GEMM was measured (its 8 x 2 registers of sums need
    AVX-512's 32), and bfloat16 there too on CPUs with AVX512-BF16's pair dot products; none elsewhere."""
    if facts["capability"] != "AVX512":
        return ()
    return (torch.float32, torch.bfloat16) if "avx512_bf16" in facts["flags"] else (torch.float32,)


@torch.compiler.assume_constant_result
def _dtypes() -> tuple[torch.dtype, ...]:
    return dtypes_on(cpu())


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether ``linear`` runs here for some dtype: ``dtypes_on`` this CPU and the library built (built at the first
    call; a constant in a compiled graph)."""
    return bool(dtypes_on(cpu())) and native.built()


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether a frozen graph's ``F.linear(x, weight, bias)`` runs as ``linear``: CPU tensors of one dtype of
    ``dtypes_on`` this CPU, x (..., K) with K > 0, weight (N, K), bias (N,) or None, and ``available()``; but not
    bfloat16 of one row fixed at trace time (a decode step's B = 1 graph), where inductor's own GEMM was the faster."""
    one_row = all(isinstance(d, int) for d in x.shape[:-1]) and math.prod(x.shape[:-1]) == 1
    return (
        x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in _dtypes()
        and x.ndim >= 1 and weight.ndim == 2 and x.shape[-1] == weight.shape[1] and weight.shape[1] > 0
        and (bias is None or (bias.dtype == x.dtype and bias.device.type == "cpu" and tuple(bias.shape) == (weight.shape[0],)))
        and not (x.dtype == torch.bfloat16 and one_row) and available()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for operands ``takes`` accepts: (..., K) x (N, K) (+ (N,)) -> (..., N). The weight
    is packed on every call: this is for graphs whose weights inductor freezes, where the packing is done once."""
    return torch.ops.headwise.panels_linear(x, torch.ops.headwise.pack_panels(weight), bias, weight.shape[0])  # (..., N)
