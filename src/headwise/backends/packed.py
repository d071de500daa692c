"""Packed documents: several documents in one row, each attended on its own.

A dense document mask would cost a (T, S) mask per row and push the fused kernel off its
fast path. Instead the row is cut where the document id changes, and each document's
queries attend over its keys in one kernel call of their own: memory and time follow
sum(T_i * S_i) per head, never T * S. Documents shorter than ``SHORT`` keys that share a
length are stacked into one batched call (their call overhead would dominate otherwise).

The cut needs the documents' lengths on the host: one read of the (B, S) ids per call.
That is fine in eager mode; under ``torch.compile`` (no host reads in a graph) and for ids
that do not form contiguous runs, ``can_split`` says no and the caller folds the documents
into a dense mask instead.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

from .spec import Spec

#: Documents with fewer keys than this are batched with others of the same length.
SHORT = 128

Runner = Callable[[Tensor, Tensor, Tensor, Spec], Tensor]


def can_split(spec: Spec) -> bool:
    """Whether the documents can be cut into runs: not while tracing (the cut reads the ids on the host)."""
    return not torch.compiler.is_compiling()


def runs(documents: Tensor) -> list[list[tuple[int, int]]] | None:
    """Per row, the (start, end) key ranges of its documents; None if an id comes back after another one."""
    ids = documents.cpu()  # (B, S): the one host read
    out = []
    for row in ids:
        if row.numel() == 0:  # no keys: no documents
            out.append([])
            continue
        change = (torch.nonzero(row[1:] != row[:-1]).flatten() + 1).tolist()
        starts, ends = [0, *change], [*change, row.numel()]
        if len(set(row[starts].tolist())) != len(starts):
            return None
        out.append(list(zip(starts, ends, strict=True)))
    return out


def run(q: Tensor, k: Tensor, v: Tensor, spec: Spec, inner: Runner) -> Tensor:
    """(B, H, T, D) x (B, Hkv, S, D) -> (B, H, T, Dv), ``inner`` run once per document (or group of short ones)."""
    found = runs(spec.documents)
    if found is None:  # ids that are not contiguous runs: the dense document mask says it
        return inner(q, k, v, spec)
    B, H, T, _ = q.shape
    off = spec.S - spec.T  # position of the first query
    out = q.new_zeros(B, H, T, v.shape[3])  # (B, H, T, Dv)
    short: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = defaultdict(list)
    for b, row in enumerate(found):
        for a, e in row:
            if e <= off:  # a document of cached keys only: no query of this call sits in it
                continue
            qa, qb = max(a, off) - off, e - off  # its queries are its last positions
            if e - a < SHORT and spec.mask is None:
                short[(qb - qa, e - a)].append((b, qa, qb, a, e))
                continue
            piece = spec.piece(b, (qa, qb), (a, e))
            out[b : b + 1, :, qa:qb] = inner(q[b : b + 1, :, qa:qb], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e], piece)
    for group in short.values():
        _batched(q, k, v, spec, inner, group, out)
    return out


def _batched(q: Tensor, k: Tensor, v: Tensor, spec: Spec, inner: Runner, group: list, out: Tensor) -> None:
    """Documents of one (queries, keys) size stacked into one call; their contexts written back into ``out``."""
    pieces = [spec.piece(b, (qa, qb), (a, e)) for b, qa, qb, a, e in group]
    qs = torch.cat([q[b : b + 1, :, qa:qb] for b, qa, qb, _, _ in group])  # (n, H, t, D)
    ks = torch.cat([k[b : b + 1, :, a:e] for b, _, _, a, e in group])  # (n, Hkv, s, D)
    vs = torch.cat([v[b : b + 1, :, a:e] for b, _, _, a, e in group])  # (n, Hkv, s, Dv)
    first = pieces[0]
    batch = dataclasses.replace(
        first, attention_mask=_stack([p.attention_mask for p in pieces]), alibi=_stack([p.alibi for p in pieces])
    )
    ctx = inner(qs, ks, vs, batch)  # (n, H, t, Dv)
    for i, (b, qa, qb, _, _) in enumerate(group):
        out[b, :, qa:qb] = ctx[i]


def _stack(ts: list[Tensor | None]) -> Tensor | None:
    """The pieces' (1, ...) tensors as one (n, ...); one shared tensor stays as it is."""
    if ts[0] is None or all(t is ts[0] for t in ts):
        return ts[0]
    return torch.cat(ts)  # (n, ...)
