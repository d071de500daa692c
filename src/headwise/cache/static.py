"""``KVCache``: preallocated (B, Hkv, max_len, D) key and value buffers written in place, nothing
grows; ``KVCache.sliding(B, Hkv, window, D)``, a ring of ``window`` slots whose memory stays bounded.

``len(cache)`` counts the tokens written (a ring keeps counting). Padding: once any write came
with an ``attention_mask``, the cache hands its (B, S) record of real tokens on with every read
(``padded``), so decode steps after a left-padded prefill need no mask, and the next tokens'
positions count each row's real tokens only (``start``); a cache never given one hands on None,
and the next position is ``len(cache)``. It never reads a mask's values on the host.

An 8-bit cache (``dtype=torch.int8``) keeps each (token, head) row of D float32 values as D int8 values and one
float32 scale (``quantize_rows``): a quarter of float32's bytes and a little more, the layout of llama.cpp's q8_0
rows. It takes float32 keys and values, and answers with the rows it holds read back in float32
(``dequantize_rows``); ``generate``'s decode steps read them in place in the C++ decode kernel. Autograd cannot
record through the rounding: such a write is refused.

Training through a cache: while autograd records, attention gets the stored keys concatenated
with the new ones (gradients reach every step's keys and values, as in one forward over the
whole sequence); the buffers only ever get plain copies, so a ``reset`` starts clean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import _checks
from ..masks import positions
from .owner import Owned
from .protocol import Attended
from .spent import Spendable

#: What an 8-bit row holds beyond its D values: its float32 scale, in 4 bytes.
SCALE_BYTES = 4


def quantize_rows(x: Tensor) -> Tensor:
    """(..., D) float -> (..., D + 4) int8: each row's values rounded to int8 with the row's scale, max |x| / 127
    (x / scale to nearest, ties to even), the scale's float32 bytes after them. A row of zeros, or one holding inf or
    NaN, is stored as zeros with its scale (0, inf or NaN), so that it reads back as zeros, or NaN, never as a wrong
    number. The C++ decode step rounds the rows it writes the same way, bit for bit."""
    x = x.float()
    if x.numel() == 0:  # no row (a call of no new token): an (..., 1) scale of none cannot be viewed as bytes
        return x.new_empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8)  # (..., D + 4)
    scale = x.abs().amax(-1, keepdim=True) / 127  # (..., 1); NaN where a value is
    rounded = torch.where(scale.isfinite() & (scale > 0), x / scale, 0.0).round().clamp(-127, 127)  # (..., D)
    return torch.cat([rounded.to(torch.int8), scale.view(torch.int8)], dim=-1)  # (..., D + 4)


def dequantize_rows(rows: Tensor) -> Tensor:
    """(..., D + 4) int8 rows of ``quantize_rows`` -> (..., D) float32: each value times its row's scale."""
    D = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., D:].clone(memory_format=torch.contiguous_format).view(torch.float32)  # (..., 1): a copy of its own, 4-byte aligned
    return rows[..., :D].float() * scale  # (..., D)


