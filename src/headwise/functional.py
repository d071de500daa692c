"""The functional core: every headwise module computes attention here, and only here.

Shape glossary (the same letters in every docstring and shape comment of the package):
    B    batch size                 T    query tokens
    H    query heads                S    key/value tokens
    Hkv  key/value heads (H % Hkv == 0; Hkv < H is grouped-query attention)
    D    head size                  C    model width, H * D

Masks are boolean with True = "may attend" (torch SDPA's convention), or additive floats
(0 = attend, -inf = not). ``attention_mask`` is a (B, S) padding mask with HuggingFace's
meaning: 1/True = real token, 0/False = padding (bools or 0/1 ints).
Causal attention is aligned bottom-right: with T queries over S keys, query i sees keys
``j <= i + S - T`` (see ``headwise.masks``). A query that can see no key gets zero weights
and a zero context, never NaN, in forward and backward, in every backend.

The variants compose with all of that: ``softcap`` (Gemma 2), ``sinks`` (gpt-oss),
``alibi_slopes`` (BLOOM, MPT) and ``documents`` (packed rows). This module checks the
arguments, reads the cache and hands one ``backends.spec.Spec`` (every term, unfolded) to a
backend: plain functions ``fn(q, k, v, spec)`` in ``BACKENDS``, chosen in ``_choose``:
    "math"  explicit QK^T, scale, softcap, bias, mask, softmax (float32 for half inputs),
            dropout, AV; the reference for every term, and the one that reports its steps
            to an observer (``headwise.observe``).
    "sdpa"  torch's fused kernels, ``is_causal`` instead of a mask whenever it means the
            same, native GQA; sinks through the kernel's log-sum-exp, ALiBi as a per-block
            bias, softcap over blocks of queries (``backends.softcap``), packed documents one kernel
            call per document (``headwise.backends``).
    "auto"  "sdpa", or "math" while someone observes, and "math" (blocks of queries) for
            one bfloat16 query per row on the CPU, a decode step: there torch's fused CPU
            kernel runs 5-17x slower than two matmuls (128-2048 keys, torch 2.13).

``attention`` is the one entry: with a ``KVCache`` it first appends the new keys and values
to the cache, then attends over everything the cache holds (trimmed to what a sliding window
can still see).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from . import _checks
from .backends import math as math_backend
from .backends import packed as packed_backend
from .backends import sdpa as sdpa_backend
from .backends.spec import Spec
from .cache import Cache, KVCache, Part, checked
from .observe import observing, report

# ----------------------------------------------------------------------------- checks


def _check_tensor(name: str, t: object, ndim: int, dims: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {dims}, got {type(t).__name__}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must have shape {dims} ({ndim} dims), got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    return t


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    _check_tensor("q", q, 4, "(B, H, T, D)")
    _check_tensor("k", k, 4, "(B, Hkv, S, D)")
    _check_tensor("v", v, 4, "(B, Hkv, S, Dv)")
    if q.shape[-1] == 0:
        raise ValueError(f"q and k must have a head size D >= 1, got q of shape {tuple(q.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got q on {q.device}, k on {k.device}, v on {v.device}")
    B, H, _, D = q.shape
    if k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"k must have shape (B={B}, Hkv, S, D={D}) to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must have shape (B, Hkv, S, Dv) = {tuple(k.shape[:3])} + (Dv,) like k, got {tuple(v.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"q's heads H={H} must be a multiple of k/v's heads Hkv={k.shape[1]}")


def _check_scale(scale: float | None, d: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0 or math.isinf(scale):
        raise ValueError(f"scale must be a positive finite number or None (1/sqrt(D)), got {scale!r}")
    return float(scale)


def _check_mask(mask: object, q: Tensor, S: int) -> Tensor | None:
    """The user's mask, checked, as a 4-D tensor broadcastable to (B, H, T, S) (floats in q's dtype)."""
    if mask is None:
        return None
    B, H, T, _ = q.shape
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor (bool or float), got {type(mask).__name__}")
    _checks.same_device("mask", mask, "q, k and v are", q.device)
    try:
        ok = torch.broadcast_shapes(mask.shape, (B, H, T, S)) == (B, H, T, S)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"mask must broadcast to (B, H, T, S) = {(B, H, T, S)}, got shape {tuple(mask.shape)}")
    mask = mask.view((1,) * (4 - mask.ndim) + tuple(mask.shape))  # (B?, H?, T?, S?)
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = may attend) or an additive float mask, got dtype {mask.dtype}")
    if _checks.has_values(mask):  # one host read for a float mask (eager); an assert in the graph under torch.compile
        _checks.holds(
            ~(mask.isnan() | (mask == math.inf)).any(), "mask (additive float) must hold finite numbers or -inf (= may not attend)",
            lambda: ", got NaN or +inf",
        )
    return mask.to(q.dtype)


def _spec(
    q: Tensor, S: int, *, causal: bool, window: int | None, mask: Tensor | None, attention_mask: Tensor | None,
    documents: Tensor | None, softcap: float | None, sinks: Tensor | None, alibi_slopes: Tensor | None,
    dropout_p: float, scale: float,
) -> Spec:
    """Every term of T queries over S keys, checked (attention_mask already is), unfolded: see ``backends.spec``."""
    B, H, T, _ = q.shape
    if _checks.window(window, causal) is not None and window >= S:
        window = None  # the last query sits at S-1 and sees keys > S-1-window: every key, so no window at all
    if documents is not None and T > S:
        raise ValueError(f"documents need T <= S (the queries are the last T keys' positions), got T={T} queries over S={S} keys")
    return Spec(
        T=T, S=S, causal=causal, window=window, mask=_check_mask(mask, q, S), attention_mask=attention_mask,
        documents=documents, softcap=_checks.softcap(softcap),
        sinks=_checks.per_head("sinks", sinks, B, H, q.device, batched=False, minus_inf="no sink on that head"),
        alibi=_checks.per_head("alibi_slopes", alibi_slopes, B, H, q.device, batched=True),
        dropout_p=dropout_p, scale=scale,
    )


# ----------------------------------------------------------------------------- backends


Backend = Callable[[Tensor, Tensor, Tensor, Spec], Tensor]


def _math(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """"math": every score written out; packed documents one at a time (scores of a document's size) unless observed."""
    if spec.documents is not None and not observing() and packed_backend.can_split(spec):
        return packed_backend.run(q, k, v, spec, math_backend.run)  # (B, H, T, Dv)
    return math_backend.run(q, k, v, spec)  # (B, H, T, Dv)


BACKENDS: dict[str, Backend] = {"math": _math, "sdpa": sdpa_backend.run}


def _auto(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """"auto" when nobody observes: SDPA, except for one bfloat16 query per row on the CPU (a decode
    step), where torch's fused kernel is 5-17x slower than the math's two matmuls (128-2048 keys)."""
    if q.dtype == torch.bfloat16 and q.device.type == "cpu" and spec.T == 1:
        return math_backend.run_chunked(q, k, v, spec)  # (B, H, 1, Dv)
    return sdpa_backend.run(q, k, v, spec)  # (B, H, T, Dv)


def _choose(backend: str) -> Backend:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be one of {['auto', *BACKENDS]} (a str), got {type(backend).__name__} {backend!r}")
    if backend == "auto":
        return math_backend.run if observing() else _auto
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {['auto', *BACKENDS]}, got {backend!r}")
    return BACKENDS[backend]


def check_backend(backend: str) -> str:
    """Return ``backend`` if it names a backend, else raise ValueError (TypeError for a non-str) listing the valid ones."""
    _choose(backend)
    return backend


# ----------------------------------------------------------------------------- public


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    documents: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    cache: Cache | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Scaled dot-product attention over heads: ``softmax(q k^T * scale + mask) v``, and its variants.

    Each score is ``q·k * scale``, then ``softcap * tanh(. / softcap)``, then ``+ ALiBi``
    and any additive mask, then masked; the softmax runs over the visible keys plus the sink.

    Args:
        q: (B, H, T, D) queries.
        k: (B, Hkv, T_kv, D) keys; Hkv divides H, query head h uses key head h // (H // Hkv).
        v: (B, Hkv, T_kv, Dv) values.
        causal: query i sees keys j <= i + S - T (bottom-right aligned).
        window: with ``causal``, query i also sees only the last ``window`` keys up to itself.
        mask: bool (True = may attend) or additive float mask, broadcastable to (B, H, T, S).
        attention_mask: (B, T_kv) padding mask of the given keys, 1/True = real token,
            0/False = padding (bools or 0/1 ints).
        documents: (B, S) integer document ids of the keys (packed rows); the T queries are
            the last T keys' positions, and a query sees only keys of its own document.
            With a cache, S counts the cached keys too. See ``headwise.masks`` for
            ``documents_from_position_ids`` and ``documents_from_cu_seqlens``.
        softcap: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2), a number > 0.
        sinks: (H,) one sink logit per query head (gpt-oss): it joins the softmax and carries
            no value, so each row's weights sum to 1 minus the sink's share.
        alibi_slopes: (H,) or (B, H): adds ``-slope * |i + S - T - j|`` to the scores (ALiBi).
        cache: a ``KVCache``: k and v (and their padding) are appended to it first, and the
            queries attend over everything it holds (S = cached + T_kv keys); else S = T_kv.
            Or ``paged.batch(seq_ids, new_tokens)`` of a ``PagedKVCache``: q, k, v pack the new
            tokens of several sequences in one row (B = 1), and each sequence's queries attend
            over its own cached and new tokens only (ragged, no padding).
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        scale: multiplies the scores; default 1 / sqrt(D).
        backend: "auto", "math" or "sdpa" (see the module docstring).

    Returns:
        (B, H, T, Dv) context vectors; zeros for a query that may see no key.

    Example:
        >>> q = k = v = torch.randn(2, 12, 8, 64)
        >>> attention(q, k, v, causal=True).shape
        torch.Size([2, 12, 8, 64])
        >>> cache = KVCache(2, 12, max_len=16, head_dim=64)
        >>> attention(q, k, v, causal=True, cache=cache).shape, len(cache)
        (torch.Size([2, 12, 8, 64]), 8)
    """
    _check_qkv(q, k, v)
    _checks.dropout("dropout_p", dropout_p)
    scale = _check_scale(scale, q.shape[-1])
    run = _choose(backend)
    attention_mask = _checks.attention_mask(
        attention_mask, k.shape[0], k.shape[2], "(B, T_kv)" if cache is not None else "(B, S)", device=("k and v are", k.device)
    )
    if cache is not None and documents is not None and not isinstance(cache, KVCache):
        raise ValueError(
            "documents number the tokens of one row of a KVCache; a paged batch packs several sequences, each its own "
            f"document already: pass documents=None, got a {type(cache).__name__}"
        )
    held = len(cache) if isinstance(cache, KVCache) else 0
    documents = _checks.documents(documents, k.shape[0], held + k.shape[2], "(B, cached + T_kv)" if cache is not None else "(B, S)", q.device)
    if attention_mask is not None:  # whatever sits at a padded key must not reach a real row, forward or backward
        k, v = _zero_padding(k, attention_mask), _zero_padding(v, attention_mask)  # (B, Hkv, T_kv, D) x2
    in_order = documents is not None or alibi_slopes is not None  # both read key positions: no ring order
    if cache is None:
        sizes = [(slice(None), k.shape[2])]  # every query over every key
    else:
        if mask is not None and not isinstance(checked(cache), KVCache):
            raise ValueError("mask cannot go with a paged batch (each sequence attends over its own keys): pass mask=None, with causal and window")
        sizes = [(rows, _kept(S, q, rows, causal, window)) for rows, S in checked(cache).sizes(k.shape[2], in_order=in_order)]
    specs = []
    for rows, S in sizes:  # every term checked against the keys each run of queries will see, before a cache is written
        docs = None if documents is None else documents[:, documents.shape[1] - S :]  # (B, S): the keys kept
        specs.append(_spec(
            q[:, :, rows], S, causal=causal, window=window, mask=mask, attention_mask=attention_mask, documents=docs,
            softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, dropout_p=dropout_p, scale=scale,
        ))
    if cache is None:
        parts = [Part(slice(None), k, v, attention_mask)]
    else:
        parts = _read_cache(q, k, v, cache, causal, window, attention_mask, mask, in_order)  # each with (B, Hkv, S, D) x2, (B, S)
    contexts = []
    for (rows, k, v, attention_mask), spec in zip(parts, specs, strict=True):  # one part, or one per sequence of a paged batch
        spec.attention_mask = attention_mask  # (B, S) or None: what the cache holds of the keys' padding
        contexts.append(run(q[:, :, rows], k, v, spec))  # (B, H, T_part, Dv)
    context = contexts[0] if len(contexts) == 1 else torch.cat(contexts, dim=2)  # (B, H, T, Dv)
    report("context", context)
    return context


def attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, *, causal: bool, window: int | None,
    softcap: float | None = None, sinks: Tensor | None = None, alibi_slopes: Tensor | None = None, backend: str = "auto",
) -> Tensor:
    """``attention(q, k, v, cache=cache, ...)`` for a decode loop that checked once what cannot change between steps.

    ``generate`` calls it through ``AttentionLayer.decode``: q (B, H, T, D), k and v (B, Hkv, T, D)
    of one dtype and device, a ``KVCache`` of theirs with room for T more (its window equal to
    ``window``), no padding among the new tokens, no mask, documents or dropout, the default
    scale. Nothing of that is checked here; the numbers are ``attention``'s.

    Returns:
        (B, H, T, D).
    """
    run = _choose(backend)
    part = cache.append(k, v, in_order=alibi_slopes is not None, check=False)[0]  # one Part: every query over (B, Hkv, S, D) x2, (B, S) or None
    k, v, real = part.keys, part.values, part.attention_mask
    keep = None if window is None or not causal else window + q.shape[2] - 1  # as _read_cache trims
    if keep is not None and k.shape[2] > keep:
        k, v, real = k[:, :, -keep:], v[:, :, -keep:], None if real is None else real[:, -keep:]  # (B, Hkv, keep, D) x2, (B, keep)
    spec = _spec(
        q, k.shape[2], causal=causal, window=window, mask=None, attention_mask=real, documents=None,
        softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, dropout_p=0.0, scale=1.0 / math.sqrt(q.shape[-1]),
    )
    return run(q, k, v, spec)  # (B, H, T, D)


def _zero_padding(t: Tensor, real: Tensor) -> Tensor:
    """(B, Hkv, S, D) keys or values with the rows of padded keys (real (B, S) False) set to zero.

    A padded key gets weight 0, but 0 * NaN is NaN: a NaN or Inf there would reach every row
    through weights @ v (and q's gradient through k). Zeros are inert, and no output changes.
    """
    return t.masked_fill(~real[:, None, :, None], 0.0)  # (B, Hkv, S, D)


def _kept(S: int, q: Tensor, rows: slice, causal: bool, window: int | None) -> int:
    """The keys a run of queries ``q[:, :, rows]`` attends over of the S a cache holds for it: a causal window
    trims those that its oldest query no longer sees (as ``_read_cache`` trims them)."""
    return S if window is None or not causal else min(S, window + len(range(q.shape[2])[rows]) - 1)


def _read_cache(
    q: Tensor, k: Tensor, v: Tensor, cache: Cache, causal: bool, window: int | None, attention_mask: Tensor | None, mask: Tensor | None,
    in_order: bool = False,
) -> list[Part]:
    """Append the new keys/values to ``cache``; return what each run of queries attends over (``cache.protocol``)."""
    cache = checked(cache)
    if cache.window is not None and cache.window != window:
        raise ValueError(f"a sliding cache of window={cache.window} needs attention with window={cache.window}, got window={window}")
    parts = cache.append(k, v, attention_mask, in_order=in_order)  # one Part, or one per sequence of a paged batch
    if window is None or not causal:
        return parts
    trimmed = []
    for rows, k, v, attention_mask in parts:
        keep = window + len(range(q.shape[2])[rows]) - 1  # the oldest query sees the last `window` keys up to itself; older ones, none
        if k.shape[2] > keep:
            k, v = k[:, :, -keep:], v[:, :, -keep:]  # (B, Hkv, keep, D) x2: views, nothing copied
            attention_mask = None if attention_mask is None else attention_mask[:, -keep:]  # (B, keep)
        trimmed.append(Part(rows, k, v, attention_mask))
    return trimmed


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    mask: Tensor | None = None,
    attention_mask: Tensor | None = None,
    documents: Tensor | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """The softmax attention weights, for explaining and plotting (no dropout).

    Same arguments and conventions as ``attention``; k may have fewer heads (GQA).

    Returns:
        (B, H, T, S) weights in q's dtype; each row sums to 1 (1 minus the sink's share with
        ``sinks``), or is all zeros for a query that may see no key.
    """
    _check_qkv(q, k, k)
    scale = _check_scale(scale, q.shape[-1])
    attention_mask = _checks.attention_mask(attention_mask, k.shape[0], k.shape[2], "(B, S)", device=("k is", k.device))
    documents = _checks.documents(documents, k.shape[0], k.shape[2], "(B, S)", q.device)
    if attention_mask is not None:
        k = _zero_padding(k, attention_mask)  # (B, Hkv, S, D)
    spec = _spec(
        q, k.shape[2], causal=causal, window=window, mask=mask, attention_mask=attention_mask, documents=documents,
        softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, dropout_p=0.0, scale=scale,
    )
    return math_backend.weights(q, k, spec, (0, spec.T), (0, spec.S)).to(q.dtype)  # (B, H, T, S)


def split_heads(x: Tensor, head_dim: int, name: str = "") -> Tensor:
    """(B, T, H*D) -> (B, H, T, D): ``view`` then ``transpose(1, 2)``, as in the book.

    The head count is whatever the width holds (H = C // D), so a module whose projections
    are sharded across devices computes with its local heads.
    """
    B, T, _ = x.shape
    x = x.view(B, T, x.shape[-1] // head_dim, head_dim)  # (B, T, H, D): H spelled out, -1 is ambiguous when B or T is 0
    report(f"{name}.view", x)
    x = x.transpose(1, 2)  # (B, H, T, D)
    report(f"{name}.transpose", x)
    return x


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, D) -> (B, T, H*D): ``transpose(1, 2)`` then flatten the heads."""
    B, H, T, D = x.shape
    x = x.transpose(1, 2)  # (B, T, H, D)
    report("context.transpose", x)
    x = x.reshape(B, T, H * D)  # (B, T, C): a copy only when x is not already laid out so
    report("merged", x)
    return x
