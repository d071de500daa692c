"""Softcapped attention over blocks of queries (``blocks.query_blocks``), with a backward that recomputes.

- **tanh through expm1.** ``tanh(x) = e / (e + 2)`` with ``e = expm1(2 x)``: no cancellation at
  any x, so the capped score keeps the score's relative precision at every cap, where
  ``2 sigmoid(2 x) - 1`` keeps only an absolute ``cap * eps``; torch's CPU expm1 costs less than
  its tanh. ``2 scale / cap`` goes into q (T x D numbers, not T x S); the products are clamped to
  +-40, where tanh is 1 to float64 precision and expm1 cannot overflow.
- **A flash-style backward** (``CappedAttention``): the forward keeps its inputs and output; the
  backward recomputes each block's weights P and tanh values and applies ``dS = P * (dP -
  rowsum(dO * O))`` (the sink carries no value: the same row sum holds) times ``1 - tanh^2``.
  Memory stays one block's scores in backward too.

Dropout, or an ALiBi slope or float mask that wants a gradient, ``plan`` sends to ``math.run_chunked``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import compiling
from . import math as math_backend
from .blocks import Block, query_blocks, rows_per_block
from .once import first_order
from .spec import Spec

_HALF = (torch.float16, torch.bfloat16)

#: 2x beyond which tanh(x) is 1 in float64 (1 - tanh(20) < 1e-17): the products are clamped there.
_SATURATED = 40.0


def _blocks(spec: Spec, B: int, H: int, block_elements: int) -> list[Block]:
    """Blocks of queries of about ``block_elements`` scores and the keys each may see (none: left out, their rows stay zero)."""
    return [block for block in query_blocks(spec, rows_per_block(spec.T, B * H * spec.S, block_elements)) if block.cols[1] > block.cols[0]]


def _grouped(x: Tensor, Hkv: int) -> Tensor:
    """(B, H, t, n) -> (B, Hkv, G*t, n): each key head's query heads stacked as rows (a copy only when G > 1)."""
    B, H, t, n = x.shape
    return x.reshape(B, Hkv, (H // Hkv) * t, n)


def _probs(
    qs: Tensor, k: Tensor, spec: Spec, rows: tuple[int, int], cols: tuple[int, int], keep: bool = False
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Weights P (B, H, t, s) of queries ``rows`` over keys ``cols``, (``keep``) the tanh values behind them, and the sink's share (B, H, t) or None.

    ``qs`` holds q * 2 scale / cap (float32 for half inputs): th = tanh(scale q.k / cap), the
    logits cap * th (+ bias), masked, then the softmax over the keys and the sink, in place (eagerly: traced by
    ``torch.compile``, the same ops out of place, whose chain of in-place views inductor's index algebra never finished).
    """
    inplace = not compiling()
    raw = math_backend.scores(qs, k)  # (B, H, t, s)
    if inplace:
        e = raw.clamp_(-_SATURATED, _SATURATED).expm1_()  # (B, H, t, s): expm1(2 x)
        th = e.div_(e + 2.0)  # (B, H, t, s): tanh(x)
    else:
        e = raw.clamp(-_SATURATED, _SATURATED).expm1()
        th = e / (e + 2.0)
    logits = th.mul_(spec.softcap) if inplace and not keep else th * spec.softcap  # (B, H, t, s)
    th = th if keep else None
    bias = spec.bias(rows, cols, qs.device, qs.dtype)  # (B?, H?, t, s) or None
    if bias is not None:
        logits = logits.add_(bias.to(logits.dtype)) if inplace else logits + bias.to(logits.dtype)
    edge = math_backend.seen_by_all(spec, rows, cols) if inplace else 0  # keys before it are visible to every row of the block
    allowed = spec.allowed(rows, (cols[0] + edge, cols[1]), qs.device)  # (B?, H?, t, s - edge) bool or None
    if allowed is not None:
        logits = math_backend.masked(logits, allowed, edge, inplace=inplace)
    p, share = math_backend.softmax(logits, spec, allowed, edge, rows, cols, dtype=None, inplace=inplace)  # (B, H, t, s), (B, H, t)
    return p.contiguous(), th, share


def _scaled_q(q: Tensor, spec: Spec) -> Tensor:
    """q * 2 scale / cap, float32 for half inputs: (B, H, T, D)."""
    return (q.float() if q.dtype in _HALF else q) * (2.0 * spec.scale / spec.softcap)


class CappedAttention(torch.autograd.Function):
    """Softcapped attention over blocks of queries; backward recomputes each block (see the module docstring)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, spec: Spec, block_elements: int) -> Tensor:
        B, H, T, _ = q.shape
        Hkv = k.shape[1]
        wide = torch.float32 if q.dtype in _HALF else q.dtype
        qs, kw = _scaled_q(q, spec), k.to(wide)  # (B, H, T, D), (B, Hkv, S, D)
        out = q.new_zeros(B, H, T, v.shape[3])  # (B, H, T, Dv): rows that see no key stay zero
        for (r0, r1), (c0, c1) in _blocks(spec, B, H, block_elements):
            p, _, _ = _probs(qs[:, :, r0:r1], kw[:, :, c0:c1], spec, (r0, r1), (c0, c1))  # (B, H, t, s)
            ctx_blk = _grouped(p.to(v.dtype), Hkv) @ v[:, :, c0:c1]  # (B, Hkv, G*t, Dv)
            out[:, :, r0:r1] = ctx_blk.view(B, H, r1 - r0, v.shape[3])
        ctx.save_for_backward(q, k, v, sinks, out)
        ctx.spec, ctx.block_elements = spec, block_elements
        return out

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple:
        saved = ctx.saved_tensors  # unpacked once
        with torch.no_grad():
            grads = CappedAttention._grads(ctx, g, saved)
        return first_order(grads, saved[:4], "with a softcap, over blocks of queries")

    @staticmethod
    def _grads(ctx, g: Tensor, saved: tuple) -> tuple:
        q, k, v, sinks, out = saved
        spec = ctx.spec
        B, H, T, _ = q.shape
        Hkv = k.shape[1]
        wide = torch.float32 if q.dtype in _HALF else q.dtype
        qs, kw, vw = _scaled_q(q, spec), k.to(wide), v.to(wide)  # (B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv)
        g = g.to(wide)  # (B, H, T, Dv)
        delta = (g * out.to(wide)).sum(-1, keepdim=True)  # (B, H, T, 1): rowsum(dO * O)
        dq = torch.zeros_like(qs)  # (B, H, T, D)
        dk, dv = torch.zeros_like(kw), torch.zeros_like(vw)  # (B, Hkv, S, D), (B, Hkv, S, Dv)
        dsinks = None if sinks is None else torch.zeros(B, H, T, dtype=wide, device=q.device)  # (B, H, T)
        for (r0, r1), (c0, c1) in _blocks(spec, B, H, ctx.block_elements):
            t = r1 - r0
            p, th, share = _probs(qs[:, :, r0:r1], kw[:, :, c0:c1], spec, (r0, r1), (c0, c1), keep=True)  # (B, H, t, s) x2, (B, H, t)
            g_blk = _grouped(g[:, :, r0:r1], Hkv)  # (B, Hkv, G*t, Dv)
            dv[:, :, c0:c1] += _grouped(p, Hkv).transpose(-2, -1) @ g_blk  # (B, Hkv, s, Dv)
            if dsinks is not None:  # the sink's logit's gradient is -share * rowsum(dO * O)
                dsinks[:, :, r0:r1] = -share * delta[:, :, r0:r1, 0]
            ds = (g_blk @ vw[:, :, c0:c1].transpose(-2, -1)).view(B, H, t, c1 - c0)  # (B, H, t, s): dP
            ds.sub_(delta[:, :, r0:r1]).mul_(p)  # dS = P (dP - rowsum(dO O)) w.r.t. the capped logits
            ds.mul_(torch.addcmul(th.new_ones(()), th, th, value=-1.0))  # times 1 - tanh^2: w.r.t. scale * q.k
            ds = _grouped(ds, Hkv)  # (B, Hkv, G*t, s)
            dq[:, :, r0:r1] = (ds @ kw[:, :, c0:c1]).view(B, H, t, q.shape[3])  # (B, H, t, D)
            dk[:, :, c0:c1] += ds.transpose(-2, -1) @ _grouped(q[:, :, r0:r1].to(wide), Hkv)  # (B, Hkv, s, D)
        d_scaled = spec.scale  # d logit / d(q.k) = scale (1 - tanh^2)
        grads_sinks = None if dsinks is None else dsinks.sum((0, 2)).to(sinks.dtype)  # (H,)
        return (dq * d_scaled).to(q.dtype), (dk * d_scaled).to(k.dtype), dv.to(v.dtype), grads_sinks, None, None


def run(q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, block_elements: int) -> Tensor:
    """Softcapped attention (B, H, T, D) x (B, Hkv, S, D) -> (B, H, T, Dv), over blocks of about ``block_elements`` scores.

    Exact without dropout and without a bias that wants a gradient (``plan`` sends those to math).
    """
    return CappedAttention.apply(q, k, v, spec.sinks, spec, block_elements)  # (B, H, T, Dv)
