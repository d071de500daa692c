"""Weight-only int8 for decode: ``int8_weights(model)`` stores every projection and the LM head as int8.

A decode step reads every weight once, so its time is the bytes it reads: int8 weights are a
quarter of float32's. Each ``nn.Linear`` becomes an ``Int8Linear``: weight (N, K) rounded to
int8 with one float32 scale per output channel (symmetric, ``scale = max|w_row| / 127``), the
bias kept in the model's dtype. A model whose LM head is tied to its embeddings (``lm_head`` is
None: GPT-2, tied Llamas) gets an int8 copy of the embedding matrix as ``lm_head``; the
embedding itself stays as it was (a token reads one row of it).

What an ``Int8Linear`` computes, on every path: the activations rounded to bfloat16, times the int8
weight with float32 sums, the sums rounded once to bfloat16, then the float32 per-channel scale and
the bias applied in float32, the result in the input's dtype. The products of a bfloat16 and an
int8 value are exact in float32, so the paths differ only in the order of their sums (and a subnormal
activation: bfloat16 dot-product instructions, the panels' vdpbf16ps among them, read it as zero). Under
``torch.compile`` with autograd recording, inductor may fuse a rounding to bfloat16 and back into its kernel and drop
it (its ``emulate_precision_casts`` keeps such roundings): that graph's outputs lie nearer the unrounded GEMM's. How
each path is chosen, by one fixed rule (nothing timed):

- on the CPU, at most ``headwise.linear.DECODE_ROWS`` rows of input (eagerly where torch's kernels run AVX2, up to
  ``AVX2_WIDE_ROWS`` of a weight of ``MIN_DECODE_WEIGHT`` elements or more that the panels take; eagerly on a CPU with
  AVX512-BF16 and no AMX tiles, up to ``WIDE_ROWS`` of such a weight: a batch's next tokens), no autograd, torch has
  ``torch.ops.aten._weight_int8pack_mm`` (a decode step): eagerly, ``headwise.linear.panels``' GEMM
  over the weight packed once (``panel_sums``: kept while the weight is unchanged, a copy of its
  bytes) where it takes the operands (AVX-512 with AVX512-BF16, or torch's AVX2 kernels, the library built; through
  ``headwise.linear.project`` and ``project_many``, the models' calls, that decision and the layers'
  weights stacked and packed are kept while their tensors are unchanged: ``Int8Linear.decode_call``); else, where
  ``int8_mm_takes`` accepts the operands, that kernel, with bfloat16 activations (its only
  vectorised input dtype on x86, AVX2 and AVX-512 alike; float32 input runs a scalar loop) and
  unit scales; under ``torch.compile`` an opaque op, or, where the graph freezes the weights
  (``generate(..., compile=True)`` on the CPU), the panels GEMM over the int8 weight packed at
  compile where it takes the operands, else the kernel traced, which inductor may run as its own
  packed int8 GEMM;
- otherwise (a prompt, training, another device, no such op, a K the kernel cannot read) torch's
  GEMM of the same operands: the int8 weight converted to bfloat16 (exact) and a bfloat16
  ``F.linear`` on a CPU with native bfloat16 dot products (``headwise.machine.bf16_flags``), when
  autograd records nothing; else the float32 ``F.linear`` of the rounded activations and the
  weight, rounded to bfloat16 after (the same numbers at float32's rate, and a float32 backward).

So a prompt and the decode steps after it multiply alike, and a prompt on a CPU with bfloat16 dot
products runs at bfloat16's rate; ``int8_errors`` measures what the int8 weights and the
bfloat16 roundings cost.

``activations="int8"`` (``int8_weights(model, activations="int8")``) is another arithmetic, the
one CTranslate2's int8 and llama.cpp's q8_0 use: each row of activations rounded to int8 with its
own scale (``max|x_row|`` times 1/127, in float32), the int8 x int8 products summed exactly in int32
(so at most ``INT8_ROWS_MOST_K`` = (2**31 - 1) // (128 * 127) input features: 128 * 127 * K fits, a loaded weight's -128 too),
each sum rounded to float32, multiplied by the row's scale, then by the channel's, then the bias
added, each step a float32 rounding. Integer sums have no order, so every path gives the same
numbers, bit for bit: eagerly, a decode step's rows by the panels GEMM over the weight packed once
where it takes them (AVX512-VNNI's byte products, else AVX2's word products), a prompt's too on a CPU without
AVX512-VNNI (torch's int8 GEMM is a scalar loop there, docs: decoding), else torch's int8 GEMM
(``torch._int_mm``, oneDNN with VNNI / AMX) on the CPU for any rows (under ``torch.compile`` on a CPU without AMX's
int8 tiles, through an opaque op: inductor's own int8 GEMMs for frozen weights are scalar there,
``machine.amx_int8_on``; the op runs the panels where torch's GEMM is scalar; where the graph freezes the weights,
on every CPU the panels take but those with AMX's int8 tiles, ``headwise.linear.panels``' integer GEMM over the
weight packed at compile, which reads the weights at memory's rate), else (another device, autograd) a
float64 GEMM of the same integers, exact, with the rounding's gradient passed straight through. A
row's result never depends on the other rows, and the GEMM's time hardly grows with them: a decode
step of 8 rows reads the weights in little more than one row's time, where the bfloat16-activation
kernel's time grows with the rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks
from .linear import DECODE_ROWS, panels, projection
from .linear.onednn import recorded
from .linear.rule import MIN_DECODE_WEIGHT, avx2_band
from .loadable import AllOrNothing, _takes
from .machine import amx_int8_on, bf16_flags, cpu

_INT8_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")  # this torch has the CPU int8 weight-only kernel
_int8_mm = torch.ops.aten._weight_int8pack_mm.default if _INT8_KERNEL else None  # (M, K) bf16 x (N, K) int8, (N,) bf16 scales -> (M, N)
_AMX_INT8 = amx_int8_on(cpu())  # int8 x int8 in AMX tiles: inductor's frozen int8-activation GEMMs are fast (read once)
_VECTOR_INT_MM = "avx512_vnni" in cpu()["flags"]  # torch's int8 GEMM runs oneDNN's vector kernels here (elsewhere a scalar loop)
K_MULTIPLE = 16  # the kernel's vector loop reads K in steps of 16 bfloat16 values (8 on AVX2 and NEON)
ROWS_ALIGNMENT, WEIGHT_ALIGNMENT = 32, 16  # bytes: its aligned vector loads of a row of activations and of weights
ACTIVATIONS = ("bf16", "int8")  # Int8Linear's two arithmetics (the module docstring)
_TINY = torch.finfo(torch.float32).tiny
_BF16_GEMM = bool(bf16_flags())  # this CPU has bf16 dot products: torch's bf16 GEMM runs them (read once: a compiled graph reads no /proc)
_WIDE_PANELS = bf16_flags() == ["avx512_bf16"]  # AVX512-BF16 without AMX tiles: the panels take bf16 x int8 up to WIDE_ROWS
WIDE_ROWS = 64  # rows up to which the panels take Int8Linear's bfloat16-activation calls there (docs: decoding)


def int8_mm_takes(rows: Tensor, weight: Tensor) -> bool:
    """Whether ``aten._weight_int8pack_mm(rows, weight, scales)`` reads only inside its operands here.

    Its CPU kernel checks dtypes and ranks, not what its vector loop assumes: bfloat16 rows whose K
    is a multiple of ``K_MULTIPLE`` (any other K reads past each row: values far off, inf, or a
    SIGSEGV), rows starting on a ``ROWS_ALIGNMENT``-byte boundary and a weight on a
    ``WEIGHT_ALIGNMENT``-byte one (aligned loads: a SIGSEGV otherwise), both contiguous, on the CPU,
    with sizes that fit the 32-bit ints it indexes with. ``tests/test_private_ops.py`` runs the
    kernel on both sides of each condition.

    Args:
        rows: (M, K) activations as the kernel would read them.
        weight: (N, K) int8.
    """
    if not (rows.dtype == torch.bfloat16 and weight.dtype == torch.int8 and rows.ndim == 2 and weight.ndim == 2):
        return False
    k = weight.shape[1]
    return (rows.shape[1] == k and k % K_MULTIPLE == 0 and rows.is_cpu and weight.is_cpu
            and rows.is_contiguous() and weight.is_contiguous() and max(rows.numel(), weight.numel()) < 2**31
            and rows.data_ptr() % ROWS_ALIGNMENT == 0 and weight.data_ptr() % WEIGHT_ALIGNMENT == 0)


def _kernel_rows(x: Tensor) -> Tensor:
    """(..., K) -> (M, K) contiguous bfloat16 on its own aligned storage (a view at an odd offset is copied)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()  # (M, K)
    return rows if rows.data_ptr() % ROWS_ALIGNMENT == 0 else rows.clone()


