"""``generate``'s unchecked decode step written out flat: the model's ops in order, without the calls around them.

``generate`` runs its steps unchecked (``check=False``) when nothing outside the model can see or
change a layer (``trusts``: no hooks, eval mode, no observer). Such a step does little tensor work
per layer at B = 1, and much of its time is Python: five module calls a layer and the attention
layer's glue around the same few ops. ``FlatStep`` runs those ops directly: for each pre-norm
block ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``, the attention as
``AttentionLayer.forward``'s unchecked decode path (``project_qkv``, the head split, ``position``,
``attention_unchecked``, the merge, ``project_out``), called as methods, not modules. The same
functions on the same tensors in the same order: the logits and the caches are the unchecked
forward's bit for bit (tests/models/test_flat_step.py).

Without autograd a step also asks each question once per ``generate`` call, not once per step: its
projections' decisions are kept for the loop (``linear.projection.planned``: asked again only of
their weights' state), and each layer's attention, where its plan is the C++ decode kernel over a
whole cache, runs the rotation, the cache's write, the kernel and the heads' merge in one op with nothing decided
again (``functional.decode_kernel_call``). From a layer's second one-token step on, where every part of a Llama-family
or GPT-2 layer takes its op, the whole layer runs in one C++ op (``native_layer``): the same ops, called from C++.

The ``Batcher``'s decode steps (every running request's next token, packed in one row) run the same written-out
step over each layer's ``PagedKVCache.batch(...)`` (``FlatStep.logits``, the logits of the rows it keeps): each layer's
attention, where its plan is the C++ kernel's one call over the pool, runs the rotation, the pool's write at the
batch's slots, that call and the heads' merge in one op (``functional.paged_kernel_call``, decided once a pool), and
from the layer's second such step the whole layer in ``native_layer``'s op over the packed row; the step is kept across
the batcher's steps while the model's parts and the world the projections were decided in
(``projection.planned_world``) hold, made anew where they do not.

Each layer's kernel call and op are kept with the cache (or pool) and the attention's terms they were decided under
(``layer_terms``: backend, causal, window, softcap, sinks, slopes and rotary tables), read at every step: a window
or a softcap set between two steps is decided again at the next.

A block takes part by naming its parts in order, ``flat_parts = (norm1, attention, norm2, mlp)``,
on its own class (a subclass that changes ``forward`` does not inherit it).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import nullcontext

import torch
from torch import Tensor

from ..cache import KVCache, PagedBatch, PagedKVCache
from ..functional import KernelCall, PagedCall, attention_unchecked, decode_kernel_call, paged_kernel_call
from ..layer import AttentionLayer
from ..linear import linear, project
from ..linear.projection import planned
from ..observe import observing
from ..rope import RotaryEmbedding
from . import _inputs
from .causal import CausalModel
from .native_layer import NativeLayer, native_layer


def flat_step(model: CausalModel) -> FlatStep | None:
    """A ``FlatStep`` for a ``CausalModel`` whose every block names its pre-norm parts, else None."""
    blocks = flat_parts(model)
    return None if blocks is None else FlatStep(model, blocks)


def flat_parts(model: CausalModel) -> list[tuple] | None:
    """Each block's (norm1, attn, norm2, mlp) for a ``CausalModel`` whose every block names its pre-norm parts and
    whose attention a ``FlatStep`` runs, else None."""
    if not isinstance(model, CausalModel) or type(model).forward is not CausalModel.forward:
        return None
    blocks = []
    for block in model.blocks:
        names = vars(type(block)).get("flat_parts")
        if names is None:
            return None
        parts = tuple(getattr(block, name) for name in names)
        attn = parts[1]
        if not isinstance(attn, AttentionLayer) or type(attn).forward is not AttentionLayer.forward:
            return None
        if attn.attn_dropout_p != 0.0 or getattr(attn, "kv_dim", attn.d_in) != attn.d_in:
            return None
        blocks.append(parts)
    return blocks


def layer_terms(a: AttentionLayer) -> tuple:
    """What a layer's attention decision reads of its module: its backend, causal, window and score terms (tensors by
    identity: their values are read at each step), and the rotary tables its op turns q and k by (``rotation()``, by
    identity: None once their layout or width changed in place). Asked of every layer at every step. (Its dropout is
    not read: the step runs unchecked in eval mode only.)"""
    return (a.backend, a.causal, a.window, _term(a, "softcap"), id(_term(a, "sinks")), id(_term(a, "alibi_slopes")),
            id(a.rotation()))


def _term(a: AttentionLayer, name: str) -> object:
    """``getattr(a, name, None)`` without the exception a module raises for a name it lacks (microseconds: a step asks
    three a layer): an attribute, a class's, or else a parameter or buffer by that name, or None."""
    if name in a.__dict__ or _on_class(type(a), name):
        return getattr(a, name)
    return a._parameters.get(name, a._buffers.get(name))


