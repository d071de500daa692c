"""The "sdpa" backend: torch's fused kernels, and the terms they can carry exactly.

``fused`` is one call with every term folded into one mask (``is_causal`` where it means the
same); ``masked_blocks`` (a causal prompt, a window, ALiBi) calls it a block of queries at a time over
the keys each sees. Sinks, in any of them: the CPU flash kernel returns each row's log-sum-exp, and a sink
only rescales a row, ``context * sigmoid(lse - sink)`` (``SinkAttention``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..scores import sink_share
from .blocks import joined, query_blocks
from .once import first_order
from .spec import Spec

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def flash_guard(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
    """The one guard in front of torch's private CPU flash op (forward and backward): True when it has work.

    What the op takes (torch 2.13, probed in subprocesses by ``tests/test_flash_guard.py``):
    q (B, H, T, D), k and v (B, Hkv, S, D) of one dtype, one batch B, one head size D (Dv == D),
    H a multiple of Hkv, any strides but the last dimension's (rows of D elements one after another:
    given another stride it reads the wrong elements without a word, so ``_rows`` copies such a
    tensor first), and a float mask of q's dtype (or float32, added in float32) broadcastable to (B, H, T, S).
    It divides by zero (SIGFPE, the interpreter dies) when H, T or S is 0, or B and T are: no
    empty call reaches it, the caller answers it (False here). It reads another batch or an H that
    Hkv does not divide without a word: those raise ValueError here.
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if k.shape[0] != B or v.shape[:3] != k.shape[:3] or k.shape[3] != D or v.shape[3] != D or (Hkv and H % Hkv):
        raise ValueError(f"the CPU flash op takes q (B, H, T, D), k and v (B, Hkv, S, D) with Hkv | H, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or (mask is not None and mask.dtype not in (q.dtype, torch.float32)):
        raise ValueError(f"the CPU flash op takes q, k, v of one dtype and a float mask of theirs or float32, got {q.dtype}, {k.dtype}, {v.dtype}, {None if mask is None else mask.dtype}")
    return B * H * T * S > 0


def _rows(*tensors: Tensor) -> list[Tensor]:
    """Each tensor with its last dimension contiguous (the flash op's one demand on strides), copied only where not."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(B, H, T, Dv) context and (B, H, T) log-sum-exp; no keys: zeros and -inf, without the op."""
    if flash_guard(q, k, v, mask):
        return _flash(*_rows(q, k, v), 0.0, is_causal, attn_mask=mask, scale=scale)  # (B, H, T, Dv), (B, H, T)
    B, H, T, _ = q.shape
    lse = torch.full((B, H, T), -math.inf, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)  # (B, H, T)
    return q.new_zeros(B, H, T, v.shape[3]), lse


def _flash_grads(g: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> tuple:
    """The op's backward: (dq, dk, dv); zeros for an empty call, without the op."""
    if flash_guard(q, k, v, mask):
        return _flash_backward(*_rows(g, q, k, v, o), lse, 0.0, is_causal, attn_mask=mask, scale=scale)[:3]
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


class SinkAttention(torch.autograd.Function):
    """softmax over the keys plus one sink logit per head, on the CPU flash kernel.

    With o and lse the kernel's output and log-sum-exp, the sink keeps a share ``w =
    sigmoid(lse - sink)`` of the row: y = o * w. Backward: the kernel's backward needs
    rowsum(dO * O) for each row; with dO = g * w and O replaced by y that sum is exactly the
    plain sum minus lse's own gradient, so the kernel's backward, given (g * w, y), returns
    the gradients of the whole expression. The sink's gradient is -sum of w (1 - w) g.o.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
                shift: Tensor | None = None) -> Tensor:
        o, lse = _flash_forward(q, k, v, mask, is_causal, scale)  # (B, H, T, Dv), (B, H, T)
        whole = lse if shift is None else lse + shift  # (B, H, T): a mask shifted by each row's ``shift`` (its top) put back
        w = sink_share(whole, sinks).unsqueeze(-1)  # (B, H, T, 1) float32
        y = (o * w).to(o.dtype)  # (B, H, T, Dv)
        ctx.save_for_backward(q, k, v, o, lse, w, y, mask, sinks)
        ctx.is_causal, ctx.scale, ctx.sinks_dtype = is_causal, scale, sinks.dtype
        return y

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple:
        saved = ctx.saved_tensors  # unpacked once
        with torch.no_grad():
            grads = SinkAttention._grads(ctx, g, saved)
        return first_order(grads, saved[:3] + saved[-2:], "with sinks on the CPU flash kernel")

    @staticmethod
    def _grads(ctx, g: Tensor, saved: tuple) -> tuple:
        q, k, v, o, lse, w, y, mask, _ = saved
        go = (g * w).to(g.dtype).contiguous()  # (B, H, T, Dv)
        dq, dk, dv = _flash_grads(go, q, k, v, y, lse, mask, ctx.is_causal, ctx.scale)
        share = (g.to(w.dtype) * o.to(w.dtype)).sum(-1) * (w * (1 - w)).squeeze(-1)  # (B, H, T), float32 or wider
        dsinks = -share.sum((0, 2)).to(ctx.sinks_dtype)  # (H,)
        return dq, dk, dv, dsinks, None, None, None, None


def _mask_dtype(q: Tensor, bias: Tensor) -> torch.dtype:
    """The dtype of the fused call's mask: a float32 bias stays float32 beside 16-bit queries on the CPU (torch's CPU
    kernels add it to the scores in float32); elsewhere q's dtype, where a bias far below its row's top (ALiBi's over
    far keys) moves by up to a step of that dtype (0.25 at -64 in bfloat16)."""
    return bias.dtype if bias.dtype == torch.float32 and q.device.type == "cpu" else q.dtype


def _kernel(q: Tensor, k: Tensor, v: Tensor, spec: Spec, allowed: Tensor | None, bias: Tensor | None, is_causal: bool) -> Tensor:
    """One fused call over a block: bool ``allowed`` and float ``bias`` folded into one mask."""
    mask, shift = allowed, None
    if bias is not None:
        dtype = _mask_dtype(q, bias)
        if bias.dtype != dtype and k.shape[2]:  # narrowed: each row's largest bias taken off first (none: no key)
            seen = bias if allowed is None else bias.masked_fill(~allowed, -math.inf)  # (B?, H?, t, s)
            top = seen.amax(-1, keepdim=True).detach()  # (B?, H?, t, 1); softmax does not see a row's constant
            top = top.masked_fill(~torch.isfinite(top), 0.0)
            bias = bias - top  # the keys that carry the weight keep the finest steps
            shift = top.squeeze(-1)  # (B?, H?, t): a sink's share is of the row's logits as given (SinkAttention)
        bias = bias.to(dtype)  # (B?, H?, t, s)
        mask = bias if allowed is None else bias.masked_fill(~allowed, -math.inf)
    if spec.sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=spec.dropout_p, is_causal=is_causal, scale=spec.scale,
            enable_gqa=True if q.shape[1] != k.shape[1] else False,  # noqa: SIM210 (a branch: a traced SymBool guarded to the bool the binding takes)
        )  # (B, H, t, Dv)
    if mask is not None and mask.dtype == torch.bool:  # the flash kernel takes float masks only
        mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)  # (B?, H?, t, s)
    if mask is not None:
        mask = mask.view((1,) * (4 - mask.ndim) + tuple(mask.shape))  # (B?, H?, t?, s?)
        mask = mask.expand(mask.shape[0], mask.shape[1], q.shape[2], k.shape[2])  # (B?, H?, t, s)
    return SinkAttention.apply(q, k, v, spec.sinks, mask, is_causal, spec.scale, shift)  # (B, H, t, Dv)


def _folded(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """One kernel call over all of ``spec``'s queries and keys, its mask and bias folded into one: (B, H, T', D) -> (B, H, T', Dv),
    where T' may repeat spec.T = 1's row (the (..., 1, S) mask broadcasts over them)."""
    whole = (0, spec.T), (0, spec.S)
    return _kernel(q, k, v, spec, spec.allowed(*whole, q.device), spec.bias(*whole, q.device, q.dtype), False)


def fused(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """One kernel call, every term folded into one mask (none for plain causal: ``is_causal``): (B, H, T, D) -> (B, H, T, Dv)."""
    if spec.plain_causal:
        return _kernel(q, k, v, spec, None, None, True)
    return _folded(q, k, v, spec)  # (B, H, T, Dv)


def grouped_rows(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """One query per row that sees every key, H = G * Hkv: each key head's G query heads as G rows of
    one fused call (torch's CPU kernel runs rows of one head far faster than one row of each of G
    heads). (B, H, 1, D) x (B, Hkv, S, D) -> (B, H, 1, Dv); query head h reads key head h // G."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, (H // Hkv) * T, D), k, v, scale=spec.scale)  # (B, Hkv, G, Dv)
    return out.view(B, H, T, v.shape[-1])  # (B, H, 1, Dv)


def row_twice(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """One query per row (T = 1) as two equal rows of one fused call, the first kept: torch's CPU kernel runs two
    rows of a head faster than one where its bfloat16 GEMMs are not MKL's AVX-512 kernels. Every term is folded
    into one (..., 1, S) mask, as in ``fused``, which both rows share. (B, H, 1, D) -> (B, H, 1, Dv)."""
    twice = q.expand(-1, -1, 2, -1).contiguous()  # (B, H, 2, D): the kernel reads a copy faster than a stride-0 row
    return _folded(twice, k, v, spec)[:, :, :1]  # (B, H, 1, Dv)


def masked_blocks(q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, rows: int) -> Tensor:
    """Every term (causality, a window, ALiBi's bias, padding, a mask) folded a block of ``rows`` queries at a time, each
    block over only the keys it may see: (B, H, T, D) -> (B, H, T, Dv).

    One folded call computes every score of its (T, S) mask, and torch's CPU flash kernel (torch 2.13) computes every
    score of a key block (up to 512) that a query block reaches, even under ``is_causal``: half of a causal prompt's
    T x T square is masked work. Here block r0..r1 of a causal prompt reads keys 0..r1 only (the first of a plain causal
    one with ``is_causal``, the others with their (t, r1) mask); a window's blocks compute about (W + rows) scores a
    query; an ALiBi bias is never (H, T, S) at once.
    """
    contexts = []
    for block, (c0, c1) in query_blocks(spec, rows):
        plain = spec.plain_causal and block[0] == 0  # keys 0 .. r1 of queries 0 .. r1: is_causal says it all
        allowed = None if plain else spec.allowed(block, (c0, c1), q.device)  # (B?, H?, t, s) or None
        bias = spec.bias(block, (c0, c1), q.device, q.dtype)  # (B?, H?, t, s) or None
        contexts.append(_kernel(q[:, :, block[0] : block[1]], k[:, :, c0:c1], v[:, :, c0:c1], spec, allowed, bias, plain))  # (B, H, t, Dv)
    return joined(contexts)  # (B, H, T, Dv)
