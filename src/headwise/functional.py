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

Backends are plain functions in ``BACKENDS``, chosen in ``_choose``:
    "math"  explicit QK^T, scale, mask, softmax (float32 for half inputs), dropout, AV;
            the one that reports its steps to an observer (``headwise.observe``).
    "sdpa"  ``torch.nn.functional.scaled_dot_product_attention``: flash / fused kernels,
            ``is_causal`` instead of a mask whenever it means the same, native GQA.
    "auto"  "sdpa", or "math" while someone observes.

``attention`` is the one entry: with a ``KVCache`` it first appends the new keys and values
to the cache, then attends over everything the cache holds (trimmed to what a sliding window
can still see).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _checks
from .cache import Cache, KVCache, Part, checked
from .masks import causal_mask, padding_mask
from .observe import observing, report

_HALF = (torch.float16, torch.bfloat16)


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


def _combined_mask(
    q: Tensor,
    k: Tensor,
    causal: bool,
    window: int | None,
    mask: Tensor | None,
    attention_mask: Tensor | None,
) -> tuple[Tensor | None, bool]:
    """Validate the masking arguments and fold them into one mask.

    Returns ``(mask, is_causal)``: mask is None, bool (True = may attend) or additive float,
    broadcastable to (B, H, T, S); ``is_causal`` is True when plain top-left causal masking
    (T == S, nothing else) says it all, so that SDPA needs no mask at all.
    """
    B, H, T, _ = q.shape
    S = k.shape[2]
    if _checks.window(window, causal) is not None and window >= S:
        window = None  # the last query sits at S-1 and sees keys > S-1-window: every key, so no window at all
    parts: list[Tensor] = []
    if causal:
        if T == S and window is None and mask is None and attention_mask is None:
            return None, True
        if T > 1 or window is not None:  # one query, no window: it sees every key
            parts.append(causal_mask(T, S, window=window, device=q.device))  # (T, S)
    if attention_mask is not None:
        parts.append(padding_mask(attention_mask))  # (B, 1, 1, S)
    allowed = None
    for part in parts:
        allowed = part if allowed is None else allowed & part  # broadcasts to (B?, 1, T, S)
    if mask is None:
        return allowed, False
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor (bool or float), got {type(mask).__name__}")
    _checks.same_device("mask", mask, "q, k and v are", q.device)
    try:
        ok = torch.broadcast_shapes(mask.shape, (B, H, T, S)) == (B, H, T, S)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"mask must broadcast to (B, H, T, S) = {(B, H, T, S)}, got shape {tuple(mask.shape)}")
    if mask.ndim < 2:  # SDPA rejects a (S,) mask although it broadcasts
        mask = mask.view((1,) * (2 - mask.ndim) + tuple(mask.shape))  # (1, S)
    if mask.dtype == torch.bool:
        return (mask if allowed is None else mask & allowed), False
    if not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = may attend) or an additive float mask, got dtype {mask.dtype}")
    if _checks.has_values(mask) and bool((mask.isnan() | (mask == math.inf)).any()):  # one host read, for a float mask only
        raise ValueError("mask (additive float) must hold finite numbers or -inf (= may not attend), got NaN or +inf")
    mask = mask.to(q.dtype)
    return (mask if allowed is None else mask.masked_fill(~allowed, -math.inf)), False


# ----------------------------------------------------------------------------- backends


