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
- the attributes read below: ``d_in``, ``head_dim``, ``context_length``, ``causal``,
  ``window``, ``backend`` and ``attn_dropout_p``.

The steps are reported to ``headwise.observe`` under the names ``headwise explain`` shows.
"""

from __future__ import annotations

from torch import Tensor, nn

from . import _checks
from .cache import Cache, KVCache, checked
from .functional import attention, merge_heads, split_heads
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

    def forward(
        self, x: Tensor, *, attention_mask: Tensor | None = None, cache: Cache | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Attend over the tokens of x (and, with a cache, over every token cached before).

        Args:
            x: (B, T, d_in).
            attention_mask: (B, T) padding mask, 1/True = real token, 0/False = padding (left
                or right); with a cache, for the new tokens only (the cache remembers the rest).
            cache: a ``KVCache`` of (B, Hkv, *, D); x then holds the next tokens. Or a
                ``PagedKVCache.batch(...)``: x (1, T, d_in) packs the next tokens of several
                sequences, each placed after its own cached tokens.
            position_ids: (B, T) ints, where x's tokens sit, for a layer with a position
                encoding (HuggingFace's ``position_ids``); default: counted from the cache length.

        Returns:
            (B, T, C).
        """
        cache = checked(cache)
        past = len(cache) if isinstance(cache, KVCache) else 0
        sliding = cache is not None and (cache.window is not None or not isinstance(cache, KVCache))  # paged: each sequence's bound is the caller's
        x, attention_mask = checked_input(self, x, attention_mask, name=self.input_name, past=past, sliding=sliding)  # (B, T, d_in), (B, T)
        if cache is not None:
            cache.bind(self)  # one cache, one layer
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
            attention_mask=attention_mask, dropout_p=self.attn_dropout_p, backend=self.backend,
        )  # (B, H, T, D)
        out = self.project_out(merge_heads(context))  # (B, T, C)
        report("output", out)
        return out