def _joined(tensors: Sequence[Tensor]) -> Tensor:
    """The tensors concatenated along dim 0; one tensor as it is (no copy in the graph)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(list(tensors))


def _scaled(y: Tensor, scales: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """(..., N) sums rounded to bfloat16 -> bias + sums * scale, computed in float32, as ``dtype``."""
    y = y * scales if bias is None else torch.addcmul(bias, y, scales)  # (..., N) float32
    return y.to(dtype)  # (..., N)


def _bf16_values(t: Tensor) -> Tensor:
    """``t`` rounded to bfloat16, held as float32; under autograd the rounding passes the gradient straight through."""
    r = t.to(torch.bfloat16).float()
    return t.float() + (r - t.float()).detach() if t.requires_grad else r  # r - t is exact: they are within a bf16 step


def _gemm(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """(..., K) x (N, K) int8 -> (..., N) in x's dtype with torch's GEMM: the kernel's arithmetic (the
    module docstring) for any rows, width, device or autograd."""
    if _BF16_GEMM and x.is_cpu and not recorded(x):
        y = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16))  # (..., N) bfloat16: float32 sums rounded once
    else:  # bf16 x int8 products are exact in float32: the same sums, rounded once after (a float32 backward)
        y = F.linear(_bf16_values(x), weight.float())  # (..., N) float32
        y = _bf16_values(y) if y.requires_grad else y.to(torch.bfloat16)  # (..., N): the sums rounded once
    return _scaled(y, scales, bias, x.dtype)


def panel_sums(rows: Tensor, weight: Tensor) -> Tensor | None:
    """(M, K) bfloat16 or int8 rows x (N, K) int8 -> (M, N) sums by ``headwise.linear.panels``' GEMM over the weight
    packed once for rows of that dtype (kept while the weight is unchanged: ``weight_cache.PANELS``), where
    ``panels.takes`` the operands and a change to the weight can be seen (not an inference tensor, not under
    torch.distributed); else None. bfloat16 rows: float32 sums rounded once to bfloat16; int8 rows: the
    exact int32 sums."""
    if not _panels_take(rows, weight):
        return None
    return torch.ops.headwise.panels_linear(rows, panels.packed(weight, rows.dtype), None, weight.shape[0])  # (M, N)


def _whole_call(x: Tensor, layer: Int8Linear) -> bool:
    """Whether one C++ op computes a decode call of ``layer`` (or its stack) on x where the panels take its operands
    (``headwise::panels_int8_scaled``, or ``panels_int8_rows_scaled`` for int8 activations): x float32 or bfloat16,
    float32 scales, a bias whose float32 copy is exact. (A compiled step keeps the panels GEMM and torch's scaling,
    which inductor fuses: the one op gave it nothing, docs: decoding.)"""
    bias = layer.bias
    return (x.dtype in (torch.float32, torch.bfloat16) and layer.scales.dtype == torch.float32
            and (bias is None or bias.dtype in (torch.float32, torch.bfloat16, torch.float16)))


def _panels_take(rows: Tensor, weight: Tensor) -> bool:
    """Whether ``panel_sums`` runs: ``panels.takes`` the operands and a change to the weight can be seen (a packed copy
    of an inference tensor, or under torch.distributed, could go stale unseen)."""
    return panels.takes(rows, weight, None) and panels.keeps(weight)


def _int8_matmul(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, ones: Tensor) -> Tensor:
    """(M, K) x (N, K) int8 with (N,) scales and bias -> (M, N) in x's dtype: the panels GEMM where it takes the
    operands (``panel_sums``), else the kernel when ``int8_mm_takes`` them, else the same arithmetic through torch's GEMM."""
    rows = _kernel_rows(x)  # (M, K) bfloat16
    if (sums := panel_sums(rows, weight)) is not None:
        return _scaled(sums, scales, bias, x.dtype)  # (M, N)
    if not int8_mm_takes(rows, weight):
        return _gemm(x, weight, scales, bias)  # (M, N)
    return _kernel_sums(rows, weight, scales, bias, ones, x.dtype)  # (M, N)


