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

One path: the checks (``arguments.checked``: nothing written before), the cache's write, then
per run of queries (one, or one per sequence of a paged batch) the keys a causal window lets
them see, the plan (``backends.plan``) and its runner; ``plan(...)`` stops before the write.
Backends: "math" writes every score out (the reference, and what an observer watches); "sdpa"
runs torch's fused kernels and the runners that carry what they cannot take exactly; "auto"
takes the plan's first rule that matches, whichever backend's it is.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
from torch import Tensor

from . import _checks, arguments
from .arguments import Arguments, check_backend, for_run
from .backends import decode_kernel, prefill_kernel
from .backends import math as math_backend
from .backends.blocks import joined
from .backends.paged import attend as attend_rows
from .backends.paged import in_cpp, rows_over_own_keys
from .backends.plan import ROW_GROUPS, ROWS_IN_ONE_CALL_WHY, ROWS_PER_GROUP, Plan, float32_keys, one_call_runner, rows_in_one_call
from .backends.plan import plan as plan_runner
from .backends.spec import Spec, kernel_terms
from .cache import Attended, Cache, KVCache, PagedBatch
from .cache.paged_batch import PoolRows
from .observe import report

P = ParamSpec("P")
R = TypeVar("R")


def _keywords_named(function: Callable[P, R]) -> Callable[P, R]:
    """``function``, where a keyword it does not take (torch's ``is_causal``, say) is a TypeError naming headwise's."""
    known = list(inspect.signature(function).parameters)

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        arguments.known_keywords(function.__name__, kwargs, known)
        return function(*args, **kwargs)

    return checked


__all__ = ["WEIGHT_TERMS", "Plan", "attention", "attention_unchecked", "attention_weights", "check_backend", "merge_heads", "plan", "split_heads"]


@_keywords_named
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
        mask: bool (True = may attend) or additive float mask, broadcastable to (B, H, T, S); with a
            ``KVCache`` numbered over every key, S = cached + T_kv, as ``documents`` are (the columns of
            keys a window or a ring no longer shows are read by no query).
        attention_mask: (B, T_kv) padding mask of the given keys, 1/True = real token,
            0/False = padding (bools or 0/1 ints).
        documents: (B, S) integer document ids of the keys (packed rows); the T queries are
            the last T keys' positions, and a query sees only keys of its own document.
            With a cache, S counts the cached keys too. See ``headwise.masks`` for
            ``documents_from_position_ids`` and ``documents_from_cu_seqlens``.
        softcap: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2), a number in
            [1e-6, 1e30].
        sinks: (H,) one sink logit per query head (gpt-oss): it joins the softmax and carries
            no value, so each row's weights sum to 1 minus the sink's share; -inf = no sink.
        alibi_slopes: (H,) or (B, H): adds ``-slope * |i + S - T - j|`` to the scores (ALiBi); each
            slope times the farthest distance in the call must be finite in the scores' dtype.
        cache: a ``KVCache``: k and v (and their padding) are appended to it first, and the
            queries attend over everything it holds (S = cached + T_kv keys); else S = T_kv.
            A sliding cache (``KVCache.sliding``) takes at most T_kv queries: the ring no longer
            holds the keys of older ones.
            Or ``paged.batch(seq_ids, new_tokens)`` of a ``PagedKVCache``: q, k, v pack the new
            tokens of several sequences in one row (B = 1, T = T_kv = sum(new_tokens)), and each
            sequence's queries attend over its own cached and new tokens only (ragged, no padding).
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        scale: multiplies the scores; default 1 / sqrt(D). A score ``q·k * scale`` past the range its
            dtype computes in (3.4e38 in float32) is infinite, and its row's weights NaN, in every backend, as in torch's.
            The scale itself must be finite and nonzero in that dtype (1.4e-45 to 3.4e38 in float32).
        backend: "auto", "math" or "sdpa" (see the module docstring); ``plan(...)`` says what
            runs for a call, and why.

    Another library's keyword (``is_causal``, ``attn_mask``, ``key_padding_mask``, ``softmax_scale``, ...)
    is a TypeError that names headwise's.

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
    args = arguments.checked(
        q, k, v, causal=causal, window=window, mask=mask, attention_mask=attention_mask, documents=documents, softcap=softcap,
        sinks=sinks, alibi_slopes=alibi_slopes, cache=cache, dropout_p=dropout_p, scale=scale, backend=backend,
    )
    return _run(args, check_cache=True)  # (B, H, T, Dv)


