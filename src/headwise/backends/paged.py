"""The one-token rows of a paged batch in one call: every sequence's query over its own blocks of the pool, read in place.

A paged decode step would otherwise attend sequence by sequence: one fused-kernel call per
sequence and layer, each a view (or a gathered copy) of its keys. ``rows_over_blocks`` takes the
pool and each sequence's block table instead (vLLM's PagedAttention): key j of sequence n is slot
j % Bs of block ``tables[n, j // Bs]``, the pool seen as (Hkv, blocks, Bs, D) and indexed a block
at a time. Written as broadcast products and sums in float32 (or wider, as ``math``'s ``summed``),
it runs compiled (``compiled``, one ``torch.compile`` per kind of call): inductor turns the
indexing, the products, the softmax and the weighted sum into loops that read each key and value
once from the pool, for every sequence of a call. ``attend`` runs the same call in C++ where
``decode_kernel`` is built (one call for every row, each over its own keys only); else it sorts
the rows by their key counts and makes a few compiled calls of similar lengths: each table runs
to its call's longest (padded with block 0), and the keys past a sequence's own are masked.
"""

from __future__ import annotations

import itertools
import threading
import types
from collections.abc import Callable

import torch
from torch import Tensor

from . import decode_kernel
from .spec import Spec, kernel_terms


