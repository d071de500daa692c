"""Projections as one C++ GEMM over the weight packed in panels (``panels.cpp``), for a decode step's few rows and, on
some CPUs, a prompt's many: eagerly over the weight packed once and kept while it is unchanged (``packed``, ``run``: the
rule's "panels" path), in a compiled step over the weight packed when the graph is compiled (``linear``).

- ``headwise::pack_panels(weight, x_dtype=None)``: (N, K) -> (ceil(N / 32), K', 32) for x of ``x_dtype``
  (``OPERANDS``; by default the weight's, bfloat16 for int8), each panel 32 output columns k-major, the
  last zero-padded: float32 K' = K; bfloat16 x K' = K + K % 2, each step of the panel a pair of k for
  every column; int8 x K' = K rounded up to 4, four k a step, uint8 weights offset by 128 on a CPU with
  AVX512-VNNI, else (int8 pairs) bfloat16 x's layout. In a graph
  whose weights inductor freezes, its constant folding packs each weight once, when the graph is
  compiled: the step itself never packs.
- ``headwise::panels_linear(x, panels, bias, n)``: (..., K) x panels (+ bias (n,)) -> (..., n) in x's dtype.
  float32: ``F.linear``'s numbers to float32 rounding (sums over k in order, in float32). bfloat16:
  each pair's two products (exact in float32) added to float32 sums by one AVX512-BF16 instruction
  (calls of 4 rows or more on a CPU with AMX tiles: by ``tdpbf16ps``, 16 steps at a time), the sum
  plus the bias rounded to bfloat16 once, as oneDNN's bf16 GEMM does on the same CPUs. Where torch's kernels run
  AVX2 each pair (of bfloat16 or int8 weights) is widened to float32 in registers and its two products added in the
  same order: the same bits.
  int8 panels with bfloat16 x (no bias): each step's int8 weights widened to bfloat16 in registers
  (exact), then the same instruction, the sums rounded to bfloat16 once: ``Int8Linear``'s sums
  (``headwise.quantize``), which it then scales. int8 panels with int8 x (no bias): one AVX512-VNNI
  instruction adds four byte products to each int32 sum (without VNNI, on any CPU with AVX2: each step's pairs
  widened to int16, one vpmaddwd adds a pair's two products, a vpaddd the sum), the (..., n) exact integer sums that
  torch's int8 GEMM gives (``Int8Linear``'s int8-activation arithmetic then scales them). Each panel is read once for every 8 rows of x,
  whose 8 x 32 sums stay in registers; the panels are split between torch's threads.
- ``headwise::panels_linear_gelu(x, panels, bias, n, approximate)``: ``F.gelu(panels_linear(...), approximate=...)``
  for float32 and bfloat16 x, the GELU ("none": erf's, "tanh") computed on each float32 sum plus its bias before it is
  stored (in bfloat16: before the one rounding), as oneDNN's GEMM computes a GELU inside: one pass over the output.
  Its float32 numbers are within 6 units in the last place of GELU's for x >= 0 and 15 in [-3, 0) (exp and erfc by
  polynomials, erfc's relative error under 1.2e-7; "tanh": 2 and 13), against torch's float32 GELU's 7 and 546 ("tanh":
  2 and 195; float64 references over 210,000 sums, an AVX2 build); below -3, a relative error that grows as x^2 (the exponent x^2 / 2
  rounded in float32: about 220 units at x = -11.8, where the values are under 1e-30; "tanh" gives -0.0 below about -10,
  where GELU is under 1e-37), where torch's float32 GELU loses every digit.
- ``headwise::panels_int8_scaled(x, panels, scales, bias, n)``: ``Int8Linear``'s whole decode call over int8 panels
  packed for bfloat16 x: x (..., K) float32 or bfloat16 rounded to bfloat16, the sums rounded once, then times the (n,)
  float32 scales plus the (n,) float32 bias (one fused multiply-add, as torch's ``addcmul`` on AVX-512), in x's dtype.
- ``headwise::panels_int8_rows_scaled(x, panels, scales, bias, n)``: ``Int8Linear``'s decode call with int8
  activations over the panels packed for int8 x: each row of x (float32 or bfloat16) rounded to int8 by its own scale,
  the exact integer sums, then times the row's scale, the channel's, plus the bias (each a float32 rounding), in x's dtype.

At the few rows of a decode step the GEMM reads the weights at about the rate of a plain read of
memory, where oneDNN's kernels (inductor's choice at 2 to 8 rows) run short of it; the decoding
performance page has the measurements. ``takes`` holds it to what was measured: CPUs whose torch
kernels run AVX-512 (32 vector registers: 8 rows x 2 of sums), for bfloat16 x those with AVX512-BF16;
float32, bfloat16 and int8 weights by bfloat16 x eagerly on those whose torch kernels run AVX2 (16 registers: 2-3
rows x 4 of sums); int8 x on both (``operands_on``); where the library is built (``headwise.native``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from .._checks import compiling
from ..machine import amx_int8_on, cpu
from .weight_cache import PANELS, cached, watchable

WIDTH = 32  # output columns per panel
#: (x dtype, weight dtype) the GEMM multiplies -> the CPU flag it needs beyond AVX-512 (None: none)
OPERANDS = {(torch.float32, torch.float32): None, (torch.bfloat16, torch.bfloat16): "avx512_bf16",
            (torch.bfloat16, torch.int8): "avx512_bf16", (torch.int8, torch.int8): "avx512_vnni"}
_GROUP = {torch.float32: 1, torch.bfloat16: 2, torch.int8: 4}  # x dtype -> k side by side in a step of a panel (int8: with VNNI)
INT8_BY_INT8 = (torch.int8, torch.int8)

torch.library.define("headwise::pack_panels", "(Tensor weight, ScalarType? x_dtype=None) -> Tensor")
torch.library.define("headwise::panels_linear", "(Tensor x, Tensor panels, Tensor? bias, int n) -> Tensor")
torch.library.define("headwise::panels_linear_gelu", "(Tensor x, Tensor panels, Tensor? bias, int n, str approximate) -> Tensor")
torch.library.define("headwise::panels_int8_scaled", "(Tensor x, Tensor panels, Tensor scales, Tensor? bias, int n) -> Tensor")
torch.library.define("headwise::panels_int8_rows_scaled", "(Tensor x, Tensor panels, Tensor scales, Tensor? bias, int n) -> Tensor")


@torch.library.register_fake("headwise::pack_panels")
def _packed_shape(weight: Tensor, x_dtype: torch.dtype | None = None) -> Tensor:
    x_dtype = x_dtype or (torch.bfloat16 if weight.dtype == torch.int8 else weight.dtype)
    quads = x_dtype == torch.int8 and "avx512_vnni" in cpu()["flags"]  # else int8 x takes the bfloat16 layout (AVX2)
    group = _GROUP[x_dtype] if quads or x_dtype != torch.int8 else 2
    dtype = torch.uint8 if quads else weight.dtype
    return weight.new_empty(-(-weight.shape[0] // WIDTH), -(-weight.shape[1] // group) * group, WIDTH, dtype=dtype)  # (ceil(N / 32), K', 32)


@torch.library.register_fake("headwise::panels_linear")
def _out_shape(x: Tensor, panels: Tensor, bias: Tensor | None, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n, dtype=torch.int32 if x.dtype == torch.int8 else x.dtype)  # (..., n)


@torch.library.register_fake("headwise::panels_linear_gelu")
def _gelu_shape(x: Tensor, panels: Tensor, bias: Tensor | None, n: int, approximate: str) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)  # (..., n)


def _scaled_shape(x: Tensor, panels: Tensor, scales: Tensor, bias: Tensor | None, n: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], n)  # (..., n) in x's dtype


torch.library.register_fake("headwise::panels_int8_scaled", _scaled_shape)
torch.library.register_fake("headwise::panels_int8_rows_scaled", _scaled_shape)


def operands_on(facts: dict, *, compiled: bool = True) -> tuple[tuple[torch.dtype, torch.dtype], ...]:
    """The (x dtype, weight dtype) pairs whose projections take the panels on a CPU with these facts (``machine.cpu()``):
    where torch's kernels run AVX-512, where the GEMM was measured (its 8 x 2 registers of sums need AVX-512's 32), each
    pair of ``OPERANDS`` whose flag the CPU has; where they run AVX2, float32, bfloat16 and int8 weights by bfloat16 x
    eagerly (2 rows x 4 registers of sums, bfloat16 and int8 widened to float32 in registers; the rule gives them
    decode-shaped calls only, docs: decoding); none elsewhere. int8 x int8 wherever torch's kernels run AVX2 or AVX-512,
    eagerly and in a compiled step (without AVX512-VNNI by AVX2's word products: torch's int8 GEMM is a scalar loop
    there), but not in a compiled step on CPUs with AMX's int8 tiles (inductor's own int8 GEMM runs there; eagerly the
    panels' VNNI sums were the faster, docs: decoding)."""
    if facts["capability"] not in ("AVX2", "AVX512"):
        return ()
    int8 = () if compiled and amx_int8_on(facts) else (INT8_BY_INT8,)
    if facts["capability"] == "AVX2":
        return int8 if compiled else tuple(pair for pair in OPERANDS if pair != INT8_BY_INT8) + int8
    return tuple(pair for pair, flag in OPERANDS.items() if pair != INT8_BY_INT8 and (flag is None or flag in facts["flags"])) + int8