def attention_unchecked(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache | PagedBatch, *, causal: bool, window: int | None,
    softcap: float | None = None, sinks: Tensor | None = None, alibi_slopes: Tensor | None = None, backend: str = "auto",
) -> Tensor:
    """``attention(q, k, v, cache=cache, ...)`` with nothing checked, for ``generate``'s decode loop
    (``AttentionLayer.forward(..., check=False)``) and the ``Batcher``'s decode steps: q (B, H, T, D), k and v (B, Hkv, T,
    D) of one dtype and device, a ``KVCache`` of theirs (or bfloat16 under float32) with room for T more (its window
    ``window``), or a fresh ``PagedKVCache.batch(...)`` packing T = sum(new_tokens) tokens (B = 1) whose pool has room for
    them; no padding, mask, documents or dropout, the default scale. The path and the numbers are ``attention``'s.

    Returns:
        (B, H, T, D).
    """
    spec = _unchecked_spec(q, k, causal, window, softcap, sinks, alibi_slopes)
    return _run(Arguments(q, k, v, spec, cache, backend), check_cache=False)  # (B, H, T, D)


def _unchecked_spec(q: Tensor, k: Tensor, causal: bool, window: int | None, softcap: float | None, sinks: Tensor | None,
                    alibi_slopes: Tensor | None) -> Spec:
    """The terms of ``attention_unchecked``'s call: q (B, H, T, D) over its k (B, Hkv, T_kv, D), the default scale."""
    H, T, D = q.shape[1:]
    return Spec(
        T=T, S=k.shape[2], causal=causal, window=window, softcap=softcap, sinks=sinks,
        alibi=None if alibi_slopes is None else alibi_slopes.view(-1, H), scale=1.0 / math.sqrt(D),
    )


def decode_kernel_call(
    q: Tensor, k: Tensor, v: Tensor, cache: KVCache, *, causal: bool, window: int | None,
    softcap: float | None = None, sinks: Tensor | None = None, alibi_slopes: Tensor | None = None, backend: str = "auto",
) -> KernelCall | None:
    """``attention_unchecked(q, k, v, cache, ...)`` decided once for the decode steps that follow, where that call's plan
    is the C++ decode kernel over a whole (not sliding) ``KVCache``; None for any other call, which then runs
    ``attention_unchecked`` each step. The kernel's rule reads nothing that a step changes (the key count grows, dtypes,
    shapes and terms stay). Nothing is written here. Called by ``generate``'s flat step (``models.flat_step``) before
    its step's attention, without grad.

    Returns:
        a ``KernelCall``, ``call(q, k, v, cos=None, sin=None)``: a step's q (B, H, 1, D), k (B, Hkv, 1, D) and v (B, Hkv, 1, Dv), turned
        first by ``rope.rotate``'s "rotate_half" tables (cos, sin) of all D dims where given, the cache written and
        the kernel run over it -> (B, 1, H * Dv), the heads merged: ``rotate``, ``attention_unchecked`` and the merge
        bit for bit, in one op (``decode_kernel.step``; over an 8-bit cache, whose rows the op reads in place, bit for
        bit too).
    """
    return _kernel_call(q, cache, _unchecked_spec(q, k, causal, window, softcap, sinks, alibi_slopes), backend)


