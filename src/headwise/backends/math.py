"""The "math" backend: the scores written out, every term applied to them; the reference for all.

``run`` computes the whole (B, H, T, S) score tensor and reports each step to an observer;
``run_chunked`` is the same arithmetic over blocks of queries, each against only the keys it
may see. Per score: q.k -> * scale -> softcap -> + ALiBi bias + additive mask -> masks (-inf)
-> softmax over the keys and the sink -> dropout -> @ v; half inputs get float32 logits and
softmax. A row that may see no key gets zero weights (finite logits, then zeroed by ``where``,
never by asking the device whether such a row exists).

``float32_keys`` (the plan's choice for decode-shaped half inputs on the CPU) runs both matmuls
in float32, keys and values converted that many elements at a time: oneDNN's half matmul builds
a kernel for every new key count, float32 GEMM has no per-shape setup.

``summed`` (the plan's choice for a decode step under ``torch.compile`` on the CPU) writes both
products out as broadcast multiplies and sums in float32 (or wider), no matmul: inductor fuses
each into a loop that reads every key and value once, in its own dtype, and leaves no pattern
for its attention rewrites to turn back into a kernel call. Eager, the same code writes the
(B, Hkv, G*T, S, D) products out: it is for compiled graphs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .._checks import compiling, transformed
from ..observe import report
from ..scores import softcap
from .blocks import joined, query_blocks, rows_per_block
from .spec import Spec, mask_block

_HALF = (torch.float16, torch.bfloat16)


def _key_blocks(x: Tensor, elements: int) -> list[tuple[int, int]]:
    """Key ranges of (B, Hkv, S, D) ``x`` whose float32 copies hold about ``elements`` each; one under compile."""
    B, Hkv, S, D = x.shape
    step = max(1, elements // max(1, B * Hkv * D))
    if compiling() or step >= S:  # a compiled graph keeps S symbolic: no loop over it
        return [(0, S)]
    return [(c, min(S, c + step)) for c in range(0, S, step)]


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype ``summed`` products are summed in: float32 for half types, else the inputs' own."""
    return torch.float32 if dtype in _HALF else dtype


def realized(x: Tensor) -> Tensor:
    """``x`` contiguous, computed into a buffer of its own where inductor compiles the graph (eager: ``x.contiguous()``).

    A loop that reads a not yet computed tensor recomputes it at every read: the query of a
    ``summed`` score, rotated by RoPE in the graph, would be rotated again for every key.
    Inductor's own prim (``inductor_force_stride_order``, registered once inductor is imported,
    as ``torch.compile`` does) makes it a buffer; other backends run it as a copy where the strides differ.
    """
    x = x.contiguous()  # the strides asked for: the ones the traced and the running tensor share
    if compiling() and hasattr(torch.ops.prims, "inductor_force_stride_order"):
        return torch.ops.prims.inductor_force_stride_order(x, x.stride())
    return x


