"""The oneDNN path: oneDNN's private inner-product ops behind their guards, for training and inference.

- ``inner_product`` (``torch.ops.mkldnn._linear_pointwise``) and ``reorder``
  (``torch.ops.mkldnn._reorder_linear_weight``) are called only for operands their guards,
  ``inner_product_takes`` and ``reorder_takes``, accept;
- ``ops_error`` tries both ops once per dtype on tiny tensors against ``F.linear`` (not timed):
  where they fail, the rule says ``torch`` and warns once;
- ``run`` computes one call: under autograd through ``OneDNNLinear``, whose backward GEMMs run
  on oneDNN too; without it on the weight packed once into oneDNN's blocked layout
  (``weight_cache``), repacked whenever the weight changes.

Every GEMM gets row-major operands: the expanded (stride-0) gradient of ``out.sum()`` and a
transposed or sliced input are copied first (oneDNN's strided paths are far slower), and the
weight gradient reads transposed views of those row-major tensors. A weight that is not
contiguous never gets here (``rule.uses_onednn``).
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import transformed
from .weight_cache import PACKED, cached, watchable

DTYPES = (torch.float32, torch.bfloat16)  # what oneDNN's inner product runs on any x86 CPU (float16 needs CPU flags)


def plain_tensors(*tensors: Tensor | None) -> bool:
    """Plain tensors or parameters: no subclass (DTensor, ...) that dispatches its own way, none a ``torch.func``
    transform wraps (``_checks.transformed``)."""
    return all(type(t) in (Tensor, nn.Parameter) for t in tensors if t is not None) and not transformed(*tensors)


def recorded(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on these tensors (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def inner_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN inner product: (..., K) x (N, K) [dense, transposed (K, N)^T or packed] -> (..., N)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def inner_product_gelu(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    """``F.gelu(inner_product(x, weight, bias), approximate=approximate)`` in one pass: the GELU ("none" or "tanh")
    applied by the GEMM to its float32 sums before they are stored (a bfloat16 output is rounded once, not twice)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "gelu", [], approximate)


def reorder(weight: Tensor) -> Tensor:
    """(N, K) -> the same weight in oneDNN's blocked layout, which ``inner_product`` reads as (N, K)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def inner_product_takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether oneDNN's inner product (``mkldnn._linear_pointwise``) computes ``F.linear(x, weight, bias)``,
    and ``OneDNNLinear``'s backward GEMMs its gradients, for these operands.

    It takes plain dense CPU tensors of one dtype it runs (float32, bfloat16; float16 needs CPU flags,
    float64 none), x (..., K) against a 2-D weight (N, K), and a bias of shape (N,) or None. It refuses
    K = 0, N = 0 with a packed weight, a bias of another shape and mixed dtypes with a RuntimeError, and
    a 0-d bias gives wrong numbers where ``F.linear`` broadcasts it; rows M = 0 run forward, but the
    weight gradient's GEMM then has an empty inner dimension. So M, N and K must all be > 0.
    ``tests/test_private_ops.py`` runs the op on both sides of each condition.

    Args:
        x: (..., K).
        weight: (N, K).
        bias: (N,) or None.
    """
    if not plain_tensors(x, weight, bias) or x.dtype not in DTYPES or weight.dtype != x.dtype:
        return False  # a tensor subclass (DTensor under tensor parallelism, ...) dispatches itself through F.linear
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1] or x.numel() == 0 or weight.numel() == 0:
        return False
    if x.layout != torch.strided or weight.layout != torch.strided or not (x.is_cpu and weight.is_cpu):
        return False
    return bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype and bias.is_cpu and bias.layout == torch.strided)


def reorder_takes(weight: Tensor) -> bool:
    """Whether ``mkldnn._reorder_linear_weight`` packs ``weight`` (N, K) into oneDNN's blocked layout: a plain
    2-D CPU float32 or bfloat16 tensor with N and K > 0 (an empty one fails to create its reorder)."""
    return (plain_tensors(weight) and weight.dtype in DTYPES and weight.ndim == 2 and weight.numel() > 0
            and weight.is_cpu and weight.layout == torch.strided)