def _kernel_call(q: Tensor, cache: Cache, spec: Spec, backend: str) -> KernelCall | None:
    """``decode_kernel_call`` of a call's terms ``spec`` (its T = S = 1: the step's new token). The kernel reads every
    key from the first, so a causal window shorter than the cache's room (one that drops keys once the cache holds more
    than it, at this step or a later one) is not its call: such a step runs ``_run``'s cut (``arguments.for_run``)."""
    if type(cache) is not KVCache or cache.window is not None or q.shape[2] != 1 or len(cache) >= cache.k.shape[2]:
        return None
    if spec.window is not None and spec.window < cache.k.shape[2]:
        return None
    stored, S = cache.dtype, len(cache) + 1
    run_spec, _ = for_run(spec, 1, S, None, True)
    keys, values = cache.k[:, :, :S], cache.v[:, :, :S]  # (B, Hkv, S, D) x2: what the step's write hands the queries
    if cache.rows8:  # the float32 rows the write hands the queries (the kernel reads the 8-bit ones in place, alike)
        keys = values = keys.new_empty((*keys.shape[:2], 1, cache.head_dim), dtype=stored).expand(-1, -1, S, -1)  # (B, Hkv, S, D)
    if plan_runner(q.to(stored), keys, values, run_spec, backend).run is not decode_kernel.run:
        return None
    return KernelCall(cache, run_spec)


class KernelCall:
    """``decode_kernel_call``'s answer: the call's cache and terms (its scale, softcap, sinks and ALiBi slopes, the
    sinks and slopes read as they stand at each step), called once a step."""

    __slots__ = ("cache", "spec")

    def __init__(self, cache: KVCache, spec: Spec) -> None:
        self.cache, self.spec = cache, spec

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor:
        """(B, H, 1, D), (B, Hkv, 1, D), (B, Hkv, 1, Dv), the rotation's tables or None -> (B, 1, H * Dv)."""
        scale, terms = self.spec.scale, kernel_terms(self.spec)
        return self.cache.write_one_unchecked(
            lambda ks, vs, real, slot: decode_kernel.step(q, k, v, cos, sin, ks, vs, real, slot, scale, *terms))

    def after_write(self, q: Tensor, k: Tensor, v: Tensor, check: bool) -> Tensor:
        """(B, H, 1, D), (B, Hkv, 1, D), (B, Hkv, 1, Dv) -> (B, H, 1, Dv): the cache's write in torch's ops
        (``append_stored``; ``check``: its checks), then the kernel over the rows as stored, an 8-bit cache's read in
        place. A compiled step's way (the op of ``__call__`` writes its arguments: the compiler does not call it);
        the same numbers."""
        keys, values, real = self.cache.append_stored(k, v, check=check)  # (B, Hkv, S, D + 4) x2, (B, S) or None
        return decode_kernel.dense(q, keys, values, real, self.spec.scale, *kernel_terms(self.spec))


def paged_kernel_call(
    q: Tensor, k: Tensor, v: Tensor, batch: PagedBatch, *, causal: bool, window: int | None,
    softcap: float | None = None, sinks: Tensor | None = None, alibi_slopes: Tensor | None = None, backend: str = "auto",
) -> PagedCall | None:
    """``attention_unchecked(q, k, v, batch, ...)`` decided once for the decode steps over ``batch``'s pool that follow,
    where every sequence of the batch feeds one token (``one_each``), q, k and v are float32 or bfloat16 of one dtype,
    and the call's plan attends them in one call of the C++ kernel over the pool as it lies (``_rows_in_one_call``,
    ``paged.in_cpp``, contiguous pools); None for any other call, which then runs ``attention_unchecked``. The rule reads
    nothing a decode step changes (the sequences and their lengths do not enter it). Nothing is written here. Called by
    the flat step (``models.flat_step``) for the ``Batcher``'s decode steps, without grad.

    Returns:
        a ``PagedCall``, ``call(batch, q, k, v, cos=None, sin=None)``: a later step's batch of the same pool (every
        sequence one token), q (1, H, N, D), k (1, Hkv, N, D) and v (1, Hkv, N, Dv), turned first by ``rope.rotate``'s
        "rotate_half" tables (cos, sin) (1, 1, N, D) where given, the pool written and its one call run -> (1, N, H * Dv),
        the heads merged: ``rotate``, ``attention_unchecked`` and the merge bit for bit, in one op
        (``decode_kernel.paged_step``).
    """
    spec = _unchecked_spec(q, k, causal, window, softcap, sinks, alibi_slopes)
    pool = batch.cache
    if not batch.one_each or q.dtype not in decode_kernel.DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    if not (pool.k.is_contiguous() and pool.v.is_contiguous() and in_cpp(q.device, torch.float32, pool.k.dtype)):
        return None
    if not _rows_in_one_call(Arguments(q, k, v, spec, batch, backend)):
        return None
    return PagedCall(spec)


