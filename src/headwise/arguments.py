"""The arguments of one attention call, every one checked before anything is written.

``checked`` returns what ``functional`` runs (``Arguments``: q, k and v, a cache's new tokens with their padded keys
and values zeroed, the call's ``Spec``, the cache, the backend); terms that number the keys are
checked against what the cache's ``sizes`` says each run will see. ``for_run``: a run's ``Spec``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from . import _checks
from . import cache as caches
from .backends.blocks import visible
from .backends.spec import Spec
from .cache import Cache, KVCache

BACKENDS = ("auto", "math", "sdpa")

# Other libraries' keywords for what ``attention`` names otherwise (torch's SDPA and nn.MultiheadAttention,
# flash-attn, transformers), and headwise's name for each: a call that uses one is told which.
OTHER_NAMES = {
    "is_causal": "causal (bottom-right aligned)",
    "attn_mask": "mask",
    "attn_bias": "mask (an additive float mask)",
    "key_padding_mask": "attention_mask (1/True = real token: torch's key_padding_mask marks padding with True)",
    "enable_gqa": "none: keys with fewer heads than the queries are grouped-query attention",
    "sliding_window": "window",
    "window_size": "window (with causal: the keys a query sees, itself included)",
    "softcapping": "softcap",
    "logit_softcapping": "softcap",
    "attn_logit_softcapping": "softcap",
    "softmax_scale": "scale",
    "s_aux": "sinks",
    "dropout": "dropout_p",
    "past_key_value": "cache",
    "past_key_values": "cache",
}


def known_keywords(function: str, given: Iterable[str], known: Iterable[str]) -> None:
    """Raise TypeError naming every keyword in ``given`` that ``function`` does not take (``known``),
    with headwise's name for another library's (``OTHER_NAMES``)."""
    other = [name for name in given if name not in known]
    if other:
        named = [f"{name!r} (headwise's: {OTHER_NAMES[name]})" if name in OTHER_NAMES else repr(name) for name in other]
        raise TypeError(f"{function}() got unexpected keyword argument(s) {', '.join(named)}; it takes {', '.join(known)}")


class Arguments(NamedTuple):
    q: Tensor  # (B, H, T, D)
    k: Tensor  # (B, Hkv, T_kv, D), padded keys zeroed where a cache takes them (``zero_padding``)
    v: Tensor  # (B, Hkv, T_kv, Dv), padded values zeroed where a cache takes them
    spec: Spec  # the call's terms; T and S, padding and documents are each run's (``for_run``)
    cache: Cache | None
    backend: str


def check_backend(backend: str) -> str:
    """Return ``backend`` if it names a backend, else raise ValueError (TypeError for a non-str) listing the valid ones."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be one of {list(BACKENDS)} (a str), got {type(backend).__name__} {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    return backend


