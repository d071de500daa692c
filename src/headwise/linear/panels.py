"""A compiled decode step's projections as one C++ GEMM over the weight packed in panels (``panels.cpp``).

- ``headwise::pack_panels(weight)``: (N, K) -> (ceil(N / 32), K', 32), each panel 32 output columns
  k-major, the last zero-padded: float32 K' = K; bfloat16 and int8 K' = K + K % 2, each step of the
  panel a pair of k for every column. In a graph whose weights inductor freezes, its constant folding
  packs each weight once, when the graph is compiled: the step itself never packs.
- ``headwise::panels_linear(x, panels, bias, n)``: (..., K) x panels (+ bias (n,)) -> (..., n) in x's dtype.
  float32: ``F.linear``'s numbers to float32 rounding (sums over k in order, in float32). bfloat16:
  each pair's two products (exact in float32) added to float32 sums by one AVX512-BF16 instruction,
  the sum plus the bias rounded to bfloat16 once, as oneDNN's bf16 GEMM does on the same CPUs.
  int8 panels with bfloat16 x (no bias): each step's int8 weights widened to bfloat16 in registers
  (exact), then the same instruction, the sums rounded to bfloat16 once: ``Int8Linear``'s sums
  (``headwise.quantize``), which it then scales. Each panel is read once for every 8 rows of x,
  whose 8 x 32 sums stay in registers; the panels are split between torch's threads.

At the few rows of a decode step the GEMM reads the weights at about the rate of a plain read of
memory, where oneDNN's kernels (inductor's choice at 2 to 8 rows) run short of it; the decoding
performance page has the measurements. ``takes`` holds it to what was measured: CPUs whose torch
kernels run AVX-512 (32 vector registers: 8 rows x 2 of sums), for bfloat16 and int8 weights those
with AVX512-BF16, where the library is built (``headwise.native``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from ..machine import cpu

WIDTH = 32  # output columns per panel
X_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16, torch.int8: torch.bfloat16}  # weight -> x dtype

torch.library.define("headwise::pack_panels", "(Tensor weight) -> Tensor")
torch.library.define("headwise::panels_linear", "(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor")


@torch.library.register_fake("headwise::pack_panels")
def _packed_shape(weight: Tensor) -> Tensor:
    k = weight.shape[1] + (weight.shape[1] % 2 if weight.dtype != torch.float32 else 0)  # bfloat16, int8: k in pairs
    return weight.new_empty(-(-weight.shape[0] // WIDTH), k, WIDTH)  # (ceil(N / 32), K', 32)


@torch.library.register_fake("headwise::panels_linear")
def _out_shape(x: Tensor, panels: Tensor, bias: Tensor | None, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)  # (..., n)


def dtypes_on(facts: dict) -> tuple[torch.dtype, ...]:
    """The weight dtypes whose compiled-step projections take the panels on a CPU with these facts (``machine.cpu()``):
    float32 where torch's kernels run AVX-512, where the GEMM was measured (its 8 x 2 registers of sums need
    AVX-512's 32), and bfloat16 and int8 there too on CPUs with AVX512-BF16's pair dot products; none elsewhere."""
    if facts["capability"] != "AVX512":
        return ()
    return (torch.float32, torch.bfloat16, torch.int8) if "avx512_bf16" in facts["flags"] else (torch.float32,)


@torch.compiler.assume_constant_result
def _dtypes() -> tuple[torch.dtype, ...]:
    """``dtypes_on`` this CPU where the library is built (built at the first call), else none: a constant in a compiled graph."""
    dtypes = dtypes_on(cpu())
    return dtypes if dtypes and native.built() else ()


def available() -> bool:
    """Whether ``linear`` runs here for some dtype: ``dtypes_on`` this CPU and the library built."""
    return bool(_dtypes())


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether a frozen graph's ``F.linear(x, weight, bias)`` (for an int8 weight: ``Int8Linear``'s bfloat16 sums) runs as
    ``linear``: CPU tensors, the weight's dtype one of ``_dtypes()`` and x of the dtype it multiplies (``X_DTYPES``),
    x (..., K) with K > 0, weight (N, K), bias (N,) of x's dtype or None (None for int8)."""
    return (
        x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == X_DTYPES.get(weight.dtype)
        and x.ndim >= 1 and weight.ndim == 2 and x.shape[-1] == weight.shape[1] and weight.shape[1] > 0
        and (bias is None or (weight.dtype != torch.int8 and bias.dtype == x.dtype and bias.device.type == "cpu"
                              and tuple(bias.shape) == (weight.shape[0],)))
        and weight.dtype in _dtypes()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for operands ``takes`` accepts: (..., K) x (N, K) (+ (N,)) -> (..., N); for an int8
    weight, bfloat16 x and no bias, the (..., N) bfloat16 sums ``Int8Linear`` scales. The weight is packed on every
    call: this is for graphs whose weights inductor freezes, where the packing is done once."""
    if not takes(x, weight, bias):  # a check while tracing, not in the compiled graph
        raise ValueError(f"panels.linear runs the CPU operands panels.takes accepts here (weight dtypes {list(_dtypes())}), "
                         f"got x {x.dtype} {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}, bias "
                         f"{None if bias is None else (bias.dtype, tuple(bias.shape))}")
    return torch.ops.headwise.panels_linear(x, torch.ops.headwise.pack_panels(weight), bias, weight.shape[0])  # (..., N)