def rows_over_blocks(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seen_from: Tensor, seen_to: Tensor,
                     block_size: int, scale: float) -> Tensor:
    """Attention of one query row per sequence over its own keys in the pool.

    Args:
        q: (N, Hkv, G, D) the N sequences' queries, G query heads per key head.
        k_pool, v_pool: (Hkv, P, D) and (Hkv, P, Dv): a ``PagedKVCache``'s pool, P = blocks * Bs slots.
        tables: (N, nb) long: each sequence's blocks in order (then any block: padding).
        seen_from, seen_to: (N,) long: the keys j of its table each row attends over, seen_from <= j < seen_to
            (seen_to >= seen_from + 1: a one-token row sees its own key).
        block_size: Bs.
        scale: the scores' factor.

    Returns:
        (N, Hkv, G, Dv) in q's dtype; logits, softmax and sums in float32 (or q's dtype if wider).
    """
    wide = torch.promote_types(q.dtype, torch.float32)
    (Hkv, P, D), Dv, nb = k_pool.shape, v_pool.shape[-1], tables.shape[1]
    j = torch.arange(nb * block_size, device=q.device)  # (S,): key j of every table, S = nb * Bs
    seen = (j >= seen_from[:, None]) & (j < seen_to[:, None])  # (N, S)
    k = k_pool.view(Hkv, P // block_size, block_size, D)[:, tables]  # (Hkv, N, nb, Bs, D): read in the loops, not copied (compiled)
    v = v_pool.view(Hkv, P // block_size, block_size, Dv)[:, tables]  # (Hkv, N, nb, Bs, Dv)
    rows = q.transpose(0, 1).to(wide)[:, :, :, None, None]  # (Hkv, N, G, 1, 1, D)
    scores = (rows * k.to(wide)[:, :, None]).sum(-1).flatten(-2) * scale  # (Hkv, N, G, S)
    scores = scores.masked_fill(~seen[None, :, None], float("-inf"))  # (Hkv, N, G, S)
    e = (scores - scores.amax(-1, keepdim=True)).exp()  # (Hkv, N, G, S): softmax's numerators (every row sees a key)
    context = (e.unflatten(-1, (nb, block_size))[..., None] * v.to(wide)[:, :, None]).sum((-3, -2))  # (Hkv, N, G, Dv)
    context = context / e.sum(-1)[..., None]  # divided once a row, not once a key
    return context.transpose(0, 1).to(q.dtype)  # (N, Hkv, G, Dv)


def attend(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seen_to: Tensor, *, block_size: int, scale: float,
           window: int | None, groups: int, rows_per_group: int, softcap: float = 0.0, sinks: Tensor | None = None,
           alibi: Tensor | None = None) -> Tensor:
    """The one-token rows over their blocks: in one call of the C++ kernel (``in_cpp``), else compiled, the rows sorted
    by their key counts and cut into up to ``groups`` calls of at least ``rows_per_group`` rows, each table cut to its
    group's longest (less padding to compute). Rows given in that order already (as ``PagedBatch.append_rows`` gives
    them) are cut into slices, not gathered.

    Args:
        q: (N, Hkv, G, D). k_pool, v_pool: (Hkv, P, D), (Hkv, P, Dv). tables: (N, nb) long, padded with block 0.
        seen_to: (N,) long, the keys each row sees, the newest last: keys j < seen_to (and j >= seen_to - window).
        softcap, sinks, alibi: ``decode_kernel.paged``'s terms (the C++ kernel only): the softcap (0: none), sinks
            (H,) and slopes (1 or N, H) float32, or None.

    Returns:
        (N, Hkv, G, Dv) in q's dtype.
    """
    N, Hkv, G = q.shape[:3]
    seen_from = torch.zeros_like(seen_to) if window is None else (seen_to - window).clamp(min=0)  # (N,)
    if in_cpp(q.device, q.dtype, k_pool.dtype) and v_pool.dtype == k_pool.dtype and k_pool.is_contiguous() and v_pool.is_contiguous():
        return decode_kernel.paged(q, k_pool, v_pool, tables, seen_from, seen_to, block_size, scale, softcap, sinks, alibi)  # (N, Hkv, G, Dv)
    if softcap or sinks is not None or alibi is not None:
        raise ValueError("a softcap, sinks or ALiBi over a paged pool in one call is the C++ decode kernel's only (contiguous "
                         f"pools, the kernel built); got {q.dtype} queries on {q.device}")
    if k_pool.dtype == torch.int8:
        raise ValueError("8-bit rows in a paged pool are read in one call by the C++ decode kernel only (float32 queries, "
                         f"contiguous pools, the kernel built); got {q.dtype} queries on {q.device}")
    run = compiled(block_size, scale, (k_pool.dtype, k_pool.device, Hkv, G, q.shape[-1], v_pool.shape[-1]))
    count = max(1, min(groups, N // rows_per_group))
    if count == 1:
        return run(q, k_pool, v_pool, tables, seen_from, seen_to)
    counts = seen_to.tolist()
    order = sorted(range(N), key=counts.__getitem__)  # rows of similar key counts together
    cuts = [N * i // count for i in range(count + 1)]
    in_order = order == list(range(N))
    out = q.new_empty(N, Hkv, G, v_pool.shape[-1])  # (N, Hkv, G, Dv)
    for a, b in itertools.pairwise(cuts):
        part = slice(a, b) if in_order else torch.tensor(order[a:b], device=q.device)
        width = -(-counts[order[b - 1]] // block_size)  # the group's longest table
        out[part] = run(q[part], k_pool, v_pool, tables[part, :width].contiguous(), seen_from[part], seen_to[part])
    return out


def in_cpp(device: torch.device, dtype: torch.dtype, stored: torch.dtype) -> bool:
    """Whether ``attend`` runs in C++ (``decode_kernel.paged``, over contiguous pools): queries of ``dtype`` on a CPU
    ``device`` over a pool of ``stored``, each float32 or bfloat16, or float32 queries over 8-bit rows (torch.int8),
    the kernel built (at the first such call)."""
    kinds = (dtype in decode_kernel.DTYPES and stored in decode_kernel.DTYPES) or (dtype, stored) == (torch.float32, torch.int8)
    return device.type == "cpu" and kinds and decode_kernel.available()


#: The kernels' products and sums contracted into fused multiply-adds (inductor compiles without by default): one
#: rounding fewer per term, and fewer instructions in loops bound by their arithmetic.
FMA = {"cpp.enable_floating_point_contract_flag": "fast"}
_compiled: dict[tuple, Callable[..., Tensor]] = {}
_lock = threading.Lock()


def compiled(block_size: int, scale: float, key: tuple) -> Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]:
    """``rows_over_blocks(q, k_pool, v_pool, tables, seen_from, seen_to)`` compiled for one kind of call: the block size
    and scale held fixed, and ``key`` (the pool's dtype and device, heads, head sizes) kept apart.

    Each kind runs a code object of its own, so that one kind's graphs do not count against another's
    ``recompile_limit``. The sizes that change from call to call (sequences, blocks per table, the pool's
    slots) are marked dynamic at each call; heads and head size stay fixed, so inductor's loops over them are static.
    """
    with _lock:
        fn = _compiled.get((block_size, scale, key))
        if fn is None:
            def run(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seen_from: Tensor, seen_to: Tensor) -> Tensor:
                return rows_over_blocks(q, k_pool, v_pool, tables, seen_from, seen_to, block_size, scale)

            own = types.FunctionType(run.__code__.replace(), run.__globals__, "rows_over_blocks", None, run.__closure__)
            fn = _compiled[(block_size, scale, key)] = _marked(torch.compile(own, fullgraph=True, dynamic=False, options=FMA))
        return fn


def _marked(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``fn`` with its sequences, table width and pool slots marked dynamic at each call (a size 1 stays a graph of its own)."""

    def call(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seen_from: Tensor, seen_to: Tensor) -> Tensor:
        for t, dim in ((q, 0), (tables, 0), (tables, 1), (seen_from, 0), (seen_to, 0), (k_pool, 1), (v_pool, 1)):
            torch._dynamo.maybe_mark_dynamic(t, dim)
        return fn(q, k_pool, v_pool, tables, seen_from, seen_to)

    return call


def rows_over_own_keys(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """The same call as a runner of one query per row (``headwise.plan``'s ``run`` for such rows): (B, H, 1, D) over
    (B, Hkv, S, D) and (B, Hkv, S, Dv), each row's keys a pool of blocks of one key; (B, H, 1, Dv)."""
    B, H, _, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    table, seen_to = torch.arange(S, device=q.device)[None], torch.full((1,), S, device=q.device)  # (1, S): key j in slot j; (1,)
    softcap, sinks, alibi = kernel_terms(spec)  # alibi (1 or B, H)
    rows = [attend(q[b : b + 1, :, 0].reshape(1, Hkv, H // Hkv, D).float(), k[b].contiguous(), v[b].contiguous(), table, seen_to,
                   block_size=1, scale=spec.scale, window=spec.window, groups=1, rows_per_group=1, softcap=softcap, sinks=sinks,
                   alibi=None if alibi is None else alibi[b : b + 1] if alibi.shape[0] > 1 else alibi)
            for b in range(B)]  # (1, Hkv, G, Dv) each
    return torch.cat(rows).reshape(B, H, 1, -1).to(q.dtype)  # (B, H, 1, Dv)