def _kernel_sums(rows: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, ones: Tensor, dtype: torch.dtype) -> Tensor:
    """(M, K) bfloat16 rows the kernel takes -> (M, N) in ``dtype``: the kernel's bfloat16 sums (unit scales), then the
    channel scales and the bias."""
    return _scaled(_int8_mm(rows, weight, ones), scales, bias, dtype)  # (M, N)


def _int8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """(M, K) -> (M, K) integer values in [-127, 127] and their (M, 1) float32 scales: each row over max|x_row| * (1/127),
    rounded (a row of zeros: scale float32's tiny, values 0; a row holding an infinity or a NaN: scale NaN, so its
    outputs are NaN). Under autograd the rounding passes the gradient straight through and the scales are constants."""
    rows = x.float()  # (M, K)
    # (M, 1): max|x_row| times float32's 1/127, a product on every device (a CUDA division by a host scalar multiplies
    # by its reciprocal, the CPU's divides: 4.5% of quotients would differ in their last bit)
    scales = rows.detach().abs().amax(dim=1, keepdim=True).mul_(1 / 127).clamp_min_(_TINY)
    scales = scales.where(scales != math.inf, math.nan)  # an infinite row: NaN, not infinities of any sign
    scaled = rows / scales  # (M, K)
    if rows.requires_grad:
        return scaled + (scaled.round() - scaled).detach(), scales
    return scaled.round_(), scales