@torch.compiler.assume_constant_result
def _operands() -> tuple[tuple[torch.dtype, torch.dtype], ...]:
    """``operands_on`` this CPU for a compiled step where the library is built (built at the first call), else none: a
    constant in a compiled graph."""
    pairs = operands_on(cpu())
    return pairs if pairs and native.built() else ()


def _eager_operands() -> tuple[tuple[torch.dtype, torch.dtype], ...]:
    """``operands_on`` this CPU for eager calls where the library is built, else none."""
    pairs = operands_on(cpu(), compiled=False)
    return pairs if pairs and native.built() else ()


def operands(*, compiled: bool = True) -> tuple[tuple[torch.dtype, torch.dtype], ...]:
    """The (x dtype, weight dtype) pairs ``linear`` runs here, in a compiled step or (``compiled=False``) eagerly:
    ``operands_on`` this CPU where the library builds."""
    return _operands() if compiled else _eager_operands()


def available() -> bool:
    """Whether the panels run here for some operands, eagerly (``run``) or in a compiled step (``linear``)."""
    return bool(_operands() or _eager_operands())


def takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``linear(x, weight, bias)`` runs here: CPU tensors whose (x dtype, weight dtype) is one of ``operands``
    (a compiled step's while ``torch.compile`` traces, else the eager ones),
    x (..., K) with K > 0, weight (N, K), bias (N,) of x's dtype or None (None for an int8 weight)."""
    return (
        x.device.type == "cpu" and weight.device.type == "cpu" and x.layout is torch.strided
        and x.ndim >= 1 and weight.ndim == 2 and x.shape[-1] == weight.shape[1] and weight.shape[1] > 0
        and (bias is None or (weight.dtype != torch.int8 and bias.dtype == x.dtype and bias.device.type == "cpu"
                              and tuple(bias.shape) == (weight.shape[0],)))
        and (x.dtype, weight.dtype) in (_operands() if compiling() else _eager_operands())
    )


def keeps(weight: Tensor) -> bool:
    """Whether a packed copy of ``weight`` can be kept while it is unchanged: a change to it can be seen (not an
    inference tensor, which has no ``_version``; not under torch.distributed, which refills weights in place)."""
    return not weight.is_inference() and watchable()


def packed(weight: Tensor, x_dtype: torch.dtype) -> Tensor:
    """(N, K) -> the weight packed in panels for rows of ``x_dtype`` (``pack_panels``), made once and again whenever the
    weight changed (``weight_cache.PANELS``); for a weight ``keeps`` accepts."""
    return cached(PANELS.setdefault(x_dtype, {}), [weight], lambda: torch.ops.headwise.pack_panels(weight.detach(), x_dtype))


def run(x: Tensor, weight: Tensor, bias: Tensor | None = None, gelu: str | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` eagerly over the weight packed once (``packed``), for operands ``takes`` accepts and
    a weight ``keeps`` accepts: (..., K) -> (..., N); with ``gelu`` (GELU's ``approximate``, "none" or "tanh"; float32
    and bfloat16 weights) ``F.gelu`` of it, computed on the float32 sums plus the bias before they are stored."""
    bias = None if bias is None else bias.detach().contiguous()
    if gelu is not None:
        return torch.ops.headwise.panels_linear_gelu(x.contiguous(), packed(weight, x.dtype), bias, weight.shape[0], gelu)  # (..., N)
    return torch.ops.headwise.panels_linear(x.contiguous(), packed(weight, x.dtype), bias, weight.shape[0])  # (..., N)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for operands ``takes`` accepts: (..., K) x (N, K) (+ (N,)) -> (..., N); for an int8
    weight and no bias, bfloat16 x: the (..., N) bfloat16 sums ``Int8Linear`` scales; int8 x: the (..., N) exact int32
    sums (torch's int8 GEMM's). The weight is packed on every call: this is for graphs whose weights inductor freezes,
    where the packing is done once."""
    if not takes(x, weight, bias):  # a check while tracing, not in the compiled graph
        pairs = [(str(a), str(b)) for a, b in operands(compiled=compiling())]
        raise ValueError(f"panels.linear runs the CPU operands panels.takes accepts here ((x, weight) dtypes "
                         f"{pairs}), got x {x.dtype} {tuple(x.shape)}, weight "
                         f"{weight.dtype} {tuple(weight.shape)}, bias {None if bias is None else (bias.dtype, tuple(bias.shape))}")
    return torch.ops.headwise.panels_linear(x, torch.ops.headwise.pack_panels(weight, x.dtype), bias, weight.shape[0])  # (..., N)
