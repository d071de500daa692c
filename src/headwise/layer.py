"""The one attention path every multi-head module runs: project -> split -> attend -> merge -> project.

``AttentionLayer.forward`` is written once. A module says only what differs, in four small
methods, and keeps its own parameter names and state-dict layout:

- ``project_qkv(x)``: queries (B, T, H·D), keys and values (B, T, Hkv·D), e.g. three
  Linear layers (the book) or one fused ``c_attn`` split in three (GPT-2);
- ``position(q, k, start, attention_mask, position_ids)``: whatever a position encoding does
  to the split heads before the cache write (identity here; ``headwise.models.llama``'s rotary
  embeddings plug in here): the new tokens sit at ``start`` (the cache length) onwards, or
  where the caller's ``position_ids`` say;
- ``project_out(context)``: (B, T, H·D) -> (B, T, C), e.g. ``out_proj``;
- for cross-attention, ``project_q(x)`` and ``project_kv(context)``: queries from x, keys and
  values from another sequence (B, S, kv_dim);
- the attributes read below: ``d_in``, ``head_dim``, ``context_length``, ``causal``,
  ``window``, ``backend`` and ``attn_dropout_p``; optionally ``kv_dim``, ``softcap``, a
  ``sinks`` parameter (H,) and an ``alibi_slopes`` buffer (H,).

Cross-attention (``forward(x, context=...)``) runs the same path: queries from x, keys and
values from the context, never causal (the context is another sequence: a query sees all of
it, less its padding ``context_mask``). A ``ContextCache`` keeps the context's projected keys
and values from the first call, so decode steps do not project the encoder's output again.

The steps are reported to ``headwise.observe`` under the names ``headwise explain`` shows.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from . import _checks
from .cache import Cache, KVCache, checked
from .functional import attention, attention_unchecked, merge_heads, split_heads
from .masks import inert_padding
from .observe import report


def checked_input(
    module: nn.Module, x: Tensor, attention_mask: Tensor | None, *, name: str = "x", past: int = 0, sliding: bool = False
) -> tuple[Tensor, Tensor | None]:
    """What every attention module checks first, for ``module`` (``d_in``, ``context_length``).

    x must be (B, T, d_in) floats on the module's device and dtype; the padding mask (B, T)
    becomes bool; ``past`` cached tokens plus T must fit ``context_length`` (unless
    ``sliding``). Returns x with NaN/Inf at padded tokens zeroed (padding is inert) and the mask.
    """
    b, t = _checks.tokens(x, module.d_in, name)
    _checks.module_input(module, x, name)
    attention_mask = _checks.attention_mask(attention_mask, b, t, device=(name + " is", x.device))  # (B, T) bool or None
    _checks.context(t, past, module.context_length, sliding=sliding)
    return inert_padding(x, attention_mask), attention_mask  # (B, T, d_in), (B, T) or None


class ContextCache:
    """Cross-attention's cache: the context's keys and values (B, Hkv, S, D), projected once.

    The first forward given it (with a ``context``) projects and stores them; later forwards
    attend over the stored ones, with or without the context passed again. A forward given
    another context (another tensor with other values, or another ``context_mask``) attends over
    that context: it is projected and stored in place of the old one. Like a ``KVCache``, a
    ``ContextCache`` belongs to the one module that filled it (another module's keys are other
    numbers): another module given it gets a ValueError.

    Example:
        >>> import torch, headwise as hw
        >>> cross = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, causal=False, kv_dim=6)
        >>> memory, cache = torch.randn(1, 5, 6), hw.ContextCache()
        >>> y = cross(torch.randn(1, 1, 8), context=memory, cache=cache)  # projects the 5 context tokens
        >>> y = cross(torch.randn(1, 1, 8), cache=cache)  # reuses them
        >>> len(cache)
        5
    """

    def __init__(self) -> None:
        self.k: Tensor | None = None  # (B, Hkv, S, D)
        self.v: Tensor | None = None  # (B, Hkv, S, D)
        self.real: Tensor | None = None  # (B, S) True = real context token, or None (no padding)
        self._context: Tensor | None = None  # (B, S, kv_dim) what k and v were projected from
        self._version: int | None = None  # its version counter then (None: not tracked, inference mode)
        self._owner: weakref.ref | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def reset(self) -> None:
        """Forget the stored context (the next forward projects a new one); the cache stays with its module."""
        self.k = self.v = self.real = self._context = self._version = None

    def check_owner(self, owner: object) -> None:
        """Raise ValueError (changing nothing) if this cache belongs to another module than ``owner`` (still alive)."""
        bound = None if self._owner is None else self._owner()
        if bound is not None and bound is not owner:
            raise ValueError(
                f"this ContextCache belongs to {type(bound).__name__} at {id(bound):#x}, not to {type(owner).__name__} at "
                f"{id(owner):#x}: its keys and values are that module's projections; give every cross-attention layer a cache of its own"
            )

    def holds(self, context: Tensor, context_mask: Tensor | None) -> bool:
        """Whether the stored keys are those of ``context`` (B, S, kv_dim) with padding ``context_mask`` (B, S) bool or None:
        the same tensor, unchanged since, or equal values (one comparison, read on the host)."""
        if self._context is None or (self.real is None) != (context_mask is None):
            return False
        if self.real is not None and not torch.equal(self.real, context_mask):
            return False
        if context is self._context:
            return self._version is not None and _version(context) == self._version
        unchanged = self._version is not None and _version(self._context) == self._version
        return unchanged and context.shape == self._context.shape and torch.equal(context, self._context)

    def _store(self, owner: object, context: Tensor, keys: Tensor, values: Tensor, real: Tensor | None) -> None:
        self.k, self.v, self.real, self._context, self._version = keys, values, real, context, _version(context)
        self._owner = weakref.ref(owner)


def _version(t: Tensor) -> int | None:
    """``t``'s version counter (it counts in-place writes), or None where it is not tracked (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