def _tensor(name: str, t: object, ndim: int, dims: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {dims}, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have shape {dims} ({ndim} dims), got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    """q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv): floats of one dtype and device, Hkv dividing H."""
    _tensor("q", q, 4, "(B, H, T, D)")
    _tensor("k", k, 4, "(B, Hkv, S, D)")
    _tensor("v", v, 4, "(B, Hkv, S, Dv)")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a head size D >= 1, got q of shape {tuple(q.shape)}")
    names = "q and k" if v is k else "q, k and v"  # (attention_weights passes k as v)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{names} must share one dtype, got {q.dtype}, {k.dtype}" + ("" if v is k else f", {v.dtype}"))
    if not (q.device == k.device == v.device):
        raise ValueError(f"{names} must be on one device, got q on {q.device}, k on {k.device}" + ("" if v is k else f", v on {v.device}"))
    B, H, _, D = q.shape
    if k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"k must have shape (B={B}, Hkv, S, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have shape (B, Hkv, S, Dv) = {tuple(k.shape[:3])} + (Dv,) like k, got {tuple(v.shape)}")
    if k.shape[1] == 0:
        raise ValueError(f"k and v must have at least one head (Hkv >= 1), got k of shape {tuple(k.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"q's heads H={H} must be a multiple of k/v's heads Hkv={k.shape[1]}")


def _scale(value: float | None, d: int) -> float:
    if value is None:
        return 1.0 / math.sqrt(d)
    expected = "a positive finite number or None (1/sqrt(D))"
    value = _checks.real("scale", value, lambda: expected)
    if not 0 < value < math.inf:  # False for NaN (a comparison, not math.isinf: a symbolic float under compile too)
        raise ValueError(f"scale must be {expected}, got {value!r}")
    return float(value)


def _mask(value: object, device: torch.device, dtype: torch.dtype) -> Tensor | None:
    """The user's mask, its kind and values checked, as 4-D; its shape is checked per run of queries. A float mask is
    kept in the scores' dtype (float32 for half queries: ``dtype`` or wider; each runner narrows it where its kernel
    asks, a row's largest bias taken off first) and must hold no NaN and no value that overflows ``dtype`` upwards."""
    if value is None:
        return None
    if not isinstance(value, Tensor):
        raise TypeError(f"mask must be a torch.Tensor (bool or float), got {type(value).__name__}")
    _checks.same_device("mask", value, "q, k and v are", device)
    if value.ndim > 4:
        raise ValueError(f"mask must broadcast to (B, H, T, S), got shape {tuple(value.shape)}")
    value = value.view((1,) * (4 - value.ndim) + tuple(value.shape))  # (B?, H?, T?, S?)
    if value.dtype == torch.bool:
        return value
    if not value.is_floating_point():
        raise TypeError(f"mask must be bool (True = may attend) or an additive float mask, got dtype {value.dtype}")
    narrow = value.to(dtype)  # what a kernel in q's dtype reads: a value past its range is +inf there
    if _checks.has_values(value):  # one host read for a float mask (eager); an assert in the graph under torch.compile
        bad = lambda t: t.isnan() | (t == math.inf)  # noqa: E731
        _checks.holds(
            ~bad(narrow).any(), "mask (additive float) must hold finite numbers or -inf (= may not attend)",
            lambda: ", got NaN or +inf" if bad(value).any() else f", got a value above {torch.finfo(dtype).max:.4g}, past q's {dtype}",
        )
    wide = torch.promote_types(dtype, torch.float32)  # the scores' dtype
    return narrow if wide == dtype else value.to(wide)


def in_order(spec: Spec) -> bool:
    """ALiBi, documents and a mask read key positions: a sliding cache hands them its keys in time order."""
    return spec.documents is not None or spec.alibi is not None or spec.mask is not None


def sizes(cache: Cache | None, spec: Spec, t: int) -> list[tuple[slice, int]]:
    """``[(rows, S)]``: the S keys each run of queries will see once ``t`` new keys are written, before any write."""
    return [(slice(None), t)] if cache is None else cache.sizes(t, in_order=in_order(spec))


def for_run(spec: Spec, T: int, S: int, attention_mask: Tensor | None, cached: bool) -> tuple[Spec, int]:
    """The terms of T queries over the S keys handed to them with padding (B, S), and c0: the first key
    kept (a cache's keys before a causal window are dropped; the caller's own are all kept: its mask
    and documents number them). A window that covers every kept key is none."""
    if not cached:  # the call's own keys: its terms as given
        return (spec if spec.window is None or spec.window < S else dataclasses.replace(spec, window=None)), 0
    c0 = visible(T, S, spec.causal, spec.window, 0, T)[0]  # (the last query sees up to key S - 1)
    kept = S - c0
    documents = None if spec.documents is None else spec.documents[:, spec.documents.shape[1] - kept :]  # (B, kept)
    mask = spec.mask if spec.mask is None or spec.mask.shape[-1] == 1 else spec.mask[..., spec.mask.shape[-1] - kept :]  # (B?, H?, T?, kept)
    window = None if spec.window is not None and spec.window >= kept else spec.window
    padding = None if attention_mask is None else attention_mask[:, c0:]  # (B, kept)
    fields = (spec.causal, window, mask, padding, documents, spec.softcap, spec.sinks, spec.alibi, spec.dropout_p, spec.scale)
    return Spec(T, kept, *fields), c0  # built field by field: no dataclasses.replace (introspection) at every decode step


def zero_padding(t: Tensor, real: Tensor) -> Tensor:
    """(B, Hkv, S, D) keys or values with padded keys' rows (real (B, S) False) zeroed: a padded key gets
    weight 0, but 0 * NaN is NaN, which would reach every row through weights @ v (and q's gradient). Done to a
    cache's new tokens before their write (every later call reads them), and to a call's own keys for the runners
    that multiply a padded key's row by its zero weight (``functional.READ_NO_PADDING``: every one but the C++
    kernels, which read no padded key's row)."""
    return t.masked_fill(~real[:, None, :, None], 0.0)  # (B, Hkv, S, D)


def cache_takes(cache: Cache, computed: torch.dtype, window: int | None) -> None:
    """What ``checked`` asks of a cache beyond its own checks of the keys it takes: it may hold keys computed in
    ``computed`` (``_checks.cache_dtype``), and a sliding cache's window is the call's (``window``, as checked)."""
    _checks.cache_dtype("the cache", cache.dtype, computed, rows8=cache.stored == torch.int8)
    if cache.window is not None and cache.window != window:
        raise ValueError(f"a sliding cache of window={cache.window} needs attention with window={cache.window}, got window={window}")


def _farthest(cache: Cache | None, t: int, keys: int) -> int:
    """The farthest a query's position sits from a key's in this call: over ``keys`` positions with the T queries last
    (T may exceed them), or over each sequence of a paged batch."""
    if isinstance(cache, caches.PagedBatch):
        keys = max(start + n for start, n in zip(cache.starts, cache.new_tokens, strict=True))
    return torch.sym_max(keys, t) - 1  # (sym_max: sizes traced by torch.compile stay symbolic)


def checked(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: int | None, mask: Tensor | None, attention_mask: Tensor | None,
    documents: Tensor | None, softcap: float | None, sinks: Tensor | None, alibi_slopes: Tensor | None, cache: Cache | None,
    dropout_p: float, scale: float | None, backend: str,
) -> Arguments:
    """Every argument of ``headwise.attention`` checked, nothing written; see the module docstring."""
    qkv(q, k, v)
    B, H, T, D = q.shape
    _checks.boolean("causal", causal)
    window = _checks.window(window, causal)
    dropout_p = _checks.dropout("dropout_p", dropout_p)
    scale = _scale(scale, D)
    check_backend(backend)
    cache = caches.checked(cache)
    if cache is not None:
        cache_takes(cache, k.dtype, window)
    paged = cache is not None and not isinstance(cache, KVCache)
    if paged and documents is not None:
        raise ValueError(
            "documents number the tokens of one row of a KVCache; a paged batch packs several sequences, each its own "
            f"document already: pass documents=None, got a {type(cache).__name__}"
        )
    if paged and mask is not None:
        raise ValueError("mask cannot go with a paged batch (each sequence attends over its own keys): pass mask=None, with causal and window")
    if isinstance(cache, caches.PagedBatch) and sum(cache.new_tokens) != T:
        n = sum(cache.new_tokens)
        raise ValueError(f"a paged batch of {n} new tokens takes q of shape (1, H, T={n}, D) (its queries are the new tokens), got {tuple(q.shape)}")
    if isinstance(cache, KVCache) and cache.window is not None and k.shape[2] < T:
        raise ValueError(
            f"a sliding cache keeps only the keys its newest tokens see: q may hold at most the T_kv = {k.shape[2]} new tokens "
            f"of k and v, got T = {T} queries"
        )
    given = "(B, T_kv)" if cache is not None else "(B, S)"
    attention_mask = _checks.attention_mask(attention_mask, B, k.shape[2], given, device=("k and v are", k.device))
    held = len(cache) if isinstance(cache, KVCache) else 0
    keys = "(B, cached + T_kv)" if cache is not None else "(B, S)"
    documents = _checks.documents(documents, B, held + k.shape[2], keys, q.device)
    user_mask = _mask(mask, q.device, q.dtype)
    if user_mask is not None:  # numbered over every key, as documents are; each run takes the columns of the keys it sees
        _checks.broadcasts("mask", user_mask, (B, H, T, held + k.shape[2]), f"(B, H, T, {keys[4:-1]})", tuple(mask.shape))
    wide = q.dtype == torch.float64 and getattr(cache, "dtype", q.dtype) == torch.float64  # scores in float64, else float32
    scores = torch.float64 if wide else torch.float32
    info = torch.finfo(scores)
    if scale > info.max:  # finite as a float64, inf as the float32 the kernels multiply by
        raise ValueError(f"scale must be finite in {str(scores)[6:]}, the dtype the scores are computed in (at most "
                         f"{info.max:.4g}), got {scale!r}")
    if scale <= info.smallest_normal * info.eps / 2:  # 0 in float32 (half its least subnormal rounds to even: 0): 0 * -inf at a masked key is NaN
        raise ValueError(f"scale must be nonzero in {str(scores)[6:]}, the dtype the scores are computed in (at least "
                         f"{info.smallest_normal * info.eps:.4g}), got {scale!r}")
    spec = Spec(
        T=T, S=k.shape[2], causal=causal, window=window, mask=user_mask, attention_mask=attention_mask, documents=documents,
        softcap=_checks.softcap(softcap),
        sinks=_checks.per_head("sinks", sinks, B, H, q.device, batched=False, minus_inf="no sink on that head", scores=scores),
        alibi=_checks.per_head("alibi_slopes", alibi_slopes, B, H, q.device, batched=True, scores=scores,
                               distance=_farthest(cache, T, held + k.shape[2])), dropout_p=dropout_p,
        scale=scale,
    )
    runs = [] if documents is None else sizes(cache, spec, k.shape[2])
    for rows, S in runs:  # documents against the keys each run of queries will see
        run, _ = for_run(spec, T if rows == slice(None) else rows.stop - rows.start, S, None, cache is not None)  # (a symbolic T: no range)
        if run.T > run.S:
            raise ValueError(f"documents need T <= S (the queries are the last T keys' positions), got T={run.T} queries over S={run.S} keys")
    if attention_mask is not None and cache is not None:  # what a cache holds at a padded key must not reach a real row
        k, v = zero_padding(k, attention_mask), zero_padding(v, attention_mask)  # (B, Hkv, T_kv, D) x2
    return Arguments(q, k, v, spec, cache, backend)