@functools.cache
def _on_class(cls: type, name: str) -> bool:
    return hasattr(cls, name)


class FlatStep:
    """``model(ids, positions=position_ids, cache=caches, logits_to_keep=1, check=False)[:, 0]``, written out.

    Called as ``generate``'s step: (ids (B, T), position_ids (B, T) or None, caches) -> (B, vocab) logits. ``logits``
    takes any ``logits_to_keep``, and each layer's ``PagedKVCache.batch(...)`` too (the ``Batcher``'s decode steps).
    """

    def __init__(self, model: CausalModel, blocks: list[tuple]) -> None:
        self.model = model
        self.blocks = blocks  # (norm1, attn, norm2, mlp) a block (``flat_parts``)
        self.kept: dict = {}  # the projections' decisions of this loop (``projection.planned``; a longer loop may hand its own)
        # per layer: (its cache, or a paged batch's pool; its attention's terms; its kernel call) and (the same; its op),
        # each made anew where the cache or the terms (``layer_terms``: a window, a softcap set between steps) changed
        self.kernel_calls: list[tuple[KVCache | PagedKVCache, tuple, KernelCall | PagedCall | None] | None] = [None] * len(self.blocks)
        self.natives: list[tuple[KVCache | PagedKVCache, tuple, NativeLayer | None] | None] = [None] * len(self.blocks)

    def __call__(self, ids: Tensor, position_ids: Tensor | None, caches: Sequence[KVCache]) -> Tensor:
        return self.logits(ids, position_ids, caches, 1)[:, 0]  # (B, vocab)

    def logits(self, ids: Tensor, position_ids: Tensor | None, caches: Sequence[KVCache | PagedBatch], keep: int | Tensor) -> Tensor:
        """``model(ids, positions=position_ids, cache=caches, logits_to_keep=keep, check=False)``: (B, T) ids -> (B, k or N,
        vocab) logits; ``caches`` one ``KVCache`` a layer, or one ``PagedKVCache.batch(...)`` a layer of a packed row (B = 1)."""
        model = self.model
        if observing() or len(caches) != len(self.blocks) or not all(isinstance(c, (KVCache, PagedBatch)) for c in caches):
            return model(ids, positions=position_ids, cache=caches, logits_to_keep=keep, check=False)  # (B, k or N, vocab)
        once = not torch.is_grad_enabled()  # decisions kept across steps (autograd would make each step another call)
        with planned(self.kept) if once else nullcontext():
            x = model.embed(ids, position_ids, None, caches)  # (B, T, C)
            tables: dict = {}  # this step's rotary tables, once for the layers that share them
            for i, (parts, cache) in enumerate(zip(self.blocks, caches, strict=True)):
                seen = (_key(cache), layer_terms(parts[1])) if once else None  # what the layer's kept decisions hold for
                layer = self._native(i, parts, seen, x) if once and _one_each(cache, x) else None
                if layer is not None:
                    t = x.shape[1]
                    cos, sin = (None, None) if layer.rotary is None else _tables(tables, layer.rotary, cache, t, position_ids, x)
                    if (y := layer(x, cache, cos, sin)) is not None:
                        x = y  # (B, 1, C), or a paged row (1, N, C): the layer in one op
                        continue
                norm1, attn, norm2, mlp = parts
                x = x + self._attend(i, attn, norm1.forward(x), cache, position_ids, seen, tables)  # (B, T, C)
                x = x + mlp.forward(norm2.forward(x))  # (B, T, C)
            x = model.final_norm.forward(_inputs.kept(x, keep))  # (B, k or N, C)
            return linear(x, model.embed_tokens.weight) if model.lm_head is None else project(model.lm_head, x)  # (B, k or N, vocab)

    def _native(self, i: int, parts: tuple, seen: tuple, x: Tensor) -> NativeLayer | None:
        """Layer ``i``'s step in one op (``native_layer``), decided once its kernel call on this cache (or this batch's
        pool) under these terms (``seen``: the two) is (at its first one-token step, which runs in Python); None before
        that, or where it does not apply."""
        known = self.natives[i]
        if known is not None and _holds(known, seen):
            return known[2]
        call = self.kernel_calls[i]
        if call is None or not _holds(call, seen):
            return None
        self.natives[i] = (*seen, native_layer(parts, call[2], x))
        return self.natives[i][2]

    def _attend(self, i: int, attn: AttentionLayer, x: Tensor, cache: KVCache | PagedBatch, position_ids: Tensor | None,
                seen: tuple | None, tables: dict) -> Tensor:
        """``attn(x, cache=cache, position_ids=position_ids, check=False)`` of layer ``i``: (B, T, C) -> (B, T, C), nobody
        observing; with ``seen`` (the layer's cache key and terms, without grad), the kernel's call decided at the
        layer's first one-token step on this cache under these terms. ``tables``: the step's rotary tables so far
        (``_tables``)."""
        B, T, _ = x.shape
        D = attn.head_dim
        paged = isinstance(cache, PagedBatch)
        if paged and position_ids is None:
            position_ids = cache.start(T)  # (1, T): each sequence's tokens after its own
        start = cache.start(T) if position_ids is None else 0  # (given positions: the cache's own are not needed)
        queries, keys, values = attn.project_qkv(x)  # (B, T, H*D), (B, T, Hkv*D) x2
        queries = queries.view(B, T, -1, D).transpose(1, 2)  # (B, H, T, D)
        keys = keys.view(B, T, -1, D).transpose(1, 2)  # (B, Hkv, T, D)
        values = values.view(B, T, -1, D).transpose(1, 2)  # (B, Hkv, T, D)
        kernel = seen is not None and _one_each(cache, x)  # the kernel's call takes one query a row of a KVCache, or a sequence of a batch
        known = self.kernel_calls[i] if kernel else None
        if kernel and (known is None or not _holds(known, seen)):
            decide = paged_kernel_call if paged else decode_kernel_call
            call = decide(queries, keys, values, cache, causal=attn.causal, window=attn.window, backend=attn.backend, **attn.score_terms())
            self.kernel_calls[i] = known = (*seen, call)
        if known is not None and known[2] is not None:  # the rotation, the cache's write, the kernel and the merge in one op
            run = functools.partial(known[2], cache) if paged else known[2]
            rotary = attn.rotation()
            if rotary is not None:
                cos, sin = _tables(tables, rotary, cache, T, position_ids, x)  # (T, R) or (B, 1, T, R)
                return attn.project_out(run(queries, keys, values, cos, sin))  # (B, T, H*D) -> (B, T, C)
            queries, keys = attn.position(queries, keys, start, None, position_ids)  # (B, H, T, D), (B, Hkv, T, D)
            return attn.project_out(run(queries, keys, values))  # (B, T, H*D) -> (B, T, C)
        queries, keys = attn.position(queries, keys, start, None, position_ids)  # (B, H, T, D), (B, Hkv, T, D)
        context = attention_unchecked(queries, keys, values, cache, causal=attn.causal, window=attn.window, backend=attn.backend,
                                      **attn.score_terms())  # (B, H, T, D)
        return attn.project_out(context.transpose(1, 2).reshape(B, T, -1))  # (B, H, T, D) -> (B, T, H*D) -> (B, T, C)