def _int8_rows_matmul(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """(..., K) x (N, K) int8 -> (..., N) in x's dtype by ``activations="int8"``'s arithmetic (the module docstring)."""
    rows, row_scales = _int8_rows(x.reshape(-1, x.shape[-1]))  # (M, K) integer values, (M, 1)
    if rows.is_cpu and not rows.requires_grad:
        ints = rows.to(torch.int8)  # (M, K)
        # eager: a decode step's rows, or any where torch's int8 GEMM is a scalar loop (the panels chunk a prompt's rows)
        panel_rows = (rows.shape[0] <= DECODE_ROWS or not _VECTOR_INT_MM) and not _checks.compiling()
        if (sums := panel_sums(ints, weight) if panel_rows else None) is None:  # else (M, N) int32 from the panels: the same sums
            int_mm = torch.ops.headwise.int_mm if _checks.compiling() and not _AMX_INT8 else torch._int_mm  # op: unseen by inductor
            sums = int_mm(ints, _k_by_n(weight))  # (M, N) int32: exact
    else:  # the same integers in float64: products and sums exact (|sum| <= 128 * 127 * K < 2**53)
        sums = F.linear(rows.double(), weight.double())  # (M, N)
    return _int_scaled(sums, row_scales, scales, bias, x.dtype).view(*x.shape[:-1], weight.shape[0])  # (..., N)


def _k_by_n(weight: Tensor) -> Tensor:
    """(N, K) int8 -> the (K, N) matrix ``torch._int_mm`` takes: the transpose, but row-major where K = 1 (the
    transpose's strides are then (1, 1), and torch's CPU kernel reads other numbers than the weight's there)."""
    return weight.reshape(1, -1) if weight.shape[1] == 1 else weight.t()  # (K, N)


def _int_scaled(sums: Tensor, row_scales: Tensor, scales: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """(M, N) exact integer sums -> each rounded to float32, times its row's (M, 1) scale, then its channel's (N,), plus
    the bias, each a float32 rounding, as ``dtype``."""
    y = sums.float().mul_(row_scales).mul_(scales)  # (M, N): scaled in place (written once)
    y = y if bias is None else y.add_(bias)
    return y.to(dtype)  # (M, N)


@torch.library.custom_op("headwise::int_mm", mutates_args=())
def _int_mm_op(a: Tensor, b: Tensor) -> Tensor:
    """``torch._int_mm(a, b)``, (M, K) x (K, N) int8 -> (M, N) int32, as an op inductor does not look into.

    Where the weights are frozen, inductor rewrites a traced ``_int_mm`` and its scales into its own quantized
    linear, whose kernels for signed int8 activations are AMX's alone (``machine.amx_int8_on``): elsewhere it runs
    a scalar one. So a compiled int8-activation projection calls torch's kernel through this op off AMX; where that
    kernel is a scalar loop too (no AVX512-VNNI), the panels' integer GEMM over the weight packed for the call."""
    if not _VECTOR_INT_MM and panels.takes(a, b.t(), None):
        return torch.ops.headwise.panels_linear(a, torch.ops.headwise.pack_panels(b.t(), torch.int8), None, b.shape[1])  # (M, N): the same sums
    return torch._int_mm(a, b)


@_int_mm_op.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32)  # (M, N)


@torch.library.custom_op("headwise::int8_matmul", mutates_args=())
def _int8_matmul_op(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, ones: Tensor) -> Tensor:
    """``_int8_matmul`` as an op ``torch.compile`` does not look into: the guard reads the storage the graph hands it."""
    return _int8_matmul(x, weight, scales, bias, ones)


@_int8_matmul_op.register_fake
def _(x: Tensor, weight: Tensor, scales: Tensor, bias: Tensor | None, ones: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))  # (M, N)


#: The most input features ``activations="int8"`` takes: 128 * 127 * K must fit an int32 sum (x rounds to [-127, 127];
#: the layer rounds its weight so too, but a loaded state dict may hold -128).
INT8_ROWS_MOST_K = (2**31 - 1) // (128 * 127)