@functools.cache
def ops_error(dtype: torch.dtype) -> str | None:
    """Why oneDNN's private ops cannot be used in ``dtype`` here (None: they work). Tried once, warns once."""
    try:
        if not torch.backends.mkldnn.is_available():
            raise RuntimeError("torch was built without oneDNN")
        # whatever the caller runs in (a torch.func transform, another default dtype, autocast): the probe's own float32
        with torch._C._DisableFuncTorch(), torch.no_grad(), torch.autocast("cpu", enabled=False):
            gen = torch.Generator().manual_seed(0)
            x, w, b = (torch.randn(*shape, generator=gen, dtype=torch.float32) for shape in ((5, 8), (6, 8), (6,)))  # (M, K) (N, K) (N,)
            lo = [t.to(dtype) for t in (x, w, b)]
            # plain, packed, the backward's transposed operands
            got = [inner_product(*lo), inner_product(lo[0], reorder(lo[1]), lo[2]), inner_product(lo[0] @ lo[1].t(), lo[1].t(), None)]
            want = [F.linear(x, w, b), F.linear(x, w, b), x @ w.t() @ w]  # float32, whatever autocast the caller runs
        for g, r in zip(got, want, strict=True):
            if g.shape != r.shape or not torch.allclose(g.float(), r, rtol=0.05, atol=0.05 * r.abs().max().item()):
                raise RuntimeError("results differ from F.linear")
    except Exception as e:  # any failure of a private op: use torch
        error = f"{type(e).__name__}: {str(e)[:200]}"
        warnings.warn(f"headwise.linear: oneDNN's private ops fail for {dtype} here ({error}); using F.linear", RuntimeWarning, stacklevel=3)
        return error
    return None


def packed(weight: Tensor) -> Tensor:
    """The weight reordered for oneDNN, remade whenever the weight changed since; the weight itself
    where a change could not be seen (an inference tensor has no ``_version``) or ``reorder`` does not take it."""
    if weight.is_inference() or not watchable() or not reorder_takes(weight):
        return weight
    return cached(PACKED, [weight], lambda: reorder(weight.detach()))


class OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with oneDNN forward and backward GEMMs, operands from row-major storage."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        x = x.contiguous()  # (..., K): a transposed or sliced view would take oneDNN's slow strided path
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return inner_product(x, weight, None if bias is None else bias.contiguous())  # (..., N)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        N, K = weight.shape
        grad2d = grad.reshape(-1, N).contiguous()  # (M, N): out.sum() and out.mean() give an expanded (stride-0) gradient
        if torch.is_grad_enabled():  # backward(create_graph=True): a second derivative's ops, which autograd records
            grad_x = (grad2d @ weight).view(x.shape) if ctx.needs_input_grad[0] else None  # (..., K)
            grad_w = grad2d.t() @ x.reshape(-1, K) if ctx.needs_input_grad[1] else None  # (N, K)
            return grad_x, grad_w, grad2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = inner_product(grad2d, weight.t(), None).view(x.shape)  # (M, N) x ((K, N) transposed-contiguous) -> (..., K)
        if ctx.needs_input_grad[1]:
            grad_w = inner_product(x.reshape(-1, K).t(), grad2d.t(), None).t()  # ((K, M) x (M, N))^T = (N, K): views of row-major x and grad
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2d.sum(0)  # (N,)
        return grad_x, grad_w, grad_b


def run(x: Tensor, weight: Tensor, bias: Tensor | None, gelu: str | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` on oneDNN, for operands ``rule.uses_onednn`` sent here: (..., K) -> (..., N);
    with ``gelu`` ("none" or "tanh", GELU's ``approximate``) its GELU, inside the GEMM where autograd records nothing."""
    if recorded(x, weight, bias):
        y = OneDNNLinear.apply(x, weight, bias)  # (..., N)
        return y if gelu is None else F.gelu(y, approximate=gelu)
    bias = None if bias is None else bias.detach().contiguous()
    if gelu is None:
        return inner_product(x.contiguous(), packed(weight), bias)  # (..., N)
    return inner_product_gelu(x.contiguous(), packed(weight), bias, gelu)  # (..., N)