def _one_each(cache: KVCache | PagedBatch, x: Tensor) -> bool:
    """Whether a step of x (B, T, C) feeds one token a row of a KVCache, or one a sequence of a paged batch."""
    return cache.one_each if isinstance(cache, PagedBatch) else x.shape[1] == 1


def _holds(known: tuple, seen: tuple) -> bool:
    """Whether a kept (cache, terms, decision) was made for ``seen`` (the cache by identity, the terms by value)."""
    return known[0] is seen[0] and known[1] == seen[1]


def _key(cache: KVCache | PagedBatch) -> KVCache | PagedKVCache:
    """What a layer's decisions are kept for: its KVCache, or a paged batch's pool (a batch lives one step)."""
    return cache.cache if isinstance(cache, PagedBatch) else cache


def _tables(tables: dict, rotary: RotaryEmbedding, cache: KVCache | PagedBatch, t: int, position_ids: Tensor | None,
            x: Tensor) -> tuple[Tensor, Tensor]:
    """``rotary.at`` for a layer's t new tokens of x's dtype: at the cache's next positions, or at ``position_ids`` (B, t)
    where given -> (t, R) or (B, 1, t, R) each; kept in ``tables`` for the step's other layers with the same tables and
    positions."""
    where = cache.start(t) if position_ids is None else position_ids
    key = (rotary, t, where if isinstance(where, int) else id(where))  # (position_ids lives through the step: its id is its own)
    if key not in tables:
        tables[key] = rotary.at(where, t, x.device, x.dtype)
    return tables[key]