class Int8Linear(AllOrNothing, nn.Module):
    """``nn.Linear`` with an int8 weight and a float32 scale per output channel: (..., K) -> (..., N).

    Args:
        weight: (N, K) float weight to quantize.
        bias: (N,) or None, kept as it is.
        activations: "bf16" (the activations rounded to bfloat16) or "int8" (each row rounded to
            int8 with its own scale, exact integer sums): the module docstring says what each computes.

    Buffers: ``weight`` (N, K) int8, ``scales`` (N,) float32 (each row's max|w| / 127, at least float32's smallest
    normal number: a row of zeros keeps a scale, and a row below 127 times it keeps fewer than 127 levels), ``bias``
    (N,) or None.

    Example:
        >>> lin = nn.Linear(64, 32)
        >>> q = Int8Linear(lin.weight.detach(), lin.bias.detach())
        >>> x = torch.randn(2, 1, 64)
        >>> q(x).shape, bool((q(x) - lin(x)).abs().max() < 0.05)
        (torch.Size([2, 1, 32]), True)
    """

    fresh_output = True  # forward returns a new tensor each call (``headwise.linear.owns_output``)

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, activations: str = "bf16") -> None:
        super().__init__()
        self._arithmetic = _activations(activations)
        if not isinstance(weight, Tensor) or weight.ndim != 2 or not weight.is_floating_point():
            got = f"{type(weight).__name__}" if not isinstance(weight, Tensor) else f"{weight.dtype} of shape {tuple(weight.shape)}"
            raise TypeError(f"weight must be a floating-point (N, K) tensor, got {got}")
        if _checks.sharded(weight) or _checks.sharded(bias):
            raise TypeError("weight is a DTensor (a layer sharded by headwise.parallel): int8 weights and tensor parallelism do not "
                            "combine; round the unsharded model's weights, and serve it unsharded")
        if weight.shape[1] == 0:
            raise ValueError(f"weight must have K >= 1 input features, got shape {tuple(weight.shape)}")
        if self._arithmetic == "int8" and weight.shape[1] > INT8_ROWS_MOST_K:
            raise ValueError(f"activations='int8' sums K products of up to 128 * 127 in int32: the weight's K must be at most "
                             f"{INT8_ROWS_MOST_K}, got shape {tuple(weight.shape)}; use activations='bf16'")
        if bias is not None and (not isinstance(bias, Tensor) or not bias.is_floating_point() or bias.shape != weight.shape[:1]):
            got = f"{type(bias).__name__}" if not isinstance(bias, Tensor) else f"{bias.dtype} of shape {tuple(bias.shape)}"
            raise ValueError(f"bias must be None or a floating-point tensor of shape (N,) = ({weight.shape[0]},), got {got}")
        w = weight.detach().float()  # (N, K)
        if _checks.has_values(w) and not (finite := torch.isfinite(w)).all():  # a NaN or inf: its row NaN (meta: shapes only)
            bad = (~finite).nonzero()  # (count, 2)
            what = "NaN or infinite" if weight.dtype.itemsize <= 4 else "NaN, infinite or past float32's range"  # (scales are float32)
            raise ValueError(f"weight must be finite in float32 to round to int8, got {len(bad)} {what} value(s), the first at "
                             f"[{bad[0, 0].item()}, {bad[0, 1].item()}]")  # fmt: skip
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # (N,): a zero row keeps scale > 0
        self._hold((w / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales, None if bias is None else bias.detach().clone())

    def _hold(self, weight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        """Register the (N, K) int8 weight, its (N,) float32 scales and the (N,) bias or None."""
        self.register_buffer("weight", weight.contiguous())  # (N, K) int8, row-major whatever the float weight's strides
        self.register_buffer("scales", scales)  # (N,)
        self.register_buffer("bias", bias)  # (N,)
        self.register_buffer("_ones", torch.ones(weight.shape[0], dtype=torch.bfloat16, device=weight.device), persistent=False)  # (N,)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Int8Linear:
        """``module.to(dtype)`` (``.bfloat16()``, ``.double()``) casts floating buffers; the scales stay float32 and the
        unit scales bfloat16, the arithmetic's own (rounded to bfloat16, the scales would move every output channel by
        up to 2**-9), wherever ``fn`` moves them. The unit scales stay out of the state dict (after ``to_empty`` no load
        would give them values): kept where ``fn`` leaves them on their device (a cast, ``.to`` where they are), made
        anew where it moves them, so a call that changes nothing keeps every buffer (a compiled step's frozen weights
        stay valid)."""
        scales, ones = self.scales, self._ones
        super()._apply(fn, recurse)
        if self.scales.dtype != scales.dtype:
            self.scales = scales.to(self.scales.device)
        if self._ones.device == ones.device and not ones.is_meta:
            self._ones = ones  # (N,) bfloat16 ones, as made
        elif self._ones is not ones:
            self._ones = torch.ones(self.out_features, dtype=torch.bfloat16, device=self._ones.device)  # (N,)
        return self

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """torch's load of this layer's entries, whatever module the load started from (a plain ``nn.Sequential`` runs no
        headwise check first): its own entries' dtypes checked before any is copied (a float weight would be truncated
        into the int8 one), then what a load cannot give: float32 scales (``assign=True`` keeps the entry's dtype) and
        the unit scales on the weight's device (they stay out of the state dict: after a meta build and an assigning
        load they were left on the meta device)."""
        wrong = [f"{prefix}{name}: expected {want}, got {state_dict[prefix + name].dtype}"
                 for name, want in (("weight", torch.int8), ("scales", torch.float32), ("bias", torch.float32))
                 if isinstance(state_dict.get(prefix + name), Tensor) and not _takes(want, state_dict[prefix + name].dtype)]
        if wrong:
            error_msgs.append(f"wrong dtype for {'; '.join(wrong)} (an Int8Linear's weight is int8, its scales and bias floats); "
                              f"nothing of {prefix or 'the layer'} was loaded")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if self.scales.dtype != torch.float32:
            self.scales = self.scales.float()  # (N,)
        if self._ones.device != self.weight.device or self._ones.is_meta:
            self._ones = torch.ones(self.out_features, dtype=torch.bfloat16, device=self.weight.device)  # (N,)

    @property
    def activations(self) -> str:
        """"bf16" or "int8": the arithmetic, fixed when the layer is made (what it runs is decided from it once)."""
        return self._arithmetic

    @classmethod
    def stack(cls, layers: Sequence[Int8Linear]) -> Int8Linear:
        """One ``Int8Linear`` whose output is the layers' outputs side by side: (..., K) -> (..., sum N).

        Their int8 weights, scales and biases concatenated (all with a bias or all without), so
        ``headwise.linear.project_many`` reads x once and runs one kernel call for, say, Q, K
        and V; every output channel keeps its own weight row and scale. A subclass with a forward of its own is not
        stacked (``ValueError``; ``project_many`` then runs each layer's forward).
        """
        if cls.forward is not Int8Linear.forward:
            raise ValueError(f"{cls.__name__} has a forward of its own: its layers are not stacked")
        if not layers or not all(isinstance(layer, Int8Linear) for layer in layers):
            raise TypeError(f"layers must be one or more Int8Linear layers, got {[type(layer).__name__ for layer in layers]}")
        biases = [layer.bias for layer in layers]
        if len({(layer.in_features, layer.activations) for layer in layers}) != 1 or len({b is None for b in biases}) != 1:
            raise ValueError("layers must share in_features and activations and all have a bias or none, "
                             f"got {[layer.extra_repr() for layer in layers]}")
        stacked = cls.__new__(cls)
        nn.Module.__init__(stacked)
        stacked._arithmetic = layers[0].activations
        with torch.inference_mode(False):  # made once, kept across calls (maybe in inference mode): tensors with versions
            stacked._hold(torch.cat([layer.weight for layer in layers]), torch.cat([layer.scales for layer in layers]),  # (sum N, K), (sum N,)
                          None if biases[0] is None else torch.cat(biases))  # (sum N,)
        return stacked.train(layers[0].training)

    @staticmethod
    def frozen_stack(layers: Sequence[Int8Linear], x: Tensor) -> Tensor | None:
        """In a graph whose weights inductor freezes: (..., K) -> the layers' outputs side by side (..., sum N) as one
        panels GEMM over their weights, scales and biases concatenated in the graph (constants inductor folds, with the
        packing, when it compiles the step), each channel's arithmetic as in ``forward`` (x rounded once, to bfloat16
        or to int8 rows, for all of them); None where the panels would not run each layer (``forward`` then runs them
        one by one), or where the layers' class has a ``forward`` of its own (each runs it)."""
        if type(layers[0]).forward is not Int8Linear.forward:
            return None
        return Int8Linear._frozen_panels(layers, x)

    @staticmethod
    def _frozen_panels(layers: Sequence[Int8Linear], x: Tensor) -> Tensor | None:
        """``frozen_stack`` for layers whose forward is this class's (``forward`` itself calls it)."""
        first = layers[0]
        if len({(layer.in_features, layer.activations, layer.bias is None) for layer in layers}) != 1:
            return None
        if not isinstance(x, Tensor) or x.ndim < 1 or x.shape[-1] != first.in_features or not x.is_floating_point():
            return None  # each layer's forward raises its error
        if not first._few_rows(x):
            return None
        flat = x.reshape(-1, first.in_features)  # (M, K)
        if first.activations == "int8":
            values, row_scales = _int8_rows(flat)  # (M, K) integer values, (M, 1)
            rows = values.to(torch.int8)  # (M, K)
        else:
            rows = flat.to(torch.bfloat16)  # (M, K)
        weight = _joined([layer.weight for layer in layers])  # (sum N, K) int8
        if not panels.takes(rows, weight, None):
            return None
        scales = _joined([layer.scales for layer in layers])  # (sum N,)
        bias = None if first.bias is None else _joined([layer.bias for layer in layers])  # (sum N,)
        sums = panels.linear(rows, weight)  # (M, sum N): int32 for int8 rows, bfloat16 for bfloat16 ones
        y = _int_scaled(sums, row_scales, scales, bias, x.dtype) if first.activations == "int8" else _scaled(sums, scales, bias, x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])  # (..., sum N)

    @classmethod
    def decode_call(cls, layers: Sequence[Int8Linear], x: Tensor) -> tuple[Callable, tuple] | None:
        """What the layers' ``forward`` runs eagerly for x's few rows, decided and prepared once for
        ``headwise.linear.project`` and ``project_many`` (which keep it while none of the layers' tensors changes):
        (a function, its arguments after x): the panels GEMM over their int8 weights, stacked and packed once, then their
        scales and biases, all of it one C++ op (``headwise::panels_int8_scaled``, or ``panels_int8_rows_scaled`` for int8
        activations) for float32 or bfloat16 x, each output channel's numbers ``forward``'s, bit for bit (int8
        activations: a NaN in a row makes that row's outputs NaN, as ``forward``'s); None where ``forward`` runs another kernel (or raises), or for other dtypes."""
        first = layers[0]
        if type(first).forward is not Int8Linear.forward:
            return None  # a subclass's own forward runs as it is
        if len({(layer.in_features, layer.activations, layer.bias is None) for layer in layers}) != 1:
            return None
        if not isinstance(x, Tensor) or x.ndim < 1 or x.shape[-1] != first.in_features or not x.is_floating_point():
            return None  # forward raises its error
        int8 = first.activations == "int8"
        if not (first._few_rows(x) if int8 else first._decode_shaped(x)):
            return None
        if not all(_whole_call(x, layer) for layer in layers):
            return None
        dtype = torch.int8 if int8 else torch.bfloat16
        weights = [layer.weight for layer in layers]
        if not all(_panels_take(x.new_empty(1, first.in_features, dtype=dtype), w) for w in weights):
            return None
        packed = panels.packed(weights[0], dtype) if len(layers) == 1 else torch.ops.headwise.pack_panels(torch.cat(weights), dtype)
        scales = _joined([layer.scales for layer in layers])  # (sum N,)
        bias = None if first.bias is None else _joined([layer.bias for layer in layers])  # (sum N,)
        n = sum(w.shape[0] for w in weights)
        op = torch.ops.headwise.panels_int8_rows_scaled if int8 else torch.ops.headwise.panels_int8_scaled
        return op, (packed, scales, None if bias is None else bias.float(), n)

    def _few_rows(self, x: Tensor) -> bool:
        """CPU tensors, no autograd, at most ``DECODE_ROWS`` rows (a decode step's), or, eagerly where torch's kernels
        run AVX2, at most ``AVX2_WIDE_ROWS`` of a weight of ``MIN_DECODE_WEIGHT`` elements or more that the panels take
        (there they beat the float32 GEMM of the weight widened on every call, as the rule's bfloat16 calls do)."""
        if not (x.is_cpu and self.weight.is_cpu and not recorded(x)):
            return False
        size, k = x.numel(), self.in_features
        if size <= DECODE_ROWS * k:
            return True
        return (avx2_band(size, k, self.weight.numel(), torch.bfloat16) and cpu()["capability"] == "AVX2" and not _checks.compiling()
                and _panels_take(x.new_empty(1, k, dtype=torch.bfloat16), self.weight))

    def _batch_rows(self, x: Tensor) -> bool:
        """Eagerly, on a CPU with AVX512-BF16 and no AMX tiles, CPU tensors, no autograd, at most ``WIDE_ROWS`` rows (a
        batch of sequences' next tokens, a short prompt or chunk) of a weight of ``MIN_DECODE_WEIGHT`` elements or more
        that the panels take. torch's GEMM would first widen the whole weight to bfloat16 in memory on every call, five
        bytes moved a weight element against the panels' one, widened in registers; from a few hundred rows its
        arithmetic, not the widening, sets the time, and it is as fast or faster (docs: decoding)."""
        k = self.in_features
        return (_WIDE_PANELS and x.numel() <= WIDE_ROWS * k and x.is_cpu and self.weight.is_cpu and not recorded(x)
                and not _checks.compiling() and self.weight.numel() >= MIN_DECODE_WEIGHT
                and _panels_take(x.new_empty(1, k, dtype=torch.bfloat16), self.weight))

    def _decode_shaped(self, x: Tensor) -> bool:
        """The rule before the kernel's guard: bf16 activations, a decode step's rows (``_few_rows``) or a batch's the
        panels take (``_batch_rows``), the kernel present."""
        return self.activations == "bf16" and _INT8_KERNEL and (self._few_rows(x) or self._batch_rows(x))

    def uses_kernel(self, x: Tensor) -> bool:
        """True when ``self(x)`` runs torch's int8 kernel (the rule in the module docstring)."""
        return self._decode_shaped(x) and not self.uses_panels(x) and int8_mm_takes(_kernel_rows(x), self.weight)

    def uses_panels(self, x: Tensor) -> bool:
        """True when ``self(x)``, eager, runs the panels GEMM over the weight packed once (the rule in the module docstring)."""
        if self.activations == "int8":
            return self._few_rows(x) and _panels_take(x.reshape(-1, self.in_features).to(torch.int8), self.weight)
        return self._decode_shaped(x) and _panels_take(_kernel_rows(x), self.weight)

    def dequantized(self, dtype: torch.dtype) -> Tensor:
        """The weight as (N, K) floats of ``dtype``: int8 times its channel's scale."""
        _checks.floating_dtype("dtype", dtype)
        return (self.weight.float() * self.scales[:, None]).to(dtype)  # (N, K)

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.ndim < 1 or x.shape[-1] != self.in_features:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            error = ValueError if isinstance(x, Tensor) else TypeError
            raise error(f"x must be a (..., K={self.in_features}) tensor for this Int8Linear, got {got}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor (the output takes its dtype), got {x.dtype}")
        _checks.same_device("x", x, "this Int8Linear's weight is", self.weight.device)  # (torch's int8 GEMM read a meta weight's nothing)
        if self.activations == "int8":
            if _checks.compiling() and projection.frozen() and (y := Int8Linear._frozen_panels([self], x)) is not None:
                return y  # (..., N): the weights frozen into the graph: the panels' integer GEMM, the same sums
            return _int8_rows_matmul(x, self.weight, self.scales, self.bias)  # (..., N)
        if not self._decode_shaped(x):
            return _gemm(x, self.weight, self.scales, self.bias)  # (..., N)
        rows = x.reshape(-1, self.in_features)  # (M, K)
        if not _checks.compiling():
            y = _int8_matmul(rows, self.weight, self.scales, self.bias, self._ones)  # (M, N)
        elif projection.frozen() and (y := Int8Linear._frozen_panels([self], rows)) is not None:
            pass  # the weights frozen into the graph: the panels' GEMM, its packing folded at compile; the same sums
        elif projection.frozen() and _INT8_KERNEL and self.in_features % K_MULTIPLE == 0:
            # the weights frozen into the graph: traced, so inductor runs the kernel or its own packed int8 GEMM;
            # the rows a new buffer of inductor's (64-byte aligned); the same arithmetic, the sums in another order
            y = _kernel_sums(rows.to(torch.bfloat16, copy=True), self.weight, self.scales, self.bias, self._ones, x.dtype)  # (M, N)
        else:
            y = torch.ops.headwise.int8_matmul(rows, self.weight, self.scales, self.bias, self._ones)  # (M, N)
        return y.view(*x.shape[:-1], self.out_features)  # (..., N)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8 per-channel, "
                f"activations={self.activations}")


