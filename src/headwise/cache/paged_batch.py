"""One forward pass's row through a ``PagedKVCache``: the next tokens of several sequences, packed.

The queries, keys and values hold the new tokens of ``seq_ids`` in one row, (1, H, T, D) with
T = sum(new_tokens), in that order (as flash-attn's varlen ``cu_seqlens``). Each sequence's
queries attend over its own tokens only, from its ``first_held`` on (ragged: no padding).

A batch offers ``append_rows``: the sequences with one new token (a decode step's) are answered
together as ``PoolRows`` (their block tables over the pool, read in place by one call: ``backends.paged``,
in C++, or compiled by ``torch.compile`` for a batch made with ``compile=True`` where the kernel is
not built), the others as ``Attended`` runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .. import _checks
from .protocol import Attended
from .static import dequantize_rows, quantize_rows

if TYPE_CHECKING:
    from .paged import PagedKVCache


class PoolRows(NamedTuple):
    """The one-token sequences of a paged batch, read in place, fewest keys first: query ``rows[n]`` (an index into T)
    attends over keys 0 .. seen_to[n] - 1 of its block table, key j at pool slot ``tables[n, j // block_size] * block_size + j % block_size``.

    Shapes: rows, seen_to (N,) long; tables (N, nb) long (padded with block 0); keys, values (Hkv, P, D): the pool
    (8-bit rows: (Hkv, P, D + 4) int8, ``PagedKVCache``).
    """

    rows: Tensor
    tables: Tensor
    seen_to: Tensor
    keys: Tensor
    values: Tensor
    block_size: int


def _same_lists(like: PagedBatch, seq_ids: object, new_tokens: object) -> bool:
    """Whether ``seq_ids`` and ``new_tokens`` are lists equal to ``like``'s (which its own batch checked)."""
    return type(seq_ids) is list and type(new_tokens) is list and seq_ids == like.seq_ids and new_tokens == like.new_tokens


def _lengths(cache: PagedKVCache, seq_ids: list[int]) -> list[int] | None:
    """Each sequence's length in ``cache``, or None where one is not open there (its error is the full check's)."""
    try:
        return [cache._lens[s] for s in seq_ids]
    except KeyError:
        return None


class PagedBatch:
    """The cache protocol for ``attention`` over the next tokens of some sequences of a ``PagedKVCache``:
    made by ``paged.batch(seq_ids, new_tokens)`` for one forward pass of one layer."""

    window: int | None  # the pool's: attention must apply the window it gives blocks back for
    padded = False  # it packs real tokens only

    def __init__(self, cache: PagedKVCache, seq_ids: Sequence[int], new_tokens: Sequence[int], *, compile: bool = False,
                 like: PagedBatch | None = None) -> None:
        if like is not None and not isinstance(like, PagedBatch):
            raise TypeError(f"like must be another pool's PagedBatch of the same forward pass, or None, got {type(like).__name__}")
        starts = _lengths(cache, like.seq_ids) if like is not None and _same_lists(like, seq_ids, new_tokens) else None
        if starts is not None:  # the lists checked for ``like`` already, each sequence open here
            seq_ids, new_tokens, self.starts = like.seq_ids, like.new_tokens, starts
            self.one_each, self._rows = like.one_each, like._rows
        else:
            for name, value in (("seq_ids", seq_ids), ("new_tokens", new_tokens)):
                if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                    raise TypeError(f"{name} must be a list of ints (one a sequence), got {type(value).__name__}")
            seq_ids, new_tokens = list(seq_ids), list(new_tokens)
            self.starts = [cache.length(s) for s in seq_ids]  # each sequence's length before this step
            if len(set(seq_ids)) != len(seq_ids):
                raise ValueError(f"seq_ids must not repeat (one run of new tokens per sequence), got {seq_ids}")
            if len(new_tokens) != len(seq_ids) or not seq_ids:
                raise ValueError(f"new_tokens must give one count per seq_id ({len(seq_ids)} ids, at least one), got {len(new_tokens)} counts")
            new_tokens = [_checks.positive_int("new_tokens (each count)", n) for n in new_tokens]
            self.one_each = all(n == 1 for n in new_tokens)  # a decode step's: every sequence feeds one token
            bounds = [0, *itertools.accumulate(new_tokens)]
            self._rows = [slice(a, b) for a, b in itertools.pairwise(bounds)]  # each sequence's queries in the row of T
        self.cache, self.seq_ids, self.new_tokens, self.window = cache, seq_ids, new_tokens, cache.window
        self.compile = _checks.boolean("compile", compile)  # the one call may be compiled where the C++ kernel is not built
        self.like = like
        self._where_at: Tensor | None = None  # (T,) the slots written (``_write``)
        self._rows_at: tuple[Tensor, Tensor, Tensor] | None = None  # the one-token rows' rows, tables, seen_to (``append_rows``)
        self._placed_as: PagedBatch | None = None  # ``like``, where its slots and tables are this batch's (``_write``)
        self._positions: Tensor | None = None  # (1, T) ``start``'s
        self._done = False

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the keys and values the pool takes (the cache protocol): float32 for an 8-bit pool."""
        return self.cache.dtype

    @property
    def stored(self) -> torch.dtype:
        """What the pool's elements are: its ``dtype``, or torch.int8 for 8-bit rows."""
        return self.cache.k.dtype

    def start(self, t: int, attention_mask: Tensor | None = None) -> Tensor:
        """(1, T) positions of the packed new tokens: each sequence continues from its own length (no padding: a
        mask is refused where the keys are written)."""
        total = sum(self.new_tokens)
        if t != total:
            raise ValueError(f"the row holds {t} tokens, but this batch packs sum(new_tokens) = {total} ({self.new_tokens})")
        like = self.like
        if like is not None and like._positions is not None and (like.starts, like.new_tokens) == (self.starts, self.new_tokens):
            self._positions = like._positions  # the same positions: made once a forward pass, not once a layer
        if self._positions is None:
            positions = [p for s, n in zip(self.starts, self.new_tokens, strict=True) for p in range(s, s + n)]
            self._positions = torch.tensor([positions], dtype=torch.long, device=self.cache.k.device)  # (1, T)
        return self._positions  # (1, T)

    def sizes(self, t: int, *, in_order: bool = False) -> list[tuple[slice, int]]:
        """What ``append`` will answer with, before anything is written: ``(rows, S_i)`` per sequence (the cache
        protocol); ``append`` refuses keys of any other count than the ``sum(new_tokens)`` this batch packs."""
        held = [s - self.cache.first_held(i) for i, s in zip(self.seq_ids, self.starts, strict=True)]  # cached keys still held
        return [(rows, h + n) for rows, h, n in zip(self._rows, held, self.new_tokens, strict=True)]

    def check_owner(self, owner: object) -> None:
        self.cache.check_owner(owner)

    def bind(self, owner: object) -> None:
        self.cache.bind(owner)

    def append(
        self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None, *, in_order: bool = False, check: bool = True
    ) -> list[Attended]:
        """Write the packed keys/values (1, Hkv, T, D) to each sequence's blocks (``check=False`` skips the
        checks of the arguments, not of the pool's room, for a caller that made them).

        Returns:
            One ``Attended`` per sequence i: its queries ``rows`` (its slice of T) attend over its S_i = starts[i]
            + new_tokens[i] - first_held keys and values, (1, Hkv, S_i, D) each, oldest first (``in_order`` asks
            nothing more; a sliding cache's newest, as causal attention aligned bottom-right expects), no padding.
        """
        self._write(k, v, attention_mask, check)
        return [Attended(rows, *self._read(s), None) for s, rows in zip(self.seq_ids, self._rows, strict=True)]  # (1, Hkv, S_i, D) each

    def append_rows(
        self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None, *, check: bool = True
    ) -> tuple[list[Attended], PoolRows | None]:
        """``append``, answering the sequences with one new token as one ``PoolRows`` (their tables, nothing read
        or gathered) and the others as ``Attended`` runs; None when no sequence has one new token."""
        self._write(k, v, attention_mask, check)
        cache, one = self.cache, [i for i, n in enumerate(self.new_tokens) if n == 1]
        runs = [Attended(self._rows[i], *self._read(self.seq_ids[i]), None) for i, n in enumerate(self.new_tokens) if n != 1]
        if not one:
            return runs, None
        return runs, PoolRows(*self._rows_of(one), cache.k, cache.v, cache.block_size)

    def write_rows_unchecked(self, run: Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """A decode step (``one_each``) whose op writes the pool itself, for a caller that checked the rest once
        (``functional.paged_kernel_call``): the blocks taken and the new tokens counted, then ``run(slots, rows, tables,
        seen_to)``, the slots (T,) the op writes the packed keys and values at and ``append_rows``' rows, tables and
        seen_to. Returns what ``run`` returns. A pool without room is a ValueError, before anything is written."""
        self._place()
        return run(self._where_at, *self._rows_of(list(range(len(self.seq_ids)))))

    def _rows_of(self, one: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The one-token sequences ``one``'s rows, tables and seen_to (``_tables_of``), or ``like``'s where placed alike."""
        placed = self._placed_as
        self._rows_at = placed._rows_at if placed is not None and placed._rows_at is not None else self._tables_of(one)
        return self._rows_at

    def _tables_of(self, one: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """``PoolRows``' rows, tables and seen_to of the sequences ``one`` (indices into seq_ids), after the write."""
        cache = self.cache
        held = {i: cache._lens[self.seq_ids[i]] - cache.first_held(self.seq_ids[i]) for i in one}  # the keys each holds
        one.sort(key=held.__getitem__)  # fewest keys first: the order the one call groups them in
        ids = [self.seq_ids[i] for i in one]
        lengths = [len(cache._tables[s]) for s in ids]
        rows, seen_to, firsts, counts = torch.tensor(
            [[self._rows[i].start for i in one], [held[i] for i in one], [cache._tables[s][0] for s in ids], lengths], device=cache.k.device,
        )  # (N,) each: one tensor made from the step's lists, not one a list
        j = torch.arange(max(lengths), device=cache.k.device)  # (nb,)
        tables = torch.where(j < counts[:, None], firsts[:, None] + j, 0)  # (N, nb): a run of consecutive blocks from its first, padded with block 0
        for n, s in enumerate(ids):
            if not cache._run[s]:  # blocks not consecutive: its own table
                tables[n, : len(cache._tables[s])] = torch.tensor(cache._tables[s], device=cache.k.device)
        return rows, tables, seen_to

    def _write(self, k: Tensor, v: Tensor, attention_mask: Tensor | None, check: bool) -> None:
        """Check (unless told not to), take the blocks and count the new tokens (``_place``), write the keys and values."""
        cache = self.cache
        if check:
            self._check(k, v, attention_mask)
        self._place()
        if cache.rows8:  # the rows as the pool holds them
            k, v = quantize_rows(k), quantize_rows(v)  # (1, Hkv, T, D + 4) x2
        with torch.no_grad():
            cache.k.index_copy_(1, self._where_at, k[0])  # (Hkv, N*Bs, D)
            cache.v.index_copy_(1, self._where_at, v[0])

    def _place(self) -> None:
        """Take the blocks for the new tokens, find their slots (``_where_at``) and count them in the sequences' lengths."""
        cache = self.cache
        cache._make_room(self.seq_ids, self.new_tokens)  # the free blocks too: a refused call changes nothing
        self._done = True
        self._placed_as = placed = self._placed_like()
        self._where_at = placed._where_at if placed is not None else self._where()  # (T,)
        for seq_id, a, n in zip(self.seq_ids, self.starts, self.new_tokens, strict=True):
            cache._lens[seq_id] = a + n

    def _placed_like(self) -> PagedBatch | None:
        """``like``, where it was written already and its pool holds this batch's sequences in the same blocks as this
        one's (both having taken their blocks for the new tokens): its slots and tables are then this batch's, made
        once a forward pass, not once a layer. None otherwise."""
        like, cache = self.like, self.cache
        if like is None or like._where_at is None or like.cache.block_size != cache.block_size or like.cache.k.device != cache.k.device:
            return None
        if (like.seq_ids, like.new_tokens, like.starts) != (self.seq_ids, self.new_tokens, self.starts):
            return None
        theirs = like.cache
        if cache._tables == theirs._tables and cache._gone == theirs._gone:  # pools driven alike (one comparison, not one a sequence)
            return like
        if any(cache._gone[s] != theirs._gone[s] or cache._tables[s] != theirs._tables[s] for s in self.seq_ids):
            return None
        return like

    def _where(self) -> Tensor:
        """(T,) the pool slots of the row's new tokens, packed in order."""
        cache, bs = self.cache, self.cache.block_size
        starts = [a - cache._gone[s] * bs for s, a in zip(self.seq_ids, self.starts, strict=True)]  # counted from first_held
        pairs = list(zip(self.seq_ids, starts, self.new_tokens, strict=True))
        if all(cache._run[s] for s in self.seq_ids):  # slot = first slot + position: no tensor per sequence, no list per token
            first = [cache._tables[s][0] * bs + a for s, a, _ in pairs]  # each sequence's first new slot
            if all(n == 1 for n in self.new_tokens):
                return torch.tensor(first, dtype=torch.long, device=cache.k.device)  # (T,)
            T, device = sum(self.new_tokens), cache.k.device
            from_row = torch.tensor([f - rows.start for f, rows in zip(first, self._rows, strict=True)], device=device)  # (n_seq,) slot - row
            return torch.repeat_interleave(from_row, torch.tensor(self.new_tokens, device=device), output_size=T) + torch.arange(T, device=device)  # (T,)
        return torch.cat([cache._slots[s][a : a + n] for s, a, n in pairs])  # (T,)

    def _read(self, seq_id: int) -> tuple[Tensor, Tensor]:
        """Keys and values (1, Hkv, S, D) of ``seq_id``, positions first_held .. length - 1: views or gathers (an 8-bit
        pool's rows read back in float32)."""
        cache = self.cache
        S = cache._lens[seq_id] - cache._gone[seq_id] * cache.block_size  # the positions held
        if cache._run[seq_id]:  # consecutive blocks: consecutive slots
            first = cache._tables[seq_id][0] * cache.block_size
            k, v = cache._k1.narrow(2, first, S), cache._v1.narrow(2, first, S)  # (1, Hkv, S, D) each: views
        else:
            slots = cache._slots[seq_id][:S]
            k, v = cache._k1.index_select(2, slots), cache._v1.index_select(2, slots)  # (1, Hkv, S, D) each: gathers
        return (dequantize_rows(k), dequantize_rows(v)) if cache.rows8 else (k, v)

    def check_append(self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None) -> None:
        """What ``append`` checks of the packed keys and values (1, Hkv, T, D), the pool's room included: TypeError or
        ValueError naming the problem; nothing written (``headwise.plan``, a model's check of every layer's cache before
        the first writes)."""
        self._check(k, v, attention_mask)
        self.cache.check_room(self.seq_ids, self.new_tokens)

    def _check(self, k: Tensor, v: Tensor, attention_mask: Tensor | None) -> None:
        cache, T = self.cache, sum(self.new_tokens)
        Hkv, D = cache.k.shape[0], cache.head_dim
        if self._done:
            raise ValueError("this PagedBatch was used already: make one per forward pass and layer with paged.batch(seq_ids, new_tokens)")
        if attention_mask is not None:
            raise ValueError("a PagedKVCache batch packs real tokens only: pass attention_mask=None (give each sequence only its real tokens)")
        for name, t in [("k", k), ("v", v)]:
            if t.ndim != 4 or t.shape[0] != 1 or t.shape[1] != Hkv or t.shape[2] != T or t.shape[3] != D:
                raise ValueError(f"a paged batch of {T} new tokens takes {name} of shape (1, Hkv={Hkv}, T={T}, D={D}), got {tuple(t.shape)}")
            if t.dtype != cache.dtype:
                raise TypeError(f"the PagedKVCache holds {cache.k.dtype}; {name} is {t.dtype}" + (" (an 8-bit pool takes float32)" if cache.rows8 else ""))
            _checks.same_device(name, t, "the cache is", cache.k.device)
            if torch.is_grad_enabled() and t.requires_grad:
                raise ValueError(f"{name} requires grad, but a PagedKVCache serves inference only: run under torch.no_grad()")
        for seq_id, start in zip(self.seq_ids, self.starts, strict=True):  # a sequence freed or written since this batch was made
            if cache.length(seq_id) != start:
                raise ValueError(f"seq_id {seq_id} holds {cache.length(seq_id)} tokens, not the {start} it held when this batch was made")