def _scores(q: Tensor, k: Tensor) -> Tensor:
    """Raw scores q·k for every head; query head h uses key head h // (H // Hkv)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    # each group's query heads stacked as rows of one matrix: k is read in place. (A broadcast
    # over a group dim, q.view(B, Hkv, G, T, D) @ k.unsqueeze(2), makes matmul copy k G times.)
    q = q.reshape(B, Hkv, (H // Hkv) * T, D)  # (B, Hkv, G*T, D): a copy of q only when G > 1
    scores = q @ k.transpose(-2, -1)  # (B, Hkv, G*T, S)
    return scores.view(B, H, T, S)  # (B, H, T, S)


def _softmax_weights(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> Tensor:
    """Masked, scaled softmax of the scores, (B, H, T, S); float32 for half inputs.

    A row that may see no key is given finite logits and then zero weights, by ``where``:
    never asking the device whether there is such a row (that would be a host sync).
    """
    scores = _scores(q, k)  # (B, H, T, S)
    report("scores", scores)
    live = None  # (.., T, 1): rows that can see at least one key; None = all of them, known without looking
    if is_causal:  # top-left causal over T == S keys: every query sees at least itself
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], device=q.device), -math.inf)
        report("masked_scores", scores)
    elif mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -math.inf)
        live = mask.any(-1, keepdim=True)
        report("masked_scores", scores)
    elif mask is not None:
        live = (mask > -math.inf).any(-1, keepdim=True)
    logits = scores * scale  # (B, H, T, S)
    if mask is not None and mask.dtype != torch.bool:
        logits = logits + mask  # softmax(q k^T * scale + mask): an additive mask is not scaled
    if live is not None:  # a row of -inf would give 0/0: give it finite logits, then zero its weights
        logits = logits.masked_fill(~live, 0.0)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32 if q.dtype in _HALF else None)
    if live is not None:
        weights = weights.masked_fill(~live, 0.0)
    report("weights", weights)
    return weights  # (B, H, T, S)


def _math(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float, scale: float) -> Tensor:
    B, H, T, _ = q.shape
    Hkv, S, Dv = v.shape[1:]
    weights = _softmax_weights(q, k, mask, is_causal, scale).to(v.dtype)  # (B, H, T, S)
    if dropout_p > 0.0:
        weights = F.dropout(weights, dropout_p)
    weights = weights.reshape(B, Hkv, (H // Hkv) * T, S)  # (B, Hkv, G*T, S): each group's rows, as in _scores
    context = weights @ v  # (B, Hkv, G*T, Dv): v read in place, never repeated
    return context.view(B, H, T, Dv)  # (B, H, T, Dv)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, dropout_p: float, scale: float) -> Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )  # (B, H, T, Dv)


Backend = Callable[[Tensor, Tensor, Tensor, "Tensor | None", bool, float, float], Tensor]
BACKENDS: dict[str, Backend] = {"math": _math, "sdpa": _sdpa}


def _choose(backend: str) -> Backend:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be one of {['auto', *BACKENDS]} (a str), got {type(backend).__name__} {backend!r}")
    if backend == "auto":
        return _math if observing() else _sdpa
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
    cache: Cache | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    backend: str = "auto",
) -> Tensor:
    """Scaled dot-product attention over heads: ``softmax(q k^T * scale + mask) v``.

    Args:
        q: (B, H, T, D) queries.
        k: (B, Hkv, T_kv, D) keys; Hkv divides H, query head h uses key head h // (H // Hkv).
        v: (B, Hkv, T_kv, Dv) values.
        causal: query i sees keys j <= i + S - T (bottom-right aligned).
        window: with ``causal``, query i also sees only the last ``window`` keys up to itself.
        mask: bool (True = may attend) or additive float mask, broadcastable to (B, H, T, S).
        attention_mask: (B, T_kv) padding mask of the given keys, 1/True = real token,
            0/False = padding (bools or 0/1 ints).
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
    attention_mask = _checks.attention_mask(
        attention_mask, k.shape[0], k.shape[2], "(B, T_kv)" if cache is not None else "(B, S)", device=("k and v are", k.device)
    )
    if attention_mask is not None:  # whatever sits at a padded key must not reach a real row, forward or backward
        k, v = _zero_padding(k, attention_mask), _zero_padding(v, attention_mask)  # (B, Hkv, T_kv, D) x2
    if cache is None:
        parts = [Part(slice(None), k, v, attention_mask)]  # every query over every key
    else:
        parts = _read_cache(q, k, v, cache, causal, window, attention_mask, mask)  # each with (B, Hkv, S, D) x2, (B, S)
    run, contexts = _choose(backend), []
    for rows, k, v, attention_mask in parts:  # one part, or one per sequence of a paged batch
        q_part = q[:, :, rows]  # (B, H, T_part, D)
        part_mask, is_causal = _combined_mask(q_part, k, causal, window, mask, attention_mask)
        contexts.append(run(q_part, k, v, part_mask, is_causal, dropout_p, scale))  # (B, H, T_part, Dv)
    context = contexts[0] if len(contexts) == 1 else torch.cat(contexts, dim=2)  # (B, H, T, Dv)
    report("context", context)
    return context


def _zero_padding(t: Tensor, real: Tensor) -> Tensor:
    """(B, Hkv, S, D) keys or values with the rows of padded keys (real (B, S) False) set to zero.

    A padded key gets weight 0, but 0 * NaN is NaN: a NaN or Inf there would reach every row
    through weights @ v (and q's gradient through k). Zeros are inert, and no output changes.
    """
    return t.masked_fill(~real[:, None, :, None], 0.0)  # (B, Hkv, S, D)


def _read_cache(
    q: Tensor, k: Tensor, v: Tensor, cache: Cache, causal: bool, window: int | None, attention_mask: Tensor | None, mask: Tensor | None
) -> list[Part]:
    """Append the new keys/values to ``cache``; return what each run of queries attends over (``cache.protocol``)."""
    cache = checked(cache)
    if cache.window is not None and cache.window != window:
        raise ValueError(f"a sliding cache of window={cache.window} needs attention with window={cache.window}, got window={window}")
    if mask is not None and not isinstance(cache, KVCache):
        raise ValueError("mask cannot go with a paged batch (each sequence attends over its own keys): pass mask=None, with causal and window")
    parts = cache.append(k, v, attention_mask)  # one Part, or one per sequence of a paged batch
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
    scale: float | None = None,
) -> Tensor:
    """The softmax attention weights, for explaining and plotting (no dropout).

    Same arguments and conventions as ``attention``; k may have fewer heads (GQA).

    Returns:
        (B, H, T, S) weights in q's dtype; each row sums to 1, or is all zeros for a query
        that may see no key.
    """
    _check_qkv(q, k, k)
    scale = _check_scale(scale, q.shape[-1])
    attention_mask = _checks.attention_mask(attention_mask, k.shape[0], k.shape[2], "(B, S)", device=("k is", k.device))
    if attention_mask is not None:
        k = _zero_padding(k, attention_mask)  # (B, Hkv, S, D)
    mask, is_causal = _combined_mask(q, k, causal, window, mask, attention_mask)
    return _softmax_weights(q, k, mask, is_causal, scale).to(q.dtype)  # (B, H, T, S)


def split_heads(x: Tensor, head_dim: int, name: str = "") -> Tensor:
    """(B, T, H*D) -> (B, H, T, D): ``view`` then ``transpose(1, 2)``, as in the book.

    The head count is whatever the width holds (H = C // D), so a module whose projections
    are sharded across devices computes with its local heads.
    """
    B, T, _ = x.shape
    x = x.view(B, T, -1, head_dim)  # (B, T, H, D)
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