class PagedCall:
    """``paged_kernel_call``'s answer: the call's terms (its scale, window, softcap, sinks and ALiBi slopes, the sinks
    and slopes read as they stand at each step), called once a step with that step's batch."""

    __slots__ = ("spec",)

    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    def __call__(self, batch: PagedBatch, q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None = None, sin: Tensor | None = None) -> Tensor:
        """A batch whose every sequence feeds one token; (1, H, N, D), (1, Hkv, N, D), (1, Hkv, N, Dv), the rotation's
        tables (1, 1, N, D) or None -> (1, N, H * Dv)."""
        pool, spec, terms = batch.cache, self.spec, kernel_terms(self.spec)
        return batch.write_rows_unchecked(lambda slots, rows, tables, seen_to: decode_kernel.paged_step(
            q, k, v, cos, sin, pool.k, pool.v, slots, rows, tables, seen_to, spec.window, pool.block_size, spec.scale, *terms))


def plan(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Plan:
    """What ``attention(q, k, v, **kwargs)`` would run, and why; nothing is computed or written.

    ``kwargs`` are ``attention``'s keyword arguments (another name is a TypeError), each checked
    as ``attention`` checks it (a cache's checks of the keys it takes, its room included, as its write would run them).
    ``attention(..., backend=plan.backend)`` runs the same runner, bit for bit; the rules are
    ``headwise.backends.plan.RULES``.

    Returns:
        a ``Plan``: ``backend``, ``runner``, ``reason``; ``str(plan)`` is one line. With a paged
        batch whose sequences take different runners, ``runner`` names each and ``backend`` is
        "auto" (what reproduces them all).

    Example:
        >>> q = torch.randn(1, 4, 1, 64, dtype=torch.bfloat16)
        >>> k = v = torch.randn(1, 2, 300, 64, dtype=torch.bfloat16)  # two query heads per key head
        >>> print(plan(q, k, v, causal=True).runner)  # a decode step on the CPU: headwise's C++ kernel, where built
        C++ decode kernel, each key head's queries in one pass
        >>> print(plan(q, k, v, causal=True, documents=torch.zeros(1, 300, dtype=torch.long)).runner)  # a term it does not compute
        math blocks, float32 matmuls
    """
    args = _checked_as_attention(q, k, v, **kwargs)
    taken = args.k.dtype if args.cache is None else args.cache.dtype  # what the keys are attended in
    keys, values = args.k.to(taken), args.v.to(taken)  # (B, Hkv, T_kv, D) x2
    if args.cache is not None:  # what its write would check (its shape, dtype, room), nothing written
        args.cache.check_append(keys, values, args.spec.attention_mask)
    runs = arguments.sizes(args.cache, args.spec, k.shape[2])
    padding = args.spec.attention_mask
    if args.cache is not None and args.cache.padded:  # the cache hands on the padding of every write that had some
        padding = torch.ones(k.shape[0], max(S for _, S in runs), dtype=torch.bool, device=k.device)  # (B, S): only its presence counts
    one_call = _rows_in_one_call(args)
    plans = [_for_run(args, rows, S, keys, values, padding)[4] for rows, S in runs
             if not (one_call and rows.stop - rows.start == 1)]
    if len(plans) < len(runs):  # one-token rows in one call
        plans.insert(0, Plan("auto", one_call_runner(q.device, args.cache.stored), ROWS_IN_ONE_CALL_WHY, rows_over_own_keys))
    if all(p.runner == plans[0].runner for p in plans):
        return plans[0]
    runners = "; ".join(dict.fromkeys(p.runner for p in plans))
    return Plan("auto", f"per sequence: {runners}", "the sequences of a paged batch differ: " + plans[0].reason, plans[0].run)


def _checked_as_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Arguments:
    """``arguments.checked`` of ``attention(q, k, v, **kwargs)``: its keywords only, its defaults for the rest."""
    arguments.known_keywords("plan", kwargs, inspect.signature(attention).parameters)
    call = inspect.signature(attention).bind(q, k, v, **kwargs)
    call.apply_defaults()
    return arguments.checked(**call.arguments)


def _rows_in_place(args: Arguments) -> KernelCall | None:
    """The C++ decode step for a one-token step over an 8-bit ``KVCache`` whose plan is the decode kernel (no padding
    given with the token, nothing that wants a gradient): the same numbers as the kernel over the rows read back,
    which would read every row back in float32 first (``decode_kernel.step``; compiled, ``KernelCall.after_write``)."""
    q, k, v, spec, cache, backend = args
    if type(cache) is not KVCache or not cache.rows8 or spec.attention_mask is not None:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    return _kernel_call(q, cache, spec, backend)


def _for_run(
    args: Arguments, rows: slice, S: int, keys: Tensor, values: Tensor, padding: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Spec, Plan]:
    """A run of queries ``rows`` over S keys (B, Hkv, S, D) with padding (B, S): its queries, the keys and values
    a causal window lets them see (views), their terms and the plan; the queries in the keys' dtype (a bfloat16 cache's)."""
    q = (args.q if rows == slice(None) else args.q[:, :, rows]).to(keys.dtype)  # (B, H, T_run, D)
    spec, c0 = for_run(args.spec, q.shape[2], S, padding, args.cache is not None)
    if c0:  # keys no query of the run sees
        keys, values = keys[:, :, c0:], values[:, :, c0:]  # (B, Hkv, S_run, D), (B, Hkv, S_run, Dv): views, nothing copied
    return q, keys, values, spec, plan_runner(q, keys, values, spec, args.backend)


#: The runners that read no padded key's row (its score set to -inf and its weight's zero skipped, or the key not read):
#: a call's own padded keys are not zeroed for them (a copy of every key and value).
READ_NO_PADDING = (decode_kernel.run, prefill_kernel.run)


def _run(args: Arguments, check_cache: bool) -> Tensor:
    """The one path behind ``attention``: the cache's write, then each run of queries over its keys, as the plan says.
    A bfloat16 cache under float32 keys stores them rounded; attention then runs in bfloat16, the context back in float32."""
    q, k, v, spec, cache, _ = args
    call = _rows_in_place(args)
    if call is not None:  # an 8-bit cache's one-token step: its rows read in place, not read back whole
        wide = [t.float() for t in (q, k, v)]  # float32 (a bfloat16 model's widened exactly, as every other path widens them)
        if _checks.compiling():  # the compiler does not call the op that writes its arguments
            context = call.after_write(*wide, check_cache)  # (B, H, 1, Dv)
        else:  # the write and the attention in one op
            if check_cache:
                cache.check_append(*wide[1:])
            context = call(*wide).view(q.shape[0], 1, q.shape[1], -1).transpose(1, 2)  # (B, H, 1, Dv)
        context = context.to(q.dtype)
        report("context", context)
        return context
    pool_rows = None
    if cache is None:
        runs = [Attended(slice(None), k, v, spec.attention_mask)]  # every query over every key
    elif _rows_in_one_call(args):
        runs, pool_rows = cache.append_rows(k.to(cache.dtype), v.to(cache.dtype), spec.attention_mask, check=check_cache)  # longer runs, one-token rows
    else:
        k, v = k.to(cache.dtype), v.to(cache.dtype)  # (B, Hkv, T, D) x2: as they are, but under a bfloat16 cache
        runs = cache.append(k, v, spec.attention_mask, in_order=arguments.in_order(spec), check=check_cache)  # one, or one per sequence
    contexts = []
    for rows, keys, values, padding in runs:
        q_run, keys, values, run_spec, chosen = _for_run(args, rows, keys.shape[2], keys, values, padding)
        if cache is None and run_spec.attention_mask is not None and chosen.run not in READ_NO_PADDING:
            # whatever sits at the call's own padded keys must not reach a real row, forward or backward (a cache's
            # were zeroed before their write); the C++ kernels read no padded key's row: nothing to copy
            real = run_spec.attention_mask  # (B, S_run)
            keys, values = arguments.zero_padding(keys, real), arguments.zero_padding(values, real)  # (B, Hkv, S_run, D) x2
        contexts.append(chosen.run(q_run, keys, values, run_spec))  # (B, H, T_run, Dv)
    context = joined(contexts) if pool_rows is None else _placed(args, runs, contexts, pool_rows)  # (B, H, T, Dv)
    context = context.to(q.dtype)
    report("context", context)
    return context


def _rows_in_one_call(args: Arguments) -> bool:
    """A paged batch whose call the plan lets attend its one-token rows in one call."""
    cache = args.cache
    return isinstance(cache, PagedBatch) and rows_in_one_call(args.q, args.spec, args.backend, cache.stored, cache.compile)


def _placed(args: Arguments, runs: list[Attended], contexts: list[Tensor], pool_rows: PoolRows) -> Tensor:
    """The (1, H, T, Dv) context of a paged batch: the longer runs' ``contexts`` at their rows, the one-token rows'
    from one call over their blocks (``backends.paged``), in the dtype the pool takes (float32 for 8-bit rows)."""
    q, spec, taken = args.q, args.spec, args.cache.dtype
    _, H, T, D = q.shape
    Hkv = pool_rows.keys.shape[0]
    # (H, N, D): each one-token sequence's query in the pool's dtype, as every other path takes it (the numbers of the
    # sequence alone), widened once, not once a key
    one = q[0].index_select(1, pool_rows.rows).to(taken).float()
    one = one.view(Hkv, H // Hkv, -1, D).permute(2, 0, 1, 3).contiguous()  # (N, Hkv, G, D)
    softcap, sinks, alibi = kernel_terms(spec)  # alibi (1, H): a paged batch is one row
    rows = attend_rows(one, pool_rows.keys, pool_rows.values, pool_rows.tables, pool_rows.seen_to, block_size=pool_rows.block_size,
                       scale=spec.scale, window=spec.window, groups=ROW_GROUPS, rows_per_group=ROWS_PER_GROUP, softcap=softcap,
                       sinks=sinks, alibi=alibi)  # (N, Hkv, G, Dv)
    context = q.new_empty((1, H, T, rows.shape[-1]), dtype=taken)  # (1, H, T, Dv)
    context[0, :, pool_rows.rows] = rows.flatten(1, 2).transpose(0, 1).to(context.dtype)  # (H, N, Dv)
    for (part, *_), c in zip(runs, contexts, strict=True):
        context[:, :, part] = c  # (1, H, T_run, Dv)
    return context


#: The keywords of ``attention`` that ``attention_weights`` takes: every term that changes a weight.
WEIGHT_TERMS = ("causal", "window", "mask", "attention_mask", "documents", "softcap", "sinks", "alibi_slopes", "scale")


def attention_weights(q: Tensor, k: Tensor, **terms: Any) -> Tensor:
    """The softmax attention weights, for explaining and plotting (no dropout).

    ``terms`` are ``attention``'s keywords in ``WEIGHT_TERMS`` (causal, window, mask,
    attention_mask, documents, softcap, sinks, alibi_slopes, scale), with its conventions and
    defaults; k (B, Hkv, S, D) may have fewer heads (GQA).

    Returns:
        (B, H, T, S) weights in q's dtype; each row sums to 1 (1 minus the sink's share with
        ``sinks``), or is all zeros for a query that may see no key.
    """
    arguments.known_keywords("attention_weights", terms, WEIGHT_TERMS)
    arguments.qkv(q, k, k)
    padding = _checks.attention_mask(terms.pop("attention_mask", None), k.shape[0], k.shape[2], "(B, S)", device=("k is", k.device))
    args = _checked_as_attention(q, k, k, attention_mask=padding, **terms)
    spec, _ = for_run(args.spec, args.spec.T, args.spec.S, args.spec.attention_mask, False)
    keys = args.k if padding is None else arguments.zero_padding(args.k, padding)  # (B, Hkv, S, D): no NaN into q's gradient
    w = math_backend.weights(q, keys, spec, (0, spec.T), (0, spec.S), float32_keys=float32_keys(q, keys, spec.T))  # (B, H, T, S)
    return w.to(q.dtype)


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