class Rows:
    """What a cache's buffers ``k`` (and ``v``) hold, rows of D values last: float rows, or 8-bit ones (``quantize_rows``).
    The base of ``KVCache`` and ``PagedKVCache``."""

    k: Tensor

    @property
    def rows8(self) -> bool:
        """Whether the buffers hold 8-bit rows (``quantize_rows``: D int8 values and a float32 scale a row)."""
        return self.k.dtype == torch.int8

    @property
    def stored(self) -> torch.dtype:
        """What the buffers' elements are: ``dtype``, or torch.int8 for 8-bit rows."""
        return self.k.dtype

    @property
    def head_dim(self) -> int:
        """D, the keys' and values' size a head (an 8-bit row holds its scale besides)."""
        return self.k.shape[-1] - (SCALE_BYTES if self.rows8 else 0)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the keys and values it takes and answers with (the cache protocol): what the buffers hold, or
        float32 for 8-bit rows (the buffers' dtype is then ``k.dtype``, int8)."""
        return torch.float32 if self.rows8 else self.k.dtype


class KVCache(Owned, Spendable, Rows):
    """Preallocated (B, Hkv, L, D) key/value buffers, L = max_len (or window when sliding).

    Args:
        batch_size: B.
        num_kv_heads: Hkv, the key/value heads (fewer than the query heads under GQA).
        max_len: the most tokens this cache can hold.
        head_dim: D.
        dtype, device: of the buffers; keys and values written must match them (``attention`` rounds float32
            ones into a bfloat16 cache: half the bytes, attention in bfloat16). ``torch.int8``: 8-bit rows of
            float32 keys and values (module docstring), buffers (B, Hkv, L, D + 4); D a multiple of 4.

    Example:
        >>> import headwise as hw
        >>> mha = hw.MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12).eval()
        >>> cache = KVCache(1, 12, 1024, 64)
        >>> y = mha(torch.randn(1, 5, 768), cache=cache)  # prefill: (1, 5, 768)
        >>> y = mha(torch.randn(1, 1, 768), cache=cache)  # one step: (1, 1, 768)
        >>> len(cache)
        6
    """

    def __init__(self, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        batch_size, num_kv_heads, max_len, head_dim = (
            _checks.positive_int(name, value) for name, value in
            [("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("max_len", max_len), ("head_dim", head_dim)]
        )
        _checks.cache_storage("dtype", dtype, head_dim)
        device = _checks.device("device", device)
        self.window: int | None = None  # set by ``sliding``: then the buffers are a ring
        row = head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim  # 8-bit rows: D int8 values and a float32 scale
        with torch.inference_mode(False):  # made under inference_mode too, the buffers take writes outside it
            self.k = torch.zeros(batch_size, num_kv_heads, max_len, row, dtype=dtype, device=device)  # (B, Hkv, L, D) (+ 4 bytes)
            self.v = torch.zeros_like(self.k)  # (B, Hkv, L, D) (+ 4 bytes)
            self.is_token = torch.ones(batch_size, max_len, dtype=torch.bool, device=device)  # (B, L) True = real token
        self._padded = False  # did any stored position come with a padding mask?
        self._pads: Tensor | None = None  # (B,) padding tokens written to each row; None while no write had any mask
        self._len = 0
        self._graph: tuple[int, Tensor, Tensor] | None = None  # (first position, keys, values) that autograd recorded
        self._owner, self._spent, self._epoch = None, False, 0  # in the instance from the start: torch.compile guards their values

    @classmethod
    def sliding(cls, batch_size: int, num_kv_heads: int, window: int, head_dim: int, *,
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> KVCache:
        """A ring buffer of ``window`` positions for sliding-window attention (``window=W``)."""
        window = _checks.positive_int("window", window)
        cache = cls(batch_size, num_kv_heads, window, head_dim, dtype=dtype, device=device)
        cache.window = window
        return cache

    def __len__(self) -> int:
        return self._len

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def padded(self) -> bool:
        """Whether any stored position came with a padding mask (the cache protocol)."""
        return self._padded

    def reset(self) -> None:
        """Forget every stored token (the buffers are reused, not reallocated); the cache stays bound to its module."""
        self._len = 0
        self._padded = False
        self._pads = None
        self._graph = None
        self.forget_recorded()
        self.is_token.fill_(True)

    def detach(self) -> None:
        """Keep the stored tokens as values only: later gradients stop at them (backpropagation through time cut here,
        as an RNN's state is detached). For training a step at a time after a backward has gone through the tokens'
        recorded keys and values (autograd freed their graph), which a forward that records then refuses."""
        self._graph = None
        self.forget_recorded()

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` tokens (e.g. to rewind after a rejected draft).

        Raises:
            TypeError: a length that is not an int.
            ValueError: for a sliding cache (the older slots are overwritten), or a length
                outside 0 .. len(cache).
        """
        if self.window is not None:
            raise ValueError(f"a sliding cache (window={self.window}) cannot be cropped: its older slots are overwritten")
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"length must be an int in [0, len(cache)={self._len}], got {length!r}")
        if not 0 <= length <= self._len:
            raise ValueError(f"length must be an int in [0, len(cache)={self._len}], got {length!r}")
        if self._padded:  # forget the dropped positions' padding (never padded: all True already)
            self.is_token[:, length : self._len] = True
            self._pads = (~self.is_token[:, :length]).sum(-1)  # (B,)
        self._len = length
        if self._graph is not None:
            first, gk, gv = self._graph
            self._graph = None if length <= first else (first, gk[:, :, : length - first], gv[:, :, : length - first])
        if length == 0:
            self._padded = False
            self._pads = None

    def _check(self, k: Tensor, v: Tensor, attention_mask: Tensor | None) -> Tensor | None:
        (B, Hkv, _, _), D = self.k.shape, self.head_dim
        for name, t in [("k", k), ("v", v)]:
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor of shape (B={B}, Hkv={Hkv}, T, D={D}), got {type(t).__name__}")
            if t.ndim != 4 or t.shape[0] != B or t.shape[1] != Hkv or t.shape[3] != D:
                raise ValueError(f"cache holds (B={B}, Hkv={Hkv}, *, D={D}); {name} has shape {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(f"cache holds {self.k.dtype}; {name} is {t.dtype}" + (" (an 8-bit cache takes float32)" if self.rows8 else ""))
            _checks.same_device(name, t, "the cache is", self.k.device)
            if self.rows8 and t.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{name} requires grad: an 8-bit cache rounds what it stores, and autograd cannot record "
                                 "through that rounding; use a float32 or bfloat16 cache to train through one")
        if v.shape[2] != k.shape[2]:
            raise ValueError(f"k and v must hold the same tokens, got T={k.shape[2]} keys and T={v.shape[2]} values")
        if self._spent and self._graph is not None and torch.is_grad_enabled():
            raise ValueError(
                "a backward has gone through the keys and values autograd recorded in this cache, and freed their graph: "
                "call cache.detach() to go on from their values (gradients stop there), cache.reset() to start again, or "
                "sum the steps' losses and call backward once"
            )
        attention_mask = _checks.attention_mask(attention_mask, B, k.shape[2], "(B, T)", device=("the cache is", self.k.device))
        self.check_room(k.shape[2])
        return attention_mask

    def check_room(self, t: int, name: str = "cache") -> None:
        """A ValueError (``name`` "is full") unless this cache takes ``t`` more tokens (a sliding one takes any)."""
        if self.window is None and self._len + t > self.k.shape[2]:
            held, room = int(self._len), int(self.k.shape[2])  # (ints: a traced SymInt cannot be formatted into the message)
            raise ValueError(f"{name} is full: it holds {held} of max_len={room} tokens and cannot take {int(t)} more")

    def sizes(self, t: int, *, in_order: bool = False) -> list[tuple[slice, int]]:
        """What ``append`` of ``t`` new tokens will answer with, before anything is written:
        ``[(rows, S)]``, every query over S keys (the cache protocol)."""
        if self.window is None:
            return [(slice(None), self._len + t)]
        if t == 1 and not in_order:
            return [(slice(None), min(self._len + 1, self.window))]
        return [(slice(None), min(self._len, self.window) + t)]

    def update(
        self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None, *, in_order: bool = False
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store the new tokens' keys and values; return everything a query must attend over.

        Args:
            k, v: (B, Hkv, T, D) keys and values of the T new tokens.
            attention_mask: (B, T) padding of the new tokens only, 1/True = real token.

        Returns:
            ``(keys, values, attention_mask)``: (B, Hkv, S, D), (B, Hkv, S, D) and (B, S) or None
            (no stored position is padding). S counts the cached tokens (a sliding cache's last
            ``window``) and the new ones, in time order, except that a sliding cache given one new
            token answers with its W slots in ring order (``in_order=True``: time order there too,
            at the cost of a gather). Bottom-right causal attention over them equals attention over
            the whole sequence. The linear cache answers with views of its buffers.

        Raises:
            TypeError, ValueError: keys, values or padding that do not fit this cache, or more
                tokens than it has room for; nothing is written then.
        """
        (part,) = self.append(k, v, attention_mask, in_order=_checks.boolean("in_order", in_order))
        return part.keys, part.values, part.attention_mask

    def longest(self, t: int, attention_mask: Tensor | None = None) -> int:
        """The most real tokens a row holds once ``t`` more are written (``attention_mask`` (B, T) bool their padding, or
        None): ``len(cache) + t`` where no write had padding, else each row's count without its padding, read from the
        device (one host read; a meta cache or mask, which hold no values, counts every slot)."""
        if (self._pads is None and attention_mask is None) or not _checks.has_values(self.is_token) or (
                attention_mask is not None and not _checks.has_values(attention_mask)):
            return self._len + t
        held = self._len - (0 if self._pads is None else self._pads)  # (B,) or an int
        new = t if attention_mask is None else attention_mask.sum(-1)  # (B,) or an int
        return int(torch.as_tensor(held + new).max())  # (the one host read)

    def start(self, t: int, attention_mask: Tensor | None = None) -> int | Tensor:
        """Where the ``t`` new tokens sit (the cache protocol): the tokens written so far, one int for every row; once
        a write had padding, (B, T) positions: each row's real tokens so far, then its new real tokens counted
        (``attention_mask`` (B, T) bool, their padding, or None), as HuggingFace's ``generate`` numbers them."""
        if self._pads is None:
            return self._len
        real = self._len - self._pads[:, None]  # (B, 1)
        return positions(attention_mask, real.shape[0], t, real.device, start=real)  # (B, T)

    def append(
        self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None, *, in_order: bool = False, check: bool = True
    ) -> list[Attended]:
        """``update``, answered as the cache protocol's one ``Attended``. ``check=False`` skips the checks, for a
        decode loop that made them once (keys and values of this cache's kind, room, no padding, autograd off)."""
        if check:
            attention_mask = self._check(k, v, attention_mask)  # (B, T) bool or None
        return [Attended(slice(None), *self._write(k, v, attention_mask, in_order))]

    def check_append(self, k: Tensor, v: Tensor, attention_mask: Tensor | None = None) -> None:
        """What ``append`` checks of the new tokens' keys and values (B, Hkv, T, D) and padding (B, T), the room
        included: TypeError or ValueError naming the problem; nothing written (``headwise.plan``, a model's check of
        every layer's cache before the first writes, a step whose op writes the cache itself)."""
        self._check(k, v, attention_mask)

    def append_stored(self, k: Tensor, v: Tensor, *, check: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
        """``append`` of one token's keys and values (B, Hkv, 1, D) without padding, answered with the rows as the
        buffers hold them (an 8-bit cache's int8 rows and their scales, (B, Hkv, S, D + 4), not read back), for a step
        whose kernel reads them in place (``functional.KernelCall.after_write``); and the (B, S) padding marks where any
        write had padding, else None."""
        if check:
            self._check(k, v, None)
        return self._write(k, v, None, False, stored=True)

    def write_one_unchecked(self, run: Callable[[Tensor, Tensor, Tensor | None, int], Tensor]) -> Tensor:
        """A one-token step whose op writes this (whole, not sliding) cache itself, for a decode loop that checked the
        rest once (``functional.decode_kernel_call``): ``run(k, v, is_token, slot)`` gets the buffers (B, Hkv, L, D),
        the (B, L) padding marks where any write had padding (else None) and the slot the token takes; then the cache
        holds one token more. Returns what ``run`` returns. A full cache is a ValueError, before anything is written."""
        start = self._len
        self.check_room(1)
        out = run(self.k, self.v, self.is_token if self._padded else None, start)
        self._len = start + 1
        return out

    def _write(
        self, k: Tensor, v: Tensor, attention_mask: Tensor | None, in_order: bool, stored: bool = False
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Store checked keys, values and padding; return what the queries attend over (``update``'s answer; with
        ``stored``, an 8-bit cache's rows as stored)."""
        if attention_mask is not None:  # not asking whether it holds any padding: that would be a host sync
            self._padded = True
            pads = (~attention_mask).sum(-1)  # (B,)
            self._pads = pads if self._pads is None else self._pads + pads
        recording = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad or self._graph is not None)
        T, start = k.shape[2], self._len
        read = dequantize_rows if self.rows8 and not stored else _as_stored  # the buffers' rows as attention reads them
        if self.rows8:  # the rows as stored; the new tokens then attend as the cache will answer later
            k, v = quantize_rows(k), quantize_rows(v)  # (B, Hkv, T, D + 4) x2
        if not recording and self.window is None:  # views of the buffers, nothing copied (an 8-bit cache's read back)
            end = start + T
            self.k[:, :, start:end] = k
            self.v[:, :, start:end] = v
            if attention_mask is not None:
                self.is_token[:, start:end] = attention_mask
            self._len = end
            return read(self.k[:, :, :end]), read(self.v[:, :, :end]), self.is_token[:, :end] if self._padded else None
        new_is_token = attention_mask if attention_mask is not None else self.is_token.new_ones(k.shape[0], T)  # (B, T)
        if not recording and T == 1 and not in_order:  # write first: the slot it overwrites holds position start - W, outside the window
            if _checks.compiling():  # a tensor index: an int would make Dynamo specialise on the slot, a slice at
                slot = self._slots(start, start + 1)  # a symbolic offset makes inductor guard on it; (1,)
                self.k.index_copy_(2, slot, k)
                self.v.index_copy_(2, slot, v)
                self.is_token.index_copy_(1, slot, new_is_token)
            else:  # eager: slices, no index tensor made each step
                slot = start % self.window
                self.k[:, :, slot : slot + 1] = k
                self.v[:, :, slot : slot + 1] = v
                self.is_token[:, slot : slot + 1] = new_is_token
            self._len = start + 1
            n = torch.sym_min(self._len, self.window)  # the stored slots (order does not matter for a single query); an int in eager
            return read(self.k[:, :, :n]), read(self.v[:, :, :n]), self.is_token[:, :n] if self._padded else None
        # the past in time order, then the new tokens: the oldest new query may need keys the write overwrites
        first = 0 if self.window is None else max(0, start - self.window)  # the oldest position a new query may need
        keys = read(torch.cat([self._past(self.k, 1, first, start), k], dim=2))  # (B, Hkv, S, D)
        values = read(torch.cat([self._past(self.v, 2, first, start), v], dim=2))  # (B, Hkv, S, D)
        is_token = torch.cat([self._stored(self.is_token, first, start), new_is_token], dim=1)  # (B, S)
        keep = T if self.window is None else min(T, self.window)  # a ring keeps the last W
        slots = self._slots(start + T - keep, start + T)  # (keep,)
        with torch.no_grad():  # the buffers hold values only; autograd keeps its own copy in _graph
            self.k[:, :, slots] = k[:, :, T - keep :]
            self.v[:, :, slots] = v[:, :, T - keep :]
            self.is_token[:, slots] = new_is_token[:, T - keep :]
        self._len = start + T
        if recording:
            held = keys.shape[2] if self.window is None else min(keys.shape[2], self.window)
            self._graph = (start + T - held, keys[:, :, -held:], values[:, :, -held:])
            self.mark_on_backward((keys, values))  # a backward through them frees the graph the next steps would extend
        return keys, values, is_token if self._padded else None

    def _slots(self, first: int, end: int) -> Tensor:
        """(end - first,) the buffer slots of positions first .. end-1."""
        positions = torch.arange(first, end, device=self.k.device)
        return positions if self.window is None else positions % self.window

    def _stored(self, buffer: Tensor, first: int, end: int) -> Tensor:
        """Positions first .. end-1 of a buffer ((B, Hkv, L, D) or (B, L)), oldest first."""
        at = slice(first, end) if self.window is None or first >= end else self._slots(first, end)
        return buffer[:, at] if buffer.ndim == 2 else buffer[:, :, at]

    def _past(self, buffer: Tensor, index: int, first: int, end: int) -> Tensor:
        """Positions first .. end-1 in time order: autograd's copy (``_graph[index]``) where it has one, else the buffer's."""
        if self._graph is None:
            return self._stored(buffer, first, end)
        start, recorded = self._graph[0], self._graph[index]
        a, b = max(first, start), min(end, start + recorded.shape[2])
        if a >= b:
            return self._stored(buffer, first, end)
        parts = [self._stored(buffer, first, a), recorded[:, :, a - start : b - start], self._stored(buffer, b, end)]
        return torch.cat(parts, dim=2)


def _as_stored(rows: Tensor) -> Tensor:
    """A float cache's rows, as attention reads them: themselves."""
    return rows