def scores(q: Tensor, k: Tensor, float32_keys: int | None = None, summed: bool = False) -> Tensor:
    """Raw scores q·k for every head; query head h uses key head h // (H // Hkv).

    (B, H, T, D) x (B, Hkv, S, D) -> (B, H, T, S), in q's dtype but float32 for half inputs: float16's
    range a product of two moderate vectors overflows before any scale, and a bfloat16 score rounded
    before the scale moves its logit by up to scale * |score| * 2**-9; float32 with ``float32_keys``
    (keys converted that many elements at a time); with ``summed``, products and a sum over D in
    float32 (or wider), for a compiled graph (the module docstring).
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    # each group's query heads stacked as rows of one matrix: k is read in place. (A broadcast
    # over a group dim, q.view(B, Hkv, G, T, D) @ k.unsqueeze(2), makes matmul copy k G times.)
    q = q.reshape(B, Hkv, (H // Hkv) * T, D)  # (B, Hkv, G*T, D): a copy of q only when G > 1
    if summed:
        wide = _wide(q.dtype)
        rows = realized(q).to(wide).unsqueeze(3)  # (B, Hkv, G*T, 1, D): q computed once, not once per key
        return (rows * k.to(wide).unsqueeze(2)).sum(-1).view(B, H, T, S)  # (B, Hkv, G*T, S, D) summed -> (B, H, T, S)
    if float32_keys is None and q.dtype in _HALF:
        float32_keys = max(1, k.numel())  # every key at once
    if float32_keys is not None:
        q = q.float()
        parts = [q @ k[:, :, c0:c1].float().transpose(-2, -1) for c0, c1 in _key_blocks(k, float32_keys)]  # (B, Hkv, G*T, s) each
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # (B, Hkv, G*T, S) float32
    else:
        out = q @ k.transpose(-2, -1)  # (B, Hkv, G*T, S)
    return out.view(B, H, T, S)  # (B, H, T, S)


def weights(
    q: Tensor, k: Tensor, spec: Spec, rows: tuple[int, int], cols: tuple[int, int], *, steps: bool = True,
    float32_keys: int | None = None, summed: bool = False,
) -> Tensor:
    """Softmax weights of queries ``rows`` (q holds just them) over keys ``cols`` (k holds just them).

    ``steps`` reports each step to an observer; ``float32_keys``, ``summed``: see ``scores``.
    Returns (B, H, t, s), float32 for half inputs; rows sum to 1 minus the sink's share, or
    are all zeros for a query that may see no key.
    """
    record = report if steps else _silent
    # no graph to keep: rewrite one buffer instead of allocating one per step (a torch.func transform takes no out=)
    inplace = not steps and not _needs_grad(q, k, spec) and not transformed(q, k, *spec.tensors)
    raw = scores(q, k, float32_keys, summed)  # (B, H, t, s)
    record("scores", raw)
    edge = seen_by_all(spec, rows, cols) if inplace else 0  # keys before it are visible to every row: nothing to mask there
    allowed = spec.allowed(rows, (cols[0] + edge, cols[1]), q.device)  # (B?, H?, t, s - edge) bool or None
    wide = q.dtype in _HALF and (spec.changes_scores or spec.sinks is not None)  # float32 logits for the extra terms
    if spec.softcap is None:
        if allowed is not None:
            raw = masked(raw, allowed, edge, inplace)  # (B, H, t, s)
            record("masked_scores", raw)
        logits = raw.float() if wide else raw
        logits = logits.mul_(spec.scale) if inplace else logits * spec.scale  # (B, H, t, s)
    else:
        logits = raw.float() if wide else raw
        if inplace:
            logits = logits.mul_(spec.scale / spec.softcap).tanh_().mul_(spec.softcap)  # (B, H, t, s)
        else:
            logits = softcap(logits * spec.scale, spec.softcap)  # (B, H, t, s)
        record("capped_scores", logits)
        if allowed is not None:
            logits = masked(logits, allowed, edge, inplace)  # (B, H, t, s)
            record("masked_scores", logits)
    bias = spec.bias(rows, cols, q.device, q.dtype)  # (B?, H?, t, s) or None
    if steps and spec.alibi is not None:  # ALiBi's own part, for a learner (the bias may also hold an additive mask)
        record("alibi_bias", dataclasses.replace(spec, mask=None).bias(rows, cols, q.device, q.dtype))  # (B?, H, t, s)
    if bias is not None:  # softmax(q k^T * scale + bias): a bias is not scaled
        logits = logits.add_(bias.to(logits.dtype)) if inplace else logits + bias.to(logits.dtype)
    half = torch.float32 if q.dtype in _HALF else None
    w, share = softmax(logits, spec, allowed, edge, rows, cols, dtype=half, inplace=inplace)  # (B, H, t, s), (B, H, t) or None
    if share is not None:
        record("sink_share", share)  # (B, H, t): each row's mass the sink took
    record("weights", w)
    return w


def softmax(
    logits: Tensor, spec: Spec, allowed: Tensor | None, edge: int, rows: tuple[int, int], cols: tuple[int, int], *,
    dtype: torch.dtype | None, inplace: bool,
) -> tuple[Tensor, Tensor | None]:
    """Softmax of (B, H, t, s) masked ``logits`` over the keys and the sink (in ``dtype``), rows that see no key zeroed.

    Returns the weights (B, H, t, s) and, with sinks, the sink's share of each row (B, H, t), read from the
    softmax itself (``1 - sum`` of the weights cancels where the share is small); a row that sees no key gives it all.
    ``allowed`` masks keys ``edge`` onwards (``seen_by_all``); ``inplace`` rewrites ``logits`` where nothing keeps them.
    """
    live = None if edge else rows_seeing_keys(spec, allowed, rows, cols)  # (B?, H?, t, 1) or None; with an edge every row sees a key
    if live is not None:  # a row of -inf would give 0/0 (a sink of -inf too): finite logits, then zero weights
        logits = logits.masked_fill_(~live, 0.0) if inplace else logits.masked_fill(~live, 0.0)
    if spec.sinks is not None:  # the sink joins each row's softmax and is dropped after: no value behind it
        B, H, t, _ = logits.shape
        sink = spec.sinks.to(logits.dtype)[None, :, None, None].expand(B, H, t, 1)  # (B, H, t, 1)
        full = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1, dtype=dtype)  # (B, H, t, s + 1)
        w, share = full[..., :-1], full[..., -1]  # (B, H, t, s), (B, H, t)
    else:
        out = logits if inplace and (dtype is None or logits.dtype == dtype) else None  # in place where nothing keeps the logits
        w = torch.softmax(logits, dim=-1, dtype=dtype, out=out) if out is not None else torch.softmax(logits, dim=-1, dtype=dtype)
        share = None
    if live is not None:
        w = w.masked_fill_(~live, 0.0) if inplace else w.masked_fill(~live, 0.0)
        share = None if share is None else share.masked_fill(~live[..., 0], 1.0)  # (B, H, t)
    return w, share


def masked(x: Tensor, allowed: Tensor, edge: int, inplace: bool) -> Tensor:
    """(B, H, t, s) ``x`` with -inf where ``allowed`` (of keys ``edge`` onwards) is False; in place when nothing keeps x."""
    if inplace:
        x[..., edge:].masked_fill_(~allowed, -math.inf)
        return x
    return x.masked_fill(~allowed, -math.inf)


def seen_by_all(spec: Spec, rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """With causal the only restriction: how many of the keys ``cols``, from c0 on, every query of ``rows`` sees (none masked there)."""
    if not spec.causal or spec.window is not None or spec.mask is not None or spec.attention_mask is not None or spec.documents is not None:
        return 0
    first_query = spec.S - spec.T + rows[0]  # its position: keys up to it are visible to every later query too
    return max(0, min(cols[1], first_query + 1) - cols[0])


def _needs_grad(q: Tensor, k: Tensor, spec: Spec) -> bool:
    """Whether autograd records this block (then every step keeps its own tensor)."""
    if not torch.is_grad_enabled():
        return False
    return any(t is not None and t.requires_grad for t in (q, k, spec.sinks, spec.alibi, spec.mask))


def rows_seeing_keys(spec: Spec, allowed: Tensor | None, rows: tuple[int, int], cols: tuple[int, int]) -> Tensor | None:
    """(B?, H?, t, 1) bool: rows that see at least one key; None when every row does, known without looking."""
    user_bias = spec.mask is not None and spec.mask.dtype != torch.bool
    if not user_bias and allowed is None:
        return None
    only_causal = spec.mask is None and spec.attention_mask is None and spec.documents is None
    if only_causal and spec.T <= spec.S:  # bottom-right causal: every query sees at least itself
        return None
    live = allowed
    if user_bias:
        finite = mask_block(spec.mask, rows, cols) > -math.inf  # (B?, H?, t, s)
        live = finite if live is None else live & finite
    return live.any(-1, keepdim=True)


def context(w: Tensor, v: Tensor, dropout_p: float, float32_keys: int | None = None, summed: bool = False,
            record: Callable[[str, Tensor], None] | None = None) -> Tensor:
    """(B, H, t, s) weights @ (B, Hkv, s, Dv) values -> (B, H, t, Dv), v never repeated.

    v is read in place, or with ``float32_keys`` (and no dropout) converted to float32 that many
    elements at a time, the weights kept float32; with ``summed`` (no dropout), products and a sum
    over the keys in float32 (or wider), for a compiled graph (the module docstring).
    """
    B, H, t, s = w.shape
    Hkv, Dv = v.shape[1], v.shape[3]
    if summed:
        wide = _wide(v.dtype)
        w = w.to(wide).reshape(B, Hkv, (H // Hkv) * t, s, 1)  # (B, Hkv, G*t, s, 1)
        out = (w * v.to(wide).unsqueeze(2)).sum(-2)  # (B, Hkv, G*t, s, Dv) summed -> (B, Hkv, G*t, Dv)
        return out.to(v.dtype).view(B, H, t, Dv)  # (B, H, t, Dv)
    if dropout_p == 0.0 and float32_keys is not None:
        w = w.float().reshape(B, Hkv, (H // Hkv) * t, s)  # (B, Hkv, G*t, s)
        out = None
        for c0, c1 in _key_blocks(v, float32_keys):
            part = w[..., c0:c1] @ v[:, :, c0:c1].float()  # (B, Hkv, G*t, Dv) float32
            out = part if out is None else out.add_(part)
        return out.to(v.dtype).view(B, H, t, Dv)  # (B, H, t, Dv)
    w = w.to(v.dtype)
    if dropout_p > 0.0:
        w = F.dropout(w, dropout_p)
        if record is not None:
            record("dropped_weights", w)  # (B, H, t, s): what multiplies the values in training
    w = w.reshape(B, Hkv, (H // Hkv) * t, s)  # (B, Hkv, G*t, s): each group's rows, as in scores
    return (w @ v).view(B, H, t, Dv)  # (B, H, t, Dv)


def run(q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, float32_keys: int | None = None) -> Tensor:
    """Every score at once, each step reported: (B, H, T, D) x (B, Hkv, S, D) -> (B, H, T, Dv)."""
    w = weights(q, k, spec, (0, spec.T), (0, spec.S), float32_keys=float32_keys)  # (B, H, T, S)
    return context(w, v, spec.dropout_p, float32_keys, record=report)  # (B, H, T, Dv)


def run_chunked(
    q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, block_elements: int, float32_keys: int | None = None, summed: bool = False
) -> Tensor:
    """``run`` over blocks of queries of about ``block_elements`` scores, each against only the keys it may see; nothing reported.
    ``float32_keys``, ``summed``: see ``scores`` (``summed`` takes no dropout).

    Memory holds one block's scores at a time in a forward without gradients; with autograd
    each block keeps its weights for the backward.
    """
    B, H = q.shape[:2]
    if q.dtype in _HALF and float32_keys is None and not summed:
        k = k.float()  # (B, Hkv, S, D): scores take float32 keys (``scores``); converted once, not once a block
    contexts = []
    for (r0, r1), (c0, c1) in query_blocks(spec, rows_per_block(spec.T, B * H * spec.S, block_elements)):
        w = weights(q[:, :, r0:r1], k[:, :, c0:c1], spec, (r0, r1), (c0, c1), steps=False, float32_keys=float32_keys, summed=summed)  # (B, H, t, s)
        contexts.append(context(w, v[:, :, c0:c1], spec.dropout_p, float32_keys, summed))  # (B, H, t, Dv)
    return joined(contexts)  # (B, H, T, Dv)


def _silent(name: str, tensor: Tensor) -> None:
    pass
