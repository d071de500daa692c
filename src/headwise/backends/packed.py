"""Packed documents: several documents in one row, each attended on its own.

The row is cut where the document id changes (``runs``: one host read of the (B, S) ids), and
each document's queries attend over its keys in a call of their own (``inner``, planned for that
document): memory and time follow sum(T_i * S_i) per head, never T * S, and no (T, S) mask.
Documents shorter than ``short`` keys that share a length are stacked into one batched call.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

from .spec import Spec

Runner = Callable[[Tensor, Tensor, Tensor, Spec], Tensor]


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


def run(q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, runs: list[list[tuple[int, int]]], inner: Runner, short: int) -> Tensor:
    """(B, H, T, D) x (B, Hkv, S, D) -> (B, H, T, Dv), ``inner`` run once per document of ``runs`` (or per group of short ones)."""
    B, H, T, _ = q.shape
    first = spec.S - spec.T  # position of the first query
    out = q.new_zeros(B, H, T, v.shape[3])  # (B, H, T, Dv)
    stacks: dict[tuple[int, int], list[tuple[int, int, int, int, int]]] = defaultdict(list)
    for b, row in enumerate(runs):
        for a, e in row:
            if e <= first:  # a document of cached keys only: no query of this call sits in it
                continue
            qa, qb = max(a, first) - first, e - first  # its queries are its last positions
            if e - a < short and spec.mask is None:
                stacks[(qb - qa, e - a)].append((b, qa, qb, a, e))
                continue
            document = spec.sliced(b, (qa, qb), (a, e))
            out[b : b + 1, :, qa:qb] = inner(q[b : b + 1, :, qa:qb], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e], document)
    for group in stacks.values():
        _stacked(q, k, v, spec, inner, group, out)
    return out


def _stacked(q: Tensor, k: Tensor, v: Tensor, spec: Spec, inner: Runner, group: list, out: Tensor) -> None:
    """Documents of one (queries, keys) size stacked into one call; their contexts written back into ``out``."""
    documents = [spec.sliced(b, (qa, qb), (a, e)) for b, qa, qb, a, e in group]
    qs = torch.cat([q[b : b + 1, :, qa:qb] for b, qa, qb, _, _ in group])  # (n, H, t, D)
    ks = torch.cat([k[b : b + 1, :, a:e] for b, _, _, a, e in group])  # (n, Hkv, s, D)
    vs = torch.cat([v[b : b + 1, :, a:e] for b, _, _, a, e in group])  # (n, Hkv, s, Dv)
    stack = dataclasses.replace(
        documents[0], attention_mask=_stack([d.attention_mask for d in documents]), alibi=_stack([d.alibi for d in documents])
    )
    ctx = inner(qs, ks, vs, stack)  # (n, H, t, Dv)
    for i, (b, qa, qb, _, _) in enumerate(group):
        out[b, :, qa:qb] = ctx[i]


def _stack(ts: list[Tensor | None]) -> Tensor | None:
    """The documents' (1, ...) tensors as one (n, ...); one shared tensor stays as it is."""
    if ts[0] is None or all(t is ts[0] for t in ts):
        return ts[0]
    return torch.cat(ts)  # (n, ...)
