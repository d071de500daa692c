"""A paged key/value cache: one pool of fixed-size blocks shared by many sequences (vLLM's PagedAttention).

The pool is (Hkv, num_blocks · Bs, D): block b is slots b·Bs .. b·Bs + Bs - 1 of every head. A
sequence holds a block table (its blocks in order): memory follows the tokens held. Forks share
blocks; a shared, partly filled last block is copied when one of them writes (copy-on-write).
A sequence whose blocks are consecutive is read as a view of the pool, any other is gathered.
Every write is checked whole before any block changes hands; the pool is for inference.

An 8-bit pool (``dtype=torch.int8``) holds a float32 model's keys and values as ``KVCache``'s 8-bit rows
(``quantize_rows``: D int8 values and a float32 scale a row): a quarter of float32's bytes and a little more.
It takes float32 keys and values (``attention`` widens a bfloat16 model's, exactly); a run of several new tokens attends over its rows read back in float32
(``dequantize_rows``), and a decode step's one-token rows are read in place by the C++ decode kernel, with
the bits of those rows read back: a sequence's tokens equal ``generate(..., cache_dtype=torch.int8)``'s.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from .. import _checks
from .owner import Owned
from .paged_batch import PagedBatch
from .static import SCALE_BYTES, Rows


class PagedKVCache(Owned, Rows):
    """One pool of key/value blocks for many sequences; one cache per attention layer.

    Args:
        num_blocks: the blocks in the pool.
        block_size: Bs, token slots per block.
        num_kv_heads: Hkv.
        head_dim: D.
        dtype, device: of the pool; keys and values written must match them (``attention`` rounds float32
            ones into a bfloat16 pool). ``torch.int8``: 8-bit rows of float32 keys and values (module docstring),
            pools (Hkv, num_blocks * Bs, D + 4); D a multiple of 4.
        window: W for sliding-window attention (then ``slide`` may give blocks back), or None.

    Example:
        >>> import headwise as hw
        >>> paged = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16)
        >>> paged.add(0); paged.add(1)
        >>> q = torch.randn(1, 4, 5 + 2, 16)                    # 5 tokens of sequence 0, then 2 of 1
        >>> k = v = torch.randn(1, 2, 7, 16)
        >>> hw.attention(q, k, v, causal=True, cache=paged.batch([0, 1], [5, 2])).shape
        torch.Size([1, 4, 7, 16])
        >>> paged.length(0), paged.length(1), paged.free_blocks
        (5, 2, 5)
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, window: int | None = None) -> None:
        num_blocks, block_size, num_kv_heads, head_dim = (
            _checks.positive_int(name, value) for name, value in
            [("num_blocks", num_blocks), ("block_size", block_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]
        )
        _checks.cache_storage("dtype", dtype, head_dim)
        device = _checks.device("device", device)
        self.block_size, self.window = block_size, _checks.window(window, causal=True)
        row = head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim  # 8-bit rows: D int8 values and a float32 scale
        with torch.inference_mode(False):  # made under inference_mode too, the pools take writes outside it (another thread's)
            self.k = torch.zeros(num_kv_heads, num_blocks * block_size, row, dtype=dtype, device=device)  # (Hkv, N*Bs, D) (+ 4 bytes)
            self.v = torch.zeros_like(self.k)  # (Hkv, N*Bs, D) (+ 4 bytes)
        self._free = list(range(num_blocks - 1, -1, -1))  # free blocks set aside for no one; pop() hands out the lowest first
        self._set_aside: dict[int, int] = {}  # free block -> the sequence it is set aside for (``add(..., reserve=)``)
        self._plan: dict[int, tuple[int, int]] = {}  # seq_id -> (first block, blocks) of the run set aside for it
        self._refs = [0] * num_blocks  # how many sequences hold each block
        self._tables: dict[int, list[int]] = {}  # seq_id -> the blocks it holds, in order
        self._gone: dict[int, int] = {}  # seq_id -> blocks given back before its table (``slide``): table[i] is block gone + i of it
        self._lens: dict[int, int] = {}  # seq_id -> tokens written
        self._slots: dict[int, Tensor] = {}  # seq_id -> (capacity,) long: the pool slot of each position from first_held
        self._run: dict[int, bool] = {}  # seq_id -> are its blocks consecutive (then a view reads them)?

    @property
    def _k1(self) -> Tensor:
        """The key pool as (1, Hkv, N*Bs, D): what a read slices; a view made at each read, never stored (a stored view
        would be pickled as a copy of its own, which the pool's writes then miss)."""
        return self.k[None]

    @property
    def _v1(self) -> Tensor:
        """The value pool as (1, Hkv, N*Bs, D), as ``_k1``."""
        return self.v[None]

    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds (set aside for a sequence or not)."""
        return len(self._free) + len(self._set_aside)

    @property
    def sequences(self) -> list[int]:
        """The ids of the open sequences."""
        return list(self._tables)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tables

    def length(self, seq_id: int) -> int:
        """Tokens written for ``seq_id``."""
        return self._lens[self._known(seq_id)]

    def first_held(self, seq_id: int) -> int:
        """The first position of ``seq_id`` whose key is still held (0 unless ``slide`` gave blocks back)."""
        return self._gone[self._known(seq_id)] * self.block_size

    def blocks(self, seq_id: int) -> list[int]:
        """The block table of ``seq_id``: the blocks it holds in order, from ``first_held`` (a copy)."""
        return list(self._tables[self._known(seq_id)])

    def blocks_needed(self, seq_id: int, new_tokens: int) -> int:
        """Free blocks that writing ``new_tokens`` more tokens for ``seq_id`` takes (a shared last block counts: it is copied)."""
        seq_id = self._known(seq_id)
        grow, copy = self._growth(seq_id, _checks.integer("new_tokens", new_tokens, low=0))
        return grow + copy

    def batch(self, seq_ids: Sequence[int], new_tokens: Sequence[int], *, compile: bool = False,
              like: PagedBatch | None = None) -> PagedBatch:
        """What ``attention(..., cache=...)`` takes: the next ``new_tokens[i]`` tokens of ``seq_ids[i]``, packed in this order.

        The sequences with one new token (a decode step's) attend in one call over their blocks, read in place,
        where headwise's C++ decode kernel is built (``headwise.plan`` says when they do); where it is not,
        ``compile=True`` lets that call over a bfloat16 pool be compiled by ``torch.compile`` at its first use.
        ``like``: another layer's batch of the same forward pass (the same sequences and counts, its pool written
        first): where that pool holds the sequences in the same blocks as this one (pools driven alike, as a model's
        layers' are), this batch takes its positions, slots and block tables instead of making them again.
        """
        return PagedBatch(self, seq_ids, new_tokens, compile=compile, like=like)

    def add(self, seq_id: int, *, reserve: int = 0) -> None:
        """Open an empty sequence ``seq_id`` (any int not open already).

        Args:
            reserve: the tokens it is expected to reach. A run of consecutive free blocks that holds them
                is set aside for it when the pool has one; it grows into that run, read as a view of the pool.
                Set-aside blocks stay free (others get them only when no other block is) until written.
        """
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"seq_id must be an int, got {type(seq_id).__name__} {seq_id!r}")
        if seq_id in self._tables:
            raise ValueError(f"seq_id {seq_id} is already in the cache: free it first, or pick another id")
        _checks.integer("reserve", reserve, low=0)
        self._tables[seq_id], self._lens[seq_id], self._run[seq_id], self._gone[seq_id] = [], 0, True, 0
        with torch.inference_mode(False):  # a slot map grows in place, in or out of inference_mode
            self._slots[seq_id] = torch.empty(0, dtype=torch.long, device=self.k.device)
        want = math.ceil(reserve / self.block_size)
        first = self._find_run(want) if want else None
        if first is not None:  # set the run aside: out of the shared free list, into this sequence's plan
            self._free = [b for b in self._free if not first <= b < first + want]
            self._set_aside.update(dict.fromkeys(range(first, first + want), seq_id))
            self._plan[seq_id] = (first, want)

    def fork(self, seq_id: int, new_id: int) -> None:
        """Open ``new_id`` holding the same tokens as ``seq_id``, sharing its blocks until one of them writes."""
        self._known(seq_id)
        if isinstance(new_id, bool) or not isinstance(new_id, int):
            raise TypeError(f"new_id must be an int, got {type(new_id).__name__} {new_id!r}")
        if new_id in self._tables:
            raise ValueError(f"new_id {new_id} is already in the cache: free it first, or pick another id")
        self.add(new_id)
        table = self._tables[seq_id]
        for block in table:
            self._refs[block] += 1
        self._tables[new_id], self._lens[new_id], self._gone[new_id] = list(table), self._lens[seq_id], self._gone[seq_id]
        self._slots[new_id], self._run[new_id] = self._slots[seq_id].clone(), self._run[seq_id]

    def free(self, seq_id: int) -> None:
        """Close ``seq_id``; its blocks no other sequence holds return to the pool."""
        for block in self._tables[self._known(seq_id)]:
            self._release(block)
        self._drop_plan(seq_id)
        del self._tables[seq_id], self._lens[seq_id], self._slots[seq_id], self._run[seq_id], self._gone[seq_id]

    def crop(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of ``seq_id``; blocks past them go back (into its set-aside run if from there).

        Raises:
            ValueError: an unknown ``seq_id``, or a length outside 0 .. length(seq_id), or (a sliding
                cache) one whose next query would need keys ``slide`` gave back already.
        """
        held, first_held = self._lens[self._known(seq_id)], self.first_held(seq_id)
        low = first_held + self.window - 1 if first_held else 0  # the next query sees keys from length - window + 1 on
        held_from = f", keys from position {first_held} on" if first_held else ""
        _checks.integer(f"length (seq_id {seq_id} holds {held} tokens{held_from})", length, low=low, high=held)
        table, gone = self._tables[seq_id], self._gone[seq_id]
        while (gone + len(table) - 1) * self.block_size >= length:  # the last block starts past the kept tokens
            self._release(table.pop(), seq_id, gone + len(table))
        self._run[seq_id] = _consecutive(table)
        self._lens[seq_id] = length

    def slide(self, seq_id: int) -> int:
        """Give back the blocks of ``seq_id`` wholly before the window of every query still to come (the next,
        at position ``length``, sees keys from length - window + 1 on); returns how many went back. Nothing is
        written: a caller that may still roll back (``crop``) a write slides after it commits.

        Raises:
            ValueError: an unknown ``seq_id``, or a cache made without ``window``.
        """
        self._known(seq_id)
        if self.window is None:
            raise ValueError("slide needs a cache made with window=W (sliding-window attention), got window=None")
        table, bs = self._tables[seq_id], self.block_size
        drop = min(len(table), max(0, self._lens[seq_id] - self.window + 1) // bs - self._gone[seq_id])
        if drop <= 0:
            return 0
        self._drop_plan(seq_id)  # a sliding sequence grows past its run
        for block in table[:drop]:
            self._release(block)
        kept = self._tables[seq_id] = table[drop:]
        self._gone[seq_id] += drop
        self._slots[seq_id] = self._slots[seq_id][drop * bs :].clone()
        self._run[seq_id] = _consecutive(kept)
        return drop

    def _known(self, seq_id: object) -> int:
        if isinstance(seq_id, bool) or not isinstance(seq_id, int):
            raise TypeError(f"seq_id must be an int (as add took it), got {type(seq_id).__name__} {seq_id!r}")
        if seq_id not in self._tables:
            open_ids = sorted(self._tables)
            shown = open_ids if len(open_ids) <= 10 else [*open_ids[:10], "..."]
            raise ValueError(f"seq_id {seq_id!r} is not in the cache (freed already, or never added); open ids: {shown}")
        return seq_id

    def _find_run(self, want: int) -> int | None:
        """The first block of the lowest run of ``want`` consecutive free blocks set aside for no one, or None."""
        free = sorted(self._free)
        for i in range(len(free) - want + 1):
            if free[i + want - 1] - free[i] == want - 1:  # distinct and sorted: consecutive
                return free[i]
        return None

    def _take(self, seq_id: int, index: int) -> int:
        """A free block to be block ``index`` of ``seq_id`` (counting those ``slide`` gave back): the one set aside for it there, else
        one set aside for no one, else (the pool is that full) the last block set aside for another sequence."""
        first, count = self._plan.get(seq_id, (0, 0))
        if index < count and self._set_aside.get(first + index) == seq_id:
            del self._set_aside[first + index]
            return first + index
        if self._free:
            return self._free.pop()
        block = max(self._set_aside)  # the caller checked that enough blocks are free
        del self._set_aside[block]
        return block

    def _release(self, block: int, seq_id: int | None = None, index: int = 0) -> None:
        """Drop one hold on ``block``; once no one holds it, it is free: set aside for ``seq_id`` again if it is block
        ``index`` of the run set aside for it (it grows into the same blocks again), else for anyone."""
        self._refs[block] -= 1
        first, count = self._plan.get(seq_id, (0, 0))
        if self._refs[block] == 0 and index < count and block == first + index:
            self._set_aside[block] = seq_id
        elif self._refs[block] == 0:
            self._free.append(block)

    def _drop_plan(self, seq_id: int) -> None:
        """Give back what was set aside for ``seq_id`` and it has not taken."""
        first, count = self._plan.pop(seq_id, (0, 0))
        for block in range(first, first + count):
            if self._set_aside.get(block) == seq_id:
                del self._set_aside[block]
                self._free.append(block)

    def _growth(self, seq_id: int, new_tokens: int) -> tuple[int, bool]:
        """(blocks to append, whether the shared, partly filled last block is copied first) for ``new_tokens`` more tokens."""
        n, table = self._lens[seq_id], self._tables[seq_id]
        grow = -(-(n + new_tokens) // self.block_size) - self._gone[seq_id] - len(table)
        return grow, n % self.block_size != 0 and new_tokens > 0 and self._refs[table[-1]] > 1

    def check_room(self, seq_ids: Sequence[int], counts: Sequence[int]) -> list[tuple[int, bool]]:
        """A ValueError unless the pool has the blocks that writing ``counts[i]`` new tokens of each ``seq_ids[i]`` takes
        (copy-on-write too); nothing is changed. Returns each sequence's growth (``_growth``). TypeError or ValueError
        for ids not open here or repeated, counts that are not ints >= 0, or lists of different lengths."""
        for name, value in (("seq_ids", seq_ids), ("counts", counts)):
            if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
                raise TypeError(f"{name} must be a list of ints, got {type(value).__name__}")
        seq_ids, counts = list(seq_ids), list(counts)
        if len(seq_ids) != len(counts):
            raise ValueError(f"seq_ids and counts must be the same length, got {len(seq_ids)} ids and {len(counts)} counts")
        seq_ids = [self._known(s) for s in seq_ids]
        if len(set(seq_ids)) != len(seq_ids):  # each id's growth is counted from its length now: a repeat would count it twice
            raise ValueError(f"seq_ids must not repeat (one count per sequence), got {seq_ids}")
        counts = [_checks.integer(f"counts[{i}]", n, low=0) for i, n in enumerate(counts)]
        return self._room(seq_ids, counts)

    def _room(self, seq_ids: Sequence[int], counts: Sequence[int]) -> list[tuple[int, bool]]:
        """``check_room`` for ids and counts checked already."""
        growth = [self._growth(s, n) for s, n in zip(seq_ids, counts, strict=True)]
        needed = sum(grow for grow, _ in growth)
        if any(copy for _, copy in growth):  # (forked sequences only)
            writers = collections.Counter(self._tables[s][-1] for s, (_, copy) in zip(seq_ids, growth, strict=True) if copy)
            # a shared block's writers copy it while another holds it: the last of all its holders writes in place
            needed += sum(min(n, self._refs[block] - 1) for block, n in writers.items())
        if needed > self.free_blocks:
            raise ValueError(
                f"the PagedKVCache pool is exhausted: writing {sum(counts)} tokens needs {needed} free blocks, "
                f"{self.free_blocks} of {self.num_blocks} are free (block_size={self.block_size}); free finished sequences "
                "or make the pool bigger. Nothing was written"
            )
        return growth

    def _make_room(self, seq_ids: Sequence[int], counts: Sequence[int]) -> None:
        """Give each sequence the blocks its ``counts`` new tokens need (copy-on-write too), or a ValueError, nothing changed."""
        growth = self._room(seq_ids, counts)
        for seq_id, n, (grow, copy) in zip(seq_ids, counts, growth, strict=True):
            if not grow and not copy:
                continue
            table, bs = self._tables[seq_id], self.block_size
            if copy:  # asked again after the sequences before it: a block one copied may be no longer shared
                grow, copy = self._growth(seq_id, n)
            if copy:  # the last block, shared and partly filled, is swapped for a copy of it
                old = table.pop()
                self._refs[old] -= 1
                self._run[seq_id] = _consecutive(table)
                new = self._append_block(seq_id)
                self.k[:, new * bs : (new + 1) * bs] = self.k[:, old * bs : (old + 1) * bs]  # (Hkv, Bs, D): the block's keys
                self.v[:, new * bs : (new + 1) * bs] = self.v[:, old * bs : (old + 1) * bs]
            for _ in range(grow):
                self._append_block(seq_id)

    def _append_block(self, seq_id: int) -> int:
        """Take a free block for the end of the table of ``seq_id`` and map its slots; returns the block."""
        table, bs = self._tables[seq_id], self.block_size
        index = len(table)
        block = self._take(seq_id, self._gone[seq_id] + index)
        table.append(block)
        self._run[seq_id] = index == 0 or (self._run[seq_id] and block == table[index - 1] + 1)
        self._refs[block] += 1
        slots = self._slots[seq_id]
        if slots.numel() < len(table) * bs:  # grow the slot map by doubling: one copy per doubling, not per block
            with torch.inference_mode(False):
                grown = torch.empty(max(2 * slots.numel(), len(table) * bs), dtype=torch.long, device=slots.device)
                grown[: slots.numel()] = slots
            self._slots[seq_id] = slots = grown
        slots[index * bs : (index + 1) * bs] = torch.arange(block * bs, (block + 1) * bs, device=slots.device)
        return block


def _consecutive(table: list[int]) -> bool:
    return all(b == table[0] + i for i, b in enumerate(table))