def _activations(value: object) -> str:
    if value not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {list(ACTIVATIONS)}, got {value!r}")
    return value


def int8_weights(model: nn.Module, *, activations: str = "bf16") -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (and a tied LM head) by an ``Int8Linear``, in place.

    Meant for inference (decode): the int8 weights are buffers, not parameters. The model's
    embeddings, norms and KV cache keep their dtype. A model whose ``lm_head`` is None and whose
    class names its ``tied_embedding`` (GPT-2, tied Llamas) gets an int8 ``lm_head`` made from
    that embedding's weight.

    Args:
        model: any ``nn.Module`` whose forward calls its ``nn.Linear`` layers, e.g. a ``GPT2LMHeadModel`` or
            ``LlamaForCausalLM`` (a module that reads a layer's ``.weight`` itself, as the fast path of torch's
            ``nn.TransformerEncoderLayer`` does, would get the int8 values). A layer used in several places stays one
            layer.
        activations: each ``Int8Linear``'s arithmetic, "bf16" or "int8" (the module docstring).

    Returns:
        ``model`` itself, changed.

    Example:
        >>> from headwise import GPT2Config
        >>> from headwise.models import GPT2LMHeadModel
        >>> model = int8_weights(GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval())
        >>> type(model.lm_head).__name__, model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4).shape
        ('Int8Linear', torch.Size([1, 7]))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _activations(activations)
    if type(model) is nn.Linear:  # replaced in place means in its parent: a layer given alone has none
        raise TypeError("model is an nn.Linear itself: int8_weights replaces the layers inside a model; make the one layer "
                        "with Int8Linear(linear.weight, linear.bias)")
    names = {id(module): name for name, module in model.named_modules()}
    other = [names[id(m)] for m in model.modules() if isinstance(m, Int8Linear) and m.activations != activations]
    if other:  # their weights are int8 already: they would stay as they are, silently on the other arithmetic
        raise ValueError(f"model already holds Int8Linear layers with another activations= ({other[0]}: "
                         f"{model.get_submodule(other[0]).activations!r}; {len(other)} in all), not {activations!r}: "
                         "call int8_weights on the float model")
    # (parent, attribute, module whose weight it rounds, its bias, training): every nn.Linear, and a tied head
    targets = [(parent, name, child, child.bias, child.training)
               for parent in model.modules() for name, child in parent._modules.items() if type(child) is nn.Linear]  # fmt: skip
    # (each parent's every entry: named_children lists a layer it holds twice once, which left the other float)
    tied = getattr(type(model), "tied_embedding", None)
    if tied is not None and getattr(model, "lm_head", 0) is None:
        targets.append((model, "lm_head", model.get_submodule(tied), None, model.training))

    made_for: dict[int, Int8Linear] = {}  # id of a layer -> its one replacement (a layer shared stays shared)

    def made(child: nn.Module, bias: Tensor | None, training: bool) -> Int8Linear:
        if id(child) not in made_for:
            try:
                made_for[id(child)] = Int8Linear(child.weight, bias, activations=activations).train(training)
            except (ValueError, TypeError) as e:
                raise type(e)(f"{names[id(child)]}: {e}; the model is unchanged") from None
        return made_for[id(child)]

    # every layer made before any is set: a weight that cannot be rounded leaves the model as it was
    replacements = [(parent, name, made(child, bias, training)) for parent, name, child, bias, training in targets]
    for parent, name, layer in replacements:
        setattr(parent, name, layer)  # an eval model stays all eval
    return model


