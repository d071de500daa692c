"""The one attention path every multi-head module runs: project -> split -> attend -> merge -> project.

``AttentionLayer.forward`` is written once. A module says only what differs, in four small
methods, and keeps its own parameter names and state-dict layout:

- ``project_qkv(x)``: queries (B, T, H·D), keys and values (B, T, Hkv·D), e.g. three
  Linear layers (the book) or one fused ``c_attn`` split in three (GPT-2);
- ``position(q, k, start, attention_mask, position_ids)``: whatever a position encoding does
  to the split heads before the cache write (identity here; rotary embeddings in
  ``headwise.models.llama``), the new tokens at ``start`` onwards or at ``position_ids``;
- ``project_out(context)``: (B, T, H·D) -> (B, T, C), e.g. ``out_proj``;
- for cross-attention, ``project_q(x)`` and ``project_kv(context)``: queries from x, keys and
  values from another sequence (B, S, kv_dim);
- the attributes read below: ``d_in``, ``head_dim``, ``context_length``, ``causal``,
  ``window``, ``backend`` and ``attn_dropout_p``; optionally ``kv_dim``, ``softcap``, a
  ``sinks`` parameter (H,) and an ``alibi_slopes`` buffer (H,).

Cross-attention (``forward(x, context=...)``) runs the same path, never causal: a query sees
the whole context less its padding ``context_mask``; a ``ContextCache`` keeps the context's
projected keys and values. ``check=False`` skips the checks (and, for the decode shape, the
core's: ``attention_unchecked``) for ``generate``'s decode loop; the numbers are the same.
The steps are reported to ``headwise.observe`` under the names ``headwise explain`` shows.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import _checks
from .cache import Cache, ContextCache, KVCache, checked
from .functional import Plan, attention, attention_unchecked, merge_heads, plan, split_heads
from .linear import weight_cache
from .loadable import AllOrNothing
from .masks import inert_padding
from .observe import observing, report
from .rope import RotaryEmbedding


def checked_input(
    module: nn.Module, x: Tensor, attention_mask: Tensor | None, *, name: str = "x", cache: KVCache | None = None, sliding: bool = False
) -> tuple[Tensor, Tensor | None]:
    """What every attention module checks first: x (B, T, d_in) floats on ``module``'s device and dtype, its
    padding mask (B, T) (made bool), each row's real tokens in ``cache`` plus its new ones within ``context_length``
    (unless ``sliding``). Returns x with NaN/Inf at padded tokens zeroed (padding is inert) and the mask.
    """
    b, t = _checks.tokens(x, module.d_in, name)
    _checks.module_input(module, x, name)
    attention_mask = _checks.attention_mask(attention_mask, b, t, device=(name + " is", x.device))  # (B, T) bool or None
    if cache is not None:
        past, longest = len(cache), lambda: cache.longest(t, attention_mask)
    else:  # each row's real tokens, as a cache counts them (a meta mask, which holds no values: every slot)
        real = attention_mask is not None and _checks.has_values(attention_mask)
        past, longest = 0, (lambda: int(attention_mask.sum(-1).max())) if real else None
    _checks.context(t, past, module.context_length, sliding=sliding, longest=longest)
    return inert_padding(x, attention_mask), attention_mask  # (B, T, d_in), (B, T) or None


class AttentionLayer(AllOrNothing, nn.Module):
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

    def rotation(self) -> RotaryEmbedding | None:
        """The ``RotaryEmbedding`` whose "rotate_half" turn of every dim of q and k is all ``position`` does without a
        mask (a decode loop may then turn them in one op with the attention: ``models.flat_step``), else None."""
        return None

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
        sinks = getattr(self, "sinks", None)
        return {
            "softcap": getattr(self, "softcap", None),
            "sinks": sinks.to_local() if hasattr(sinks, "to_local") else sinks,  # tensor parallel: a DTensor, this rank's heads
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
        check: bool = True,
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
            check: False skips every check of the arguments (see the module docstring): a wrong
                argument then fails inside torch or gives a wrong answer. For ``generate``.

        Returns:
            (B, T, C).
        """
        if context is not None or context_mask is not None or isinstance(cache, ContextCache):
            if documents is not None:
                raise ValueError("documents (packed rows) apply to self-attention; cross-attention takes context_mask for the context's padding")
            return self._cross(x, context, context_mask, attention_mask, cache, position_ids)
        if check:
            x, attention_mask = self._checked(x, attention_mask, cache, position_ids)  # (B, T, d_in), (B, T) bool or None
            weight_cache.verify()  # a write through .data since the projections' copies were made (once, in a model's forward)
        watched = observing()  # the steps below go to an observer only (one question, not one per step)
        queries, keys, values = self._heads(x, cache, attention_mask, position_ids, watched)  # (B, H, T, D), (B, Hkv, T, D) x2
        terms = {"causal": self.causal, "window": self.window, "backend": self.backend, **self.score_terms()}
        dropout_p = self.attn_dropout_p
        if not check and isinstance(cache, KVCache) and attention_mask is None and documents is None and dropout_p == 0:
            context = attention_unchecked(queries, keys, values, cache, **terms)  # (B, H, T, D): the decode shape, nothing to check
        else:
            context = attention(
                queries, keys, values, cache=cache, attention_mask=attention_mask, documents=documents, dropout_p=dropout_p, **terms
            )  # (B, H, T, D)
        if check and cache is not None:
            cache.bind(self)  # after its first write: a refused call leaves a fresh cache free
        out = self.project_out(merge_heads(context))  # (B, T, C)
        if watched:
            report("output", out)
        return out

    def plan(
        self, x: Tensor, *, context: Tensor | None = None, context_mask: Tensor | None = None, attention_mask: Tensor | None = None,
        cache: Cache | None = None, position_ids: Tensor | None = None, documents: Tensor | None = None,
    ) -> Plan:
        """How ``forward`` with these arguments would compute attention, and why (``headwise.plan``).

        ``forward``'s checks run, then the projections (the plan reads q, k and v: shapes, dtype, device, autograd);
        nothing is written to a cache. ``print(module.plan(x))`` shows the runner on one line.
        """
        terms = {"dropout_p": self.attn_dropout_p, "backend": self.backend, **self.score_terms()}
        if context is not None or context_mask is not None or isinstance(cache, ContextCache):  # cross-attention, as forward
            if documents is not None:
                raise ValueError("documents (packed rows) apply to self-attention; cross-attention takes context_mask for the context's padding")
            x, _, context_mask = self._cross_checked(x, context, context_mask, attention_mask, cache, position_ids)
            queries, keys, values, context_mask, _ = self._cross_heads(x, context, context_mask, cache)
            return plan(queries, keys, values, attention_mask=context_mask, **terms)
        x, attention_mask = self._checked(x, attention_mask, cache, position_ids)  # (B, T, d_in), (B, T) bool or None: forward's
        queries, keys, values = self._heads(x, cache, attention_mask, position_ids, False)  # (B, H, T, D), (B, Hkv, T, D) x2
        return plan(
            queries, keys, values, cache=cache, causal=self.causal, window=self.window, attention_mask=attention_mask, documents=documents, **terms
        )

    def _heads(
        self, x: Tensor, cache: Cache | None, attention_mask: Tensor | None, position_ids: Tensor | None, watched: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, d_in) -> queries (B, H, T, D), keys and values (B, Hkv, T, D), position-encoded after the cache's tokens."""
        start = 0 if cache is None else cache.start(x.shape[1], attention_mask)  # an int, or positions: (B, T) after padding, (1, T) paged
        packed = not isinstance(start, int)
        if position_ids is None and packed:
            position_ids = start  # each row's (each sequence's) tokens continue from its own real tokens
        queries, keys, values = self.project_qkv(x)  # (B, T, H*D), (B, T, Hkv*D) x2
        if watched:
            for name, t in (("x", x), ("queries", queries), ("keys", keys), ("values", values)):
                report(name, t)
        queries = split_heads(queries, self.head_dim, "queries")  # (B, H, T, D)
        keys = split_heads(keys, self.head_dim, "keys")  # (B, Hkv, T, D)
        values = split_heads(values, self.head_dim, "values")  # (B, Hkv, T, D)
        queries, keys = self.position(queries, keys, 0 if packed else start, attention_mask, position_ids)  # (B, H, T, D), (B, Hkv, T, D)
        return queries, keys, values

    def _checked(
        self, x: Tensor, attention_mask: Tensor | None, cache: Cache | None, position_ids: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Self-attention's checks (``attention`` checks the rest): x and its padding (see ``checked_input``),
        a cache the core reads and that is this layer's (or no one's yet), position_ids."""
        if getattr(self, "kv_dim", self.d_in) != self.d_in:
            raise ValueError(f"this module's keys come from a context of width kv_dim={self.kv_dim} (cross-attention): pass context=")
        cache = checked(cache)
        # a window bounds what each query sees, not the length (a windowed cache or none); paged: each sequence's bound is the caller's
        sliding = self.window is not None or (cache is not None and (cache.window is not None or not isinstance(cache, KVCache)))
        held = cache if isinstance(cache, KVCache) else None
        x, attention_mask = checked_input(self, x, attention_mask, name=self.input_name, cache=held, sliding=sliding)  # (B, T, d_in), (B, T)
        if cache is not None:
            cache.check_owner(self)  # one cache, one layer
        _checks.position_ids(position_ids, *x.shape[:2], device=(f"{self.input_name} is", x.device))
        return x, attention_mask

    def _cross(
        self, x: Tensor, context: Tensor | None, context_mask: Tensor | None, attention_mask: Tensor | None,
        cache: object, position_ids: Tensor | None,
    ) -> Tensor:
        """``forward`` with keys and values from ``context`` (or from a filled ``ContextCache``)."""
        x, attention_mask, context_mask = self._cross_checked(x, context, context_mask, attention_mask, cache, position_ids)
        report("x", x)
        queries, keys, values, context_mask, projected = self._cross_heads(x, context, context_mask, cache)
        out = attention(
            queries, keys, values, attention_mask=context_mask, dropout_p=self.attn_dropout_p, backend=self.backend, **self.score_terms()
        )  # (B, H, T, D)
        if projected is not None and cache is not None:
            cache.store(self, projected, keys, values, context_mask)  # after attention took them: a refused call changes nothing
        out = self.project_out(merge_heads(out))  # (B, T, C)
        report("output", out)
        return out

    def _cross_checked(
        self, x: Tensor, context: Tensor | None, context_mask: Tensor | None, attention_mask: Tensor | None,
        cache: object, position_ids: Tensor | None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Cross-attention's checks (``attention`` checks the rest), nothing written: x (B, T, d_in) with its padding
        (B, T) bool or None (``checked_input``), and the context's padding (B, S) bool or None."""
        if self.causal or self.window is not None:
            given = "a context" if context is not None else "a context_mask" if context_mask is not None else "a ContextCache"
            raise ValueError(
                f"cross-attention ({given} given) is not causal: every query sees the whole context; "
                f"build the module with causal=False, got causal={self.causal}, window={self.window}"
                + ("" if context is not None or context_mask is not None else "; for self-attention pass a KVCache, or no cache")
            )
        if cache is not None and not isinstance(cache, ContextCache):
            raise TypeError(f"cross-attention takes a headwise.ContextCache (the context's keys, projected once), got {type(cache).__name__}")
        if getattr(self, "alibi_slopes", None) is not None:
            raise ValueError("ALiBi measures distances within one sequence: a module with alibi=True cannot take a context")
        if position_ids is not None:
            raise ValueError("position_ids place x's tokens for a position encoding; cross-attention uses none: pass position_ids=None")
        x, attention_mask = checked_input(self, x, attention_mask, name=self.input_name)  # (B, T, d_in), (B, T)
        weight_cache.verify()  # a write through .data since a ContextCache's (or a projection's) copies were made
        if cache is not None:
            cache.check_owner(self)
        if context is None and (cache is None or cache.k is None):  # (filled with an empty context: it holds S = 0 keys)
            why = "no cache given" if cache is None else "an empty ContextCache holds nothing yet"
            raise ValueError(f"cross-attention needs context= (B, S, kv_dim) the first time ({why})")
        width = ("kv_dim", self.kv_dim) if hasattr(self, "kv_dim") else ("d_in", self.d_in)
        b, s = _checks.tokens(context, width[1], "context", width[0]) if context is not None else (cache.k.shape[0], len(cache))
        if b != x.shape[0]:
            held = "" if context is not None else " (the ContextCache's)"
            raise ValueError(f"context must have the batch size of x ({x.shape[0]}), got (B, S) = {(b, s)}{held}")
        if context is not None:
            _checks.module_input(self, context, "context")
        elif (p := next(self.parameters(), None)) is not None and (cache.context.dtype, cache.context.device) != (p.dtype, p.device):
            raise TypeError(f"this ContextCache was filled with a {cache.context.dtype} context on {cache.context.device}; "
                            f"{type(self).__name__}'s parameters are now {p.dtype} on {p.device}: pass context= again (it is "
                            "projected again), or cache.reset()")
        context_mask = _checks.attention_mask(context_mask, b, s, "(B, S)", "context_mask", device=("the context is", x.device))  # (B, S)
        if context is None and context_mask is not None and not (cache.context_mask is not None and torch.equal(cache.context_mask, context_mask)):
            raise ValueError(
                "context_mask differs from the padding this ContextCache was filled with: pass the context again with it "
                "(it is projected again), or leave context_mask out"
            )
        if context is None and not cache.serves(self):  # the kept context will be projected again (``_cross_heads``)
            cache.check_projectable()
        return x, attention_mask, context_mask

    def _cross_heads(
        self, x: Tensor, context: Tensor | None, context_mask: Tensor | None, cache: ContextCache | None
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """Queries (B, H, T, D) of x; keys and values (B, Hkv, S, D) and padding (B, S) or None of ``context``, or the
        ``ContextCache``'s where it holds them for these weights; and the context they were projected from now, or None."""
        queries = split_heads(self.project_q(x), self.head_dim, "queries")  # (B, H, T, D)
        reusable = cache is not None and cache.serves(self)
        if context is None and reusable:
            return queries, cache.k, cache.v, cache.context_mask, None
        if context is None:  # the weights changed since, or autograd needs keys of its own: the kept context projected again
            context, context_mask = cache.context, cache.context_mask
        elif reusable and cache.holds(context, context_mask):
            return queries, cache.k, cache.v, cache.context_mask, None
        keys, values = self.project_kv(inert_padding(context, context_mask))  # (B, S, Hkv*D) x2
        keys = split_heads(keys, self.head_dim, "keys")  # (B, Hkv, S, D)
        values = split_heads(values, self.head_dim, "values")  # (B, Hkv, S, D)
        return queries, keys, values, context_mask, context
