"""The causal language models' one forward: token ids in, logits out, through a cache per layer or not.

GPT-2 and the Llama family differ in how they embed tokens (GPT-2 adds a position table, Llama
rotates queries and keys inside its layers), in their blocks and in their final norm; the rest is
the same path, written here once:

    ids -> embed -> every block (each with its layer's cache) -> final norm -> LM head

Prompts, decode steps (``generate``), packed rows of several sequences (``Batcher``) and the
full-sequence logits all go through ``forward`` (gpt-fast's model is its ``forward(idx, input_pos)``).
It checks its arguments first, unless ``check=False``: then nothing is checked anywhere below it
(no per-layer checks, no host reads), for ``generate``, which checked its own arguments once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import _checks
from ..cache import Cache, KVCache, PagedKVCache
from ..layer import AttentionLayer
from ..linear import linear, project, weight_cache
from ..loadable import AllOrNothing
from . import _inputs
from .generate import GenerationMixin


class CausalModel(GenerationMixin, AllOrNothing, nn.Module):
    """Base of headwise's causal LMs: one ``forward``, its caches, the LM head (tied or not).

    A model says what differs: ``embed_tokens``, ``blocks``, ``final_norm`` (modules), ``embed``
    (ids -> (B, T, C)), ``vocab_size`` and ``context_limit``; ``lm_head`` is None while the head
    is tied to ``embed_tokens``. Each block takes ``(x, attention_mask=, cache=, position_ids=, check=)``.

    Example:
        >>> import torch, headwise as hw
        >>> from headwise.models import GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(hw.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
        >>> ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
        >>> mask = torch.tensor([[1, 1, 1], [0, 1, 1]])                # left padding, 1 = real token
        >>> model(ids, attention_mask=mask).shape                       # (B, T, vocab_size)
        torch.Size([2, 3, 100])
        >>> caches = model.new_caches(2, 8)
        >>> model(ids, mask, cache=caches, logits_to_keep=1).shape      # the prompt, its last logits
        torch.Size([2, 1, 100])
        >>> model(torch.tensor([[1], [2]]), positions=torch.tensor([[3], [2]]), cache=caches).shape  # one step
        torch.Size([2, 1, 100])
        >>> model.generate(ids, attention_mask=mask, max_new_tokens=4).shape  # greedy
        torch.Size([2, 7])
    """

    lm_head: nn.Module | None
    embed_tokens: nn.Embedding
    blocks: nn.ModuleList
    final_norm: nn.Module

    def embed(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None, cache: list[Cache] | None) -> Tensor:
        """(B, T) ids of the tokens at ``positions`` (None: after the cached ones) -> (B, T, C)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        positions: Tensor | None = None,
        cache: list[Cache] | None = None,
        logits_to_keep: int | Tensor = 0,
        check: bool = True,
    ) -> Tensor:
        """Logits for every position (or those ``logits_to_keep`` asks for), through the caches if given.

        Args:
            input_ids: (B, T) token ids.
            attention_mask: (B, T), 1/True = real token, 0/False = padding (ints or bools),
                left or right; with a cache, of the new tokens only.
            positions: (B, T) position ids; default: the tokens after those the cache holds,
                counting real tokens only (as HuggingFace's ``generate`` counts them, so a
                left-padded row gives the logits of the unpadded one).
            cache: one cache per layer: ``new_caches(B, max_len)`` (input_ids are the next
                tokens), or each layer's ``PagedKVCache.batch(seq_ids, new_tokens)`` (input_ids
                (1, T) pack the next tokens of several sequences, each after its own).
            logits_to_keep: 0 = logits for all T positions; k >= 1 = the last k only; a (N,)
                tensor = those positions (HuggingFace's argument): the LM head runs on those rows.
            check: False skips every check (for ``generate``, which checked its arguments once).

        Returns:
            (B, T or k or N, vocab_size) logits in the model's dtype; those at padding positions mean nothing.

        Raises:
            TypeError, ValueError: ids, mask, positions, caches or ``logits_to_keep`` the model
                cannot take; more tokens than ``context_limit()`` allows.
        """
        if _checks.boolean("check", check):
            _, t, attention_mask, logits_to_keep = _inputs.model_call(
                self, input_ids, attention_mask, positions, cache, logits_to_keep, self.embed_tokens.weight, len(self.blocks)
            )
            held = 0 if cache is None else len(cache[0]) if isinstance(cache[0], KVCache) else None  # a paged batch: its sequences'
            name, limit = self.context_limit()
            if positions is not None:  # every layer sliding (no limit): any position from 0 on
                _inputs.in_range(positions, limit, f"positions must lie in [0, {name}={limit})" if limit is not None
                                 else "positions must not be negative")
            # the tokens a layer that sees every key holds, whatever the positions (it refuses more, after the layers below wrote)
            if held is not None and limit is not None and held + t > limit and (cache is None or cache[0].longest(t, attention_mask) > limit):
                cached = f" after {held} cached" if held else ""  # (padding takes no position: each row's real tokens count)
                raise ValueError(f"input_ids has {t} tokens{cached}, more than {name}={limit}")
            elif held is None and limit is not None:  # a paged batch: each sequence's new tokens after its own
                for seq_id, start, n in zip(cache[0].seq_ids, cache[0].starts, cache[0].new_tokens, strict=True):
                    if start + n > limit:
                        raise ValueError(f"sequence {seq_id} would hold {start + n} tokens ({n} new after {start}), more than {name}={limit}")
        # checked: a write through .data since the projections' copies were made is looked for once, here
        with weight_cache.checking(check):
            x = self.embed(input_ids, positions, attention_mask, cache)  # (B, T, C)
            for i, block in enumerate(self.blocks):
                x = block(x, attention_mask=attention_mask, cache=None if cache is None else cache[i], position_ids=positions, check=check)
            x = self.final_norm(_inputs.kept(x, logits_to_keep))  # (B, T or k or N, C): the LM head only where logits are wanted
            return linear(x, self.embed_tokens.weight) if self.lm_head is None else project(self.lm_head, x)  # (B, T or k or N, vocab)

    def flat_step(self) -> Callable[[Tensor, Tensor | None, list[KVCache]], Tensor] | None:
        """``generate``'s unchecked decode step written out flat (``flat_step.FlatStep``: the same logits with
        less Python), or None where a block does not name its parts (``flat_parts``) or a layer differs."""
        from .flat_step import flat_step  # it builds on this module

        return flat_step(self)

    def attention_layers(self) -> list[AttentionLayer]:
        """Each block's attention module, in order."""
        return [m for block in self.blocks for m in block.modules() if isinstance(m, AttentionLayer)]

    def new_caches(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        """One empty ``KVCache`` per layer with room for ``max_len`` tokens; a ring of ``window`` slots for a
        sliding layer whose window is shorter (memory bounded however long decoding runs). ``dtype``: what they
        hold, the model's (None), or for a float32 model bfloat16 or ``torch.int8`` (8-bit rows, ``KVCache``)."""
        weight = self.embed_tokens.weight
        dtype = self.cache_dtype(dtype)
        batch_size, max_len = _checks.positive_int("batch_size", batch_size), _checks.positive_int("max_len", max_len)  # (every layer's ring too)
        caches = []
        for attn in self.attention_layers():  # each layer's own key/value heads (fewer when sharded by headwise.parallel)
            shape = (batch_size, attn.num_kv_heads, max_len, attn.head_dim)
            if attn.window is not None and attn.window < max_len:
                shape = (batch_size, attn.num_kv_heads, attn.window, attn.head_dim)
                caches.append(KVCache.sliding(*shape, dtype=dtype, device=weight.device))
            else:
                caches.append(KVCache(*shape, dtype=dtype, device=weight.device))
        return caches

    def new_paged_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> list[PagedKVCache]:
        """One ``PagedKVCache`` of ``num_blocks`` blocks per layer (``headwise.models.batching``); a sliding
        layer's knows its window (``PagedKVCache.slide`` may give back the blocks before it). ``dtype``: as ``new_caches``
        (``torch.int8``: 8-bit rows, ``PagedKVCache``)."""
        weight, dtype = self.embed_tokens.weight, self.cache_dtype(dtype)
        return [
            PagedKVCache(num_blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=weight.device, window=attn.window)
            for attn in self.attention_layers()
        ]

    def cache_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """What this model's caches hold when asked for ``dtype``: the model's dtype for None; bfloat16 may serve a
        float32 model (half the bytes a token keeps, attention in bfloat16), and ``torch.int8`` a float32 or bfloat16
        model (8-bit rows: a quarter of float32's bytes and a scale, a little over half of bfloat16's; attention in
        float32 over them, a bfloat16 model's keys and values widened first: ``KVCache``). TypeError for anything else."""
        computed = self.embed_tokens.weight.dtype
        if dtype is None:
            return computed
        if dtype == torch.int8:
            _checks.cache_dtype("cache_dtype=torch.int8", torch.float32, computed, rows8=True)
            for attn in self.attention_layers():  # (named here: the caches would name their own dtype argument)
                _checks.cache_storage("cache_dtype", dtype, attn.head_dim)
            return dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"cache_dtype must be None, a floating-point torch.dtype (e.g. torch.bfloat16) or torch.int8 "
                            f"(8-bit rows), got {dtype!r}")
        _checks.cache_dtype("cache_dtype", dtype, computed)
        return dtype