@dataclass(frozen=True)
class Int8Error:
    """How far an int8 copy of a model is from the original, on one prompt.

    Attributes:
        logits_rel_error: ||int8 - original|| / ||original|| over the prompt's next-token logits
            (every row of the batch, one decode-shaped call each).
        logits_max_abs_error: the largest |int8 - original| among them.
        greedy_tokens: new tokens compared (greedy ``generate`` from the same prompt).
        greedy_agree: leading tokens equal in every row before the first difference.
    """

    logits_rel_error: float
    logits_max_abs_error: float
    greedy_tokens: int
    greedy_agree: int


@torch.no_grad()
def int8_errors(original: nn.Module, quantized: nn.Module, input_ids: Tensor, *, max_new_tokens: int = 256) -> Int8Error:
    """Compare a causal LM with its ``int8_weights`` copy: next-token logits and greedy agreement.

    Args:
        original, quantized: models with ``new_caches``, ``generate`` and ``forward(ids, cache=, logits_to_keep=)`` (headwise's
            GPT-2 and Llama family).
        input_ids: (B, T) prompt.
        max_new_tokens: greedy tokens to generate with each.
    """
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or 0 in input_ids.shape:  # (the models check the ids' values)
        got = tuple(input_ids.shape) if isinstance(input_ids, Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must have shape (batch, tokens) with at least one row and one token, got {got}")
    for name, model in (("original", original), ("quantized", quantized)):
        if not all(callable(getattr(model, attr, None)) for attr in ("new_caches", "generate")):
            raise TypeError(f"{name} must be a causal LM of headwise.models (new_caches, generate), got {type(model).__name__}")
    sizes = [getattr(getattr(model, "config", None), "vocab_size", None) for model in (original, quantized)]
    if sizes[0] != sizes[1]:
        raise ValueError(f"original and quantized must share a vocabulary, got vocab_size {sizes[0]} and {sizes[1]}")
    b, t = input_ids.shape
    logits = []
    for model in (original, quantized):
        caches = model.new_caches(b, t)
        logits.append(model(input_ids, cache=caches, logits_to_keep=1)[:, 0].double())  # (B, vocab)
    diff = logits[1] - logits[0]
    a = original.generate(input_ids, max_new_tokens=max_new_tokens)[:, input_ids.shape[1] :]  # (B, n)
    b = quantized.generate(input_ids, max_new_tokens=max_new_tokens)[:, input_ids.shape[1] :]  # (B, n)
    same = (a == b).all(dim=0).long()  # (n,)
    agree = int(same.cumprod(0).sum())
    return Int8Error(float(diff.norm() / logits[0].norm()), float(diff.abs().max()), a.shape[1], agree)
