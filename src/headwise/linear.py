"""The projections (Q/K/V, ``c_attn``, ``out_proj``) through oneDNN where the machine rewards it.

``F.linear`` on a CPU goes to the BLAS torch was built with (MKL in the official wheels).
On some CPUs, AMD's EPYC with AVX-512 among them, MKL runs fp32 GEMMs at about half the rate
oneDNN's own kernels reach on the same cores, with the same float32 accuracy. ``linear`` sends a
projection to oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``) when all of these hold:

- the tensors are plain (no subclass such as DTensor) dense CPU float32 or bfloat16 tensors, all of one
  dtype, the weight contiguous;
- torch has oneDNN and ``torch.backends.mkldnn.enabled`` is True (the user's switch is respected);
- there are enough rows (``MIN_ROWS``) for a GEMM to dominate, or the weight is big enough
  (``MIN_DECODE_WEIGHT`` elements) that a decode step streams it from memory, where oneDNN's
  packed layout reads it faster than MKL's gemv (one row through twelve cold 2304x768 weights on
  this AMD EPYC: 250 vs 480 us a call);
- a one-time probe on this machine (``onednn_pays``) found oneDNN faster than ``F.linear``.

Otherwise it is exactly ``F.linear``. Training works: a custom autograd Function computes
grad_input = grad @ W and grad_weight = grad^T @ x with the same kernels. Outside autograd
(``torch.no_grad``, inference mode, or nothing requires grad) the weight is reordered once into
oneDNN's blocked layout and reused until the weight changes: the cache is keyed on the weight's
storage pointer, ``_version`` (bumped by every in-place update: optimizer steps,
``load_state_dict``), shape and dtype, so a packed weight is never stale.
Nothing global is changed.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

MIN_ROWS = 32  # fewer rows (B*T) than this and a small weight: F.linear's lower overhead (~10 us a call) wins
MIN_DECODE_WEIGHT = 2**17  # weight elements (512 KiB in fp32) from which a decode step pays for oneDNN
_DTYPES = (torch.float32, torch.bfloat16)


def _onednn_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and mkldnn is not None
        and hasattr(mkldnn, "_linear_pointwise")
        and hasattr(mkldnn, "_reorder_linear_weight")
    )


def _lp(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN inner product: (..., K) x (N, K) [dense or packed] -> (..., N)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@functools.cache
def onednn_pays(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN's inner product beats ``F.linear`` on this machine for ``dtype``.

    Measured once per process and dtype: a GPT-2-sized projection (512 x 768 -> 768), both
    ways, interleaved, best of five each; oneDNN must win by 10% to be chosen. About 30 ms.
    """
    if dtype not in _DTYPES or not _onednn_available():
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 768, generator=gen).to(dtype)  # (M, K)
    w = torch.randn(768, 768, generator=gen).to(dtype)  # (N, K)
    try:
        with torch.no_grad():
            _lp(x, w, None)
            F.linear(x, w)
            best = {"onednn": float("inf"), "torch": float("inf")}
            for _ in range(5):
                for name, fn in (("onednn", _lp), ("torch", F.linear)):
                    start = time.perf_counter()
                    fn(x, w, None)
                    best[name] = min(best[name], time.perf_counter() - start)
    except RuntimeError:  # a build whose oneDNN cannot run this dtype here
        return False
    return best["onednn"] < 0.9 * best["torch"]


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """True when ``linear(x, weight, bias)`` takes the oneDNN path (see the module docstring)."""
    if not all(type(t) in (Tensor, nn.Parameter) for t in (x, weight, bias) if t is not None):
        return False  # a tensor subclass (DTensor under tensor parallelism, ...) dispatches itself through F.linear
    if not (x.device.type == weight.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in _DTYPES):
        return False
    if bias is not None and (bias.dtype != x.dtype or bias.device.type != "cpu"):
        return False
    if x.layout != torch.strided or not weight.is_contiguous() or x.ndim < 1:
        return False  # a sliced weight (row stride != K) sends oneDNN down a path ~1000x slower
    if x.numel() < MIN_ROWS * x.shape[-1] and weight.numel() < MIN_DECODE_WEIGHT:
        return False
    if not torch.backends.mkldnn.enabled or torch.compiler.is_compiling():
        return False
    return onednn_pays(x.dtype)


class _Packed:
    """One weight's oneDNN-blocked copy and the state of the weight it was made from."""

    __slots__ = ("key", "packed")

    def __init__(self, key: tuple, packed: Tensor | tuple[Tensor, Tensor | None]) -> None:
        self.key = key
        self.packed = packed


_PACKED: dict[int, _Packed] = {}  # id(weight) -> its packed copy; an entry dies with its weight


