"""Match recorded tensors to the reference's steps, by their numbers.

A recorded tensor stands for a step when it has the step's numbers in the step's layout, or
in an equivalent one: the same numbers read in order under another shape (``(B*H, T, D)``
for ``(B, H, T, D)``, a ``view`` that was never taken) or with heads and tokens swapped
(``(B, T, H, D)`` for ``(B, H, T, D)``, as einsum code often keeps them). Scores count at
any positive scale (before or after dividing by sqrt(head_dim)), and a "minus infinity" of
-1e9 counts as -inf.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

from .hints import Probe

RTOL, ATOL = 1e-4, 1e-5  # float32 learner vs float64 reference; every known mistake is far outside


def same(got: Tensor, want: Tensor, scale_free: bool = False) -> bool:
    """True when ``got`` (already in ``want``'s shape) equals ``want``, or a positive multiple of it if ``scale_free``."""
    got = _minus_inf(got.double())
    if scale_free:
        want = want * _fit(got, want)
    return bool(torch.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True))


def layouts(got: Tensor, shape: torch.Size) -> Iterator[Tensor]:
    """``got`` read in ``shape``: in order, and for 4-D steps with dims 1 and 2 swapped."""
    n = math.prod(shape)
    if got.numel() == n:
        yield got.reshape(shape)
        if got.ndim == 4 and len(shape) == 4:
            yield got.transpose(1, 2).reshape(shape)


def produced(records: list[Tensor], want: Tensor, scale_free: bool = False) -> bool:
    """True when some record, in some equivalent layout, equals ``want``."""
    return any(same(v, want, scale_free) for r in records for v in layouts(r, want.shape))


def step_status(records: list[Tensor], steps: dict[str, Tensor]) -> dict[str, str]:
    """Each step (in the book's order): ``"match"`` when some record equals it, ``"skipped"`` when
    not but a later step of its chain was produced (code that never forms ``queries.view`` but
    forms ``queries.transpose``, or fuses QKV, has not diverged there), else ``"missing"``.

    A record read in another layout does not stand for a step where the learner formed the step's own
    shape by reading the step before it in order (``misread``): the (b, num_tokens, num_heads, head_dim)
    view reshaped to the transpose's shape instead of transposed, which the view itself, read with its
    dims swapped, must not excuse."""
    done = {name: produced(records, t, scale_free=is_scores(name)) if not misread(records, steps, name)
            else any(r.shape == t.shape and same(r, t, is_scores(name)) for r in records) for name, t in steps.items()}
    skipped = {name: any(done[later] for later in _chain_after(name, list(steps))) for name in steps}
    return {name: "match" if done[name] else "skipped" if skipped[name] else "missing" for name in steps}


def misread(records: list[Tensor], steps: dict[str, Tensor], name: str) -> bool:
    """Whether a record in step ``name``'s shape holds, in order, the numbers of the step before it in its chain (and
    not the step's own): that step's tensor reshaped where the book transposes it."""
    order = list(steps)
    before = [p for p in order[: order.index(name)] if _chain(p) == _chain(name)]
    want = steps[name]
    if not before or steps[before[-1]].numel() != want.numel():
        return False
    read = steps[before[-1]].reshape(want.shape)  # the step before, its numbers in order, in this step's shape
    return any(r.shape == want.shape and same(r, read) and not same(r, want, is_scores(name)) for r in records)


def attempt(records: list[Tensor], steps: dict[str, Tensor], name: str) -> Tensor | None:
    """The learner's try at step ``name``: the first record in its shape after the last record that equals an earlier
    step (the weights of a learner whose scores are off come later, and are not shown as the scores), and that equals
    no other step (a learner's right keys, made before the queries, are not their queries); None if none."""
    order = list(steps)
    earlier = [(p, steps[p]) for p in order[: order.index(name)]]
    last = max((i for i, r in enumerate(records) if any(r.shape == t.shape and same(r, t, is_scores(p)) for p, t in earlier)), default=-1)
    want, others = steps[name], [(p, t) for p, t in steps.items() if p != name and t.shape == steps[name].shape]
    return next((r for r in records[last + 1 :] if r.shape == want.shape and not any(same(r, t, is_scores(p)) for p, t in others)), None)


def first_divergence(records: list[Tensor], steps: dict[str, Tensor]) -> str | None:
    """The first step (in the book's order) that no record equals and no later step excuses, or None."""
    return next((name for name, status in step_status(records, steps).items() if status == "missing"), None)


def closest(records: list[Tensor], want: Tensor, scale_free: bool = False) -> Tensor | None:
    """The record, read in ``want``'s shape, with the fewest numbers that differ; None if none has as many numbers."""
    best, best_err = None, math.inf
    for r in records:
        for v in layouts(r, want.shape):
            v = _minus_inf(v.double())
            target = want * _fit(v, want) if scale_free else want
            err = float((~torch.isclose(v, target, rtol=RTOL, atol=ATOL, equal_nan=True)).double().mean())
            if err <= best_err:
                best, best_err = v, err
    return best


def matching_probes(records: list[Tensor], out: object, probes: list[Probe], step: str) -> list[tuple[Probe, Tensor]]:
    """The probes for ``step`` that some record (or, for ``returned`` probes, the output) equals in the probe's
    shape (or with dims 1 and 2 swapped), each with the record as it matched."""
    found = []
    for p in probes:
        if p.step != step:
            continue
        pool = ([out] if isinstance(out, Tensor) else []) if p.returned else records
        matches = [next((v for v in _views(r) if v.shape == p.tensor.shape and same(v, p.tensor, p.scale_free)), None) for r in pool]
        matches = [v for v in matches if v is not None]  # (B, T, ...) each: at most one view of each record
        if len(matches) >= (2 if p.twice else 1):  # a tensor made twice: the right one's record alone is not the mistake
            found.append((p, matches[0]))
    return found


def _views(r: Tensor) -> tuple[Tensor, ...]:
    """A record as it is and, for a 4-dim one, with dims 1 and 2 swapped."""
    return (r, r.transpose(1, 2)) if r.ndim == 4 else (r,)


def is_scores(step: str) -> bool:
    """Raw scores are matched at any positive scale: the book scales them inside the softmax."""
    return step.endswith("scores")


def _chain_after(name: str, order: list[str]) -> list[str]:
    """The later steps computed from this one alone: ``queries`` -> ``queries.view`` -> ``queries.transpose``;
    ``scores`` -> ... -> ``output``; each head of the wrapper has its own chains."""
    key = _chain(name)
    return [later for later in order[order.index(name) + 1 :] if _chain(later) == key]


def _chain(name: str) -> tuple[str, str]:
    parts = name.split(".")
    prefix, rest = (parts[:2], parts[2:]) if parts[0] == "heads" else ([], parts)
    return ".".join(prefix), rest[0] if rest[0] in ("queries", "keys", "values") else "attention"


def _minus_inf(t: Tensor) -> Tensor:
    return t.masked_fill(t <= -1e8, -math.inf)  # -1e9, finfo.min...: a mask's "minus infinity"


def _fit(got: Tensor, want: Tensor) -> float:
    """The positive factor c that makes c * want closest to got (1.0 when there is none)."""
    finite = torch.isfinite(want) & torch.isfinite(got)
    w, g = want[finite], got[finite]
    denom = float((w * w).sum())
    c = float((g * w).sum()) / denom if denom > 0 else 1.0
    return c if c > 0 else 1.0