class AttentionLayer(nn.Module):
    """Base of the multi-head modules: ``forward(x, *, attention_mask=None, cache=None)``."""

    d_in: int
    head_dim: int
    context_length: int
    causal: bool
    window: int | None
    backend: str
    input_name: str = "x"

    @property
    def attn_dropout_p(self) -> float:
        """Dropout probability on the attention weights now (0.0 in eval mode)."""
        raise NotImplementedError

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, d_in) -> queries (B, T, H·D), keys (B, T, Hkv·D), values (B, T, Hkv·D)."""
        raise NotImplementedError

    def position(
        self, q: Tensor, k: Tensor, start: int, attention_mask: Tensor | None, position_ids: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Position-encode q (B, H, T, D) and k (B, Hkv, T, D) of tokens ``start`` .. ``start + T - 1``
        (or at ``position_ids`` (B, T) when the caller gave them)."""
        return q, k

    def project_out(self, context: Tensor) -> Tensor:
        """(B, T, H·D) merged context -> (B, T, C)."""
        raise NotImplementedError

    def project_q(self, x: Tensor) -> Tensor:
        """(B, T, d_in) -> queries (B, T, H·D), for cross-attention."""
        raise TypeError(f"{type(self).__name__} has no separate query projection: it cannot take a context (cross-attention)")

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S, kv_dim) context -> keys and values (B, S, Hkv·D), for cross-attention."""
        raise TypeError(f"{type(self).__name__} has no separate key/value projection: it cannot take a context (cross-attention)")

    def score_terms(self) -> dict:
        """The module's score terms for ``attention``: softcap, sinks, ALiBi slopes (None where absent)."""
        return {
            "softcap": getattr(self, "softcap", None),
            "sinks": getattr(self, "sinks", None),
            "alibi_slopes": getattr(self, "alibi_slopes", None),
        }

    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: Cache | ContextCache | None = None,
        position_ids: Tensor | None = None,
        documents: Tensor | None = None,
    ) -> Tensor:
        """Attend over the tokens of x (and, with a cache, over every token cached before), or over a context.

        Args:
            x: (B, T, d_in).
            context: (B, S, kv_dim) another sequence (an encoder's output) for cross-attention:
                queries from x, keys and values from the context, every context token visible.
            context_mask: (B, S) the context's padding, 1/True = real token (a filled
                ``ContextCache`` remembers it, as it remembers the context's keys).
            attention_mask: (B, T) padding mask, 1/True = real token, 0/False = padding (left
                or right); with a cache, for the new tokens only (the cache remembers the rest).
            cache: a ``KVCache`` of (B, Hkv, *, D); x then holds the next tokens. Or a
                ``PagedKVCache.batch(...)``: x (1, T, d_in) packs the next tokens of several
                sequences, each placed after its own cached tokens.
                With a context: a ``ContextCache``, filled at the first call and reused after.
            position_ids: (B, T) ints, where x's tokens sit, for a layer with a position
                encoding (HuggingFace's ``position_ids``); default: counted from the cache length.
            documents: (B, S) document ids of packed rows (``headwise.attention``'s): a token
                sees only tokens of its own document; with a cache, S counts the cached tokens.

        Returns:
            (B, T, C).
        """
        if documents is not None and (context is not None or isinstance(cache, ContextCache)):
            raise ValueError("documents (packed rows) apply to self-attention; cross-attention takes context_mask for the context's padding")
        if context is not None or context_mask is not None or isinstance(cache, ContextCache):
            return self._cross(x, context, context_mask, attention_mask, cache, position_ids)
        if getattr(self, "kv_dim", self.d_in) != self.d_in:
            raise ValueError(f"this module's keys come from a context of width kv_dim={self.kv_dim} (cross-attention): pass context=")
        cache = checked(cache)
        past = len(cache) if isinstance(cache, KVCache) else 0
        sliding = cache is not None and (cache.window is not None or not isinstance(cache, KVCache))  # paged: each sequence's bound is the caller's
        x, attention_mask = checked_input(self, x, attention_mask, name=self.input_name, past=past, sliding=sliding)  # (B, T, d_in), (B, T)
        if cache is not None:
            cache.check_owner(self)  # one cache, one layer
        _checks.position_ids(position_ids, *x.shape[:2])
        start = 0 if cache is None else cache.start(x.shape[1])  # an int, or (1, T) positions of a paged batch
        if position_ids is None and not isinstance(start, int):
            position_ids = start  # (1, T): each sequence's tokens continue from its own length
        report("x", x)
        queries, keys, values = self.project_qkv(x)  # (B, T, H*D), (B, T, Hkv*D) x2
        report("queries", queries)
        report("keys", keys)
        report("values", values)
        queries = split_heads(queries, self.head_dim, "queries")  # (B, H, T, D)
        keys = split_heads(keys, self.head_dim, "keys")  # (B, Hkv, T, D)
        values = split_heads(values, self.head_dim, "values")  # (B, Hkv, T, D)
        queries, keys = self.position(queries, keys, past, attention_mask, position_ids)  # (B, H, T, D), (B, Hkv, T, D)
        context = attention(
            queries, keys, values, cache=cache, causal=self.causal, window=self.window,
            attention_mask=attention_mask, documents=documents, dropout_p=self.attn_dropout_p, backend=self.backend,
            **self.score_terms(),
        )  # (B, H, T, D)
        if cache is not None:
            cache.bind(self)  # after its first write: a refused call leaves a fresh cache free
        out = self.project_out(merge_heads(context))  # (B, T, C)
        report("output", out)
        return out

    def decode(self, x: Tensor, cache: KVCache, position_ids: Tensor | None = None) -> Tensor:
        """``forward(x, cache=cache, position_ids=position_ids)`` for a decode loop that checked once
        what cannot change between steps (``generate`` does, before its first step).

        Trusted: x (B, T, d_in) of the module's dtype and device, no padding among its tokens,
        a ``KVCache`` already bound to this module with room for T more, eval mode, autograd off,
        nobody observing, no hooks. Nothing of that is checked here (no host reads either); the
        numbers are ``forward``'s, bit for bit.

        Returns:
            (B, T, C).
        """
        past = len(cache)
        queries, keys, values = self.project_qkv(x)  # (B, T, H*D), (B, T, Hkv*D) x2
        queries = split_heads(queries, self.head_dim)  # (B, H, T, D)
        keys = split_heads(keys, self.head_dim)  # (B, Hkv, T, D)
        values = split_heads(values, self.head_dim)  # (B, Hkv, T, D)
        queries, keys = self.position(queries, keys, past, None, position_ids)  # (B, H, T, D), (B, Hkv, T, D)
        context = attention_unchecked(
            queries, keys, values, cache, causal=self.causal, window=self.window, backend=self.backend, **self.score_terms()
        )  # (B, H, T, D)
        return self.project_out(merge_heads(context))  # (B, T, C)

    def _cross(
        self, x: Tensor, context: Tensor | None, context_mask: Tensor | None, attention_mask: Tensor | None,
        cache: object, position_ids: Tensor | None,
    ) -> Tensor:
        """``forward`` with keys and values from ``context`` (or from a filled ``ContextCache``)."""
        if self.causal or self.window is not None:
            raise ValueError(
                "cross-attention (a context given) is not causal: every query sees the whole context; "
                f"build the module with causal=False, got causal={self.causal}, window={self.window}"
            )
        if cache is not None and not isinstance(cache, ContextCache):
            raise TypeError(f"cross-attention takes a headwise.ContextCache (the context's keys, projected once), got {type(cache).__name__}")
        if getattr(self, "alibi_slopes", None) is not None:
            raise ValueError("ALiBi measures distances within one sequence: a module with alibi=True cannot take a context")
        if position_ids is not None:
            raise ValueError("position_ids place x's tokens for a position encoding; cross-attention uses none: pass position_ids=None")
        x, attention_mask = checked_input(self, x, attention_mask, name=self.input_name)  # (B, T, d_in), (B, T)
        B = x.shape[0]
        kv_dim = getattr(self, "kv_dim", self.d_in)
        if cache is not None:
            cache.check_owner(self)
        if context is not None:
            b, s = _checks.tokens(context, kv_dim, "context")
            if b != B:
                raise ValueError(f"context must have the batch size of x ({B}), got shape {tuple(context.shape)}")
            _checks.module_input(self, context, "context")
        elif cache is None or not len(cache):
            raise ValueError("cross-attention needs context= (B, S, kv_dim) the first time (an empty ContextCache holds nothing yet)")
        else:
            b, s = cache.k.shape[0], len(cache)
            if b != B:
                raise ValueError(f"this ContextCache holds a context of (B, S) = {(b, s)}; got x of batch {B}")
        real = _checks.attention_mask(context_mask, b, s, "(B, S)", "context_mask", device=("the context is", x.device))  # (B, S) or None
        if context is None and context_mask is not None and not (cache.real is not None and torch.equal(cache.real, real)):
            raise ValueError(
                "context_mask differs from the padding this ContextCache was filled with: pass the context again with it "
                "(it is projected again), or leave context_mask out"
            )
        report("x", x)
        queries = split_heads(self.project_q(x), self.head_dim, "queries")  # (B, H, T, D)
        fresh = context is not None and not (cache is not None and cache.holds(context, real))
        if fresh:
            keys, values = self.project_kv(inert_padding(context, real))  # (B, S, Hkv*D) x2
            keys = split_heads(keys, self.head_dim, "keys")  # (B, Hkv, S, D)
            values = split_heads(values, self.head_dim, "values")  # (B, Hkv, S, D)
        else:
            keys, values, real = cache.k, cache.v, cache.real  # (B, Hkv, S, D) x2, (B, S) or None
        out = attention(
            queries, keys, values, attention_mask=real, dropout_p=self.attn_dropout_p, backend=self.backend, **self.score_terms()
        )  # (B, H, T, D)
        if fresh and cache is not None:
            cache._store(self, context, keys, values, real)  # after attention took them: a refused call changes nothing
        out = self.project_out(merge_heads(out))  # (B, T, C)
        report("output", out)
        return out