def _packed(weight: Tensor) -> Tensor:
    """The weight reordered for oneDNN, remade whenever the weight changed since."""
    if weight.is_inference():  # no version counter to watch: use it as it is, unpacked
        return weight
    key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.stride(), weight.dtype)
    entry = _PACKED.get(id(weight))
    if entry is None:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
    if entry is None or entry.key != key:
        entry = _Packed(key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))
        _PACKED[id(weight)] = entry
    return entry.packed


_PACKED_CAT: dict[tuple[int, ...], _Packed] = {}  # ids of the weights -> their concatenation, packed


def _packed_cat(weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> tuple[Tensor, Tensor | None]:
    """The weights stacked into one (sum N, K) weight, packed, with their biases stacked; remade on any change."""
    tensors = [t for t in (*weights, *biases) if t is not None]
    key = tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in tensors)
    ids = tuple(id(w) for w in weights)
    entry = _PACKED_CAT.get(ids)
    if entry is None:
        for w in weights:
            weakref.finalize(w, _PACKED_CAT.pop, ids, None)
    if entry is None or entry.key != key:
        stacked = torch.cat([w.detach() for w in weights])  # (sum N, K)
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])  # (sum N,)
        entry = _Packed(key, (torch.ops.mkldnn._reorder_linear_weight(stacked, None), bias))
        _PACKED_CAT[ids] = entry
    return entry.packed


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with oneDNN forward and backward GEMMs."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _lp(x, weight, bias)  # (..., N)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        N, K = weight.shape
        grad2d = grad.reshape(-1, N)  # (M, N)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _lp(grad2d, weight.t(), None).view(x.shape)  # (M, N) x (N, K) -> (..., K)
        if ctx.needs_input_grad[1]:
            grad_w = _lp(x.reshape(-1, K).t(), grad2d.t(), None).t()  # ((K, M) x (M, N) -> (K, N))^T = (N, K): faster than (N, M) x (M, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2d.sum(0)  # (N,)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with the same numbers (to float32 rounding), faster where oneDNN pays.

    Args:
        x: (..., K) input, e.g. (B, T, C).
        weight: (N, K), PyTorch's ``nn.Linear`` layout.
        bias: (N,) or None.

    Returns:
        (..., N).

    Example:
        >>> lin = torch.nn.Linear(768, 2304)
        >>> linear(torch.randn(4, 128, 768), lin.weight, lin.bias).shape
        torch.Size([4, 128, 2304])
    """
    if not uses_onednn(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)  # (..., N)
    return _lp(x, _packed(weight), None if bias is None else bias.detach())  # (..., N)


def project(layer: nn.Module, x: Tensor) -> Tensor:
    """``layer(x)`` for a projection layer, through ``linear`` when the layer is a plain ``nn.Linear``.

    A subclass, a replaced module (LoRA, quantised) or one with hooks is called as it is, so
    whatever it adds still happens.

    Args:
        layer: usually an ``nn.Linear`` with weight (N, K).
        x: (..., K).

    Returns:
        (..., N).
    """
    if not _plain(layer):
        return layer(x)
    return linear(x, layer.weight, layer.bias)  # (..., N)


def project_many(layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """``[project(layer, x) for layer in layers]``, as one GEMM where that is safe and pays.

    When every layer is a plain, hook-free ``nn.Linear`` on the oneDNN path, all with a bias
    or all without, and no gradient is wanted, the weights are stacked and packed once (remade
    when any of them changes) and x is read once: one call instead of, say, three for Q, K, V.
    The results are then views of one (..., sum N) tensor. Otherwise each layer runs alone.

    Args:
        layers: layers with weights (N_i, K).
        x: (..., K).

    Returns:
        one (..., N_i) tensor per layer.
    """
    linears = [layer for layer in layers if _plain(layer)]
    fused = len(linears) == len(layers) > 1 and not (torch.is_grad_enabled() and (x.requires_grad or any(
        p.requires_grad for layer in linears for p in layer.parameters())))
    if fused:
        biases = [layer.bias for layer in linears]
        fused = all(b is None for b in biases) or all(b is not None for b in biases)
        fused = fused and all(not layer.weight.is_inference() and uses_onednn(x, layer.weight, layer.bias) for layer in linears)
    if not fused:
        return [project(layer, x) for layer in layers]
    weight, bias = _packed_cat([layer.weight for layer in linears], biases)
    y = _lp(x, weight, bias)  # (..., sum N)
    return list(y.split([layer.out_features for layer in linears], dim=-1))  # (..., N_i) each


def _plain(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear and not layer._forward_hooks and not layer._forward_pre_hooks and not _global_module_hooks()


def _global_module_hooks() -> bool:
    from torch.nn.modules import module as _module

    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)
