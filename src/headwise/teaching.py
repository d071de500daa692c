"""The book's classes (chapter 3.6 of *Build a Large Language Model (from Scratch)*), faithful.

Same positional signatures, parameter names, creation order and state-dict keys as
``llms_from_scratch.ch03``, so the same seed gives the same numbers and the book's state
dicts load with ``strict=True``. Differences, all additive:
- attention runs in ``headwise.attention`` (any backend, no materialised mask);
- keyword-only extras: ``causal`` (False = bidirectional, encoder style), ``window``,
  ``num_kv_heads`` (GQA, MultiHeadAttention only), ``backend``; ``forward`` takes
  ``attention_mask`` (B, T), 1/True = real token, and a ``KVCache``;
- MultiHeadAttention only: ``softcap``, ``sinks`` (a learned (H,) ``sinks`` parameter),
  ``alibi`` (the standard slopes, a buffer outside the state dict) and ``kv_dim`` with
  ``forward(x, context=...)`` for cross-attention;
- bad input raises ValueError (the book asserts, or silently breaks past context_length).

The book keeps ``mask = triu(ones(ctx, ctx), 1)`` as a persistent buffer, where 1 means
*masked* (the opposite of headwise's True = may attend). headwise never needs it, so it is
not stored (ctx² floats per layer): ``state_dict()`` of a causal module still emits the book's
``mask`` entry (a bidirectional one has no such mask to give), ``load_state_dict`` accepts one
(reading only its shape), and ``module.mask`` builds it on demand.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from . import _checks
from .functional import attention, check_backend
from .layer import AttentionLayer, checked_input
from .linear import project, project_many, weight_cache
from .loadable import AllOrNothing, keeps_keys, shapes_only
from .scores import alibi_slopes


class _BookMask:
    """Emit / accept the book's ``mask`` buffer in state dicts without storing it."""

    context_length: int
    W_query: nn.Linear

    def _book_layers(
        self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool,
        *, causal: bool, backend: str, kv_width: int, out_proj: bool, kv_in: int | None = None,
    ) -> None:
        """The book's attributes and layers, created in the book's order (same seed, same weights)."""
        self.d_in = _checks.positive_int("d_in", d_in)
        self.d_out = _checks.positive_int("d_out", d_out)
        self.context_length = _checks.positive_int("context_length", context_length)
        self.causal = _checks.boolean("causal", causal)
        _checks.boolean("qkv_bias", qkv_bias)
        self.backend = check_backend(backend)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(kv_in or d_in, kv_width, bias=qkv_bias)
        self.W_value = nn.Linear(kv_in or d_in, kv_width, bias=qkv_bias)
        if out_proj:
            self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(_checks.dropout("dropout", dropout))
        self.register_state_dict_post_hook(_emit_book_mask)
        self.register_load_state_dict_pre_hook(_accept_book_mask)

    @property
    def mask(self) -> Tensor:
        """The book's (ctx, ctx) float buffer: 1.0 above the diagonal = masked (future), on the module's device, in its
        floating-point dtype (``.half()`` casts the book's buffer too)."""
        ctx, weight = self.context_length, self.W_query.weight
        dtype = weight.dtype if weight.is_floating_point() else torch.get_default_dtype()
        return torch.triu(torch.ones(ctx, ctx, device=weight.device, dtype=dtype), diagonal=1)


def _slopes_after_assign(module: MultiHeadAttention, incompatible: object) -> None:
    """After ``load_state_dict(..., assign=True)`` into a module built on "meta": the ALiBi slopes, which no state dict
    holds, made from their formula on the loaded weights' device (no move ran ``_apply``)."""
    slopes, weight = module.alibi_slopes, module.W_query.weight
    if slopes.is_meta and not weight.is_meta:
        module.alibi_slopes = module._made_slopes(weight.device, slopes.dtype)  # (H,)


def _emit_book_mask(module: _BookMask, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    if not module.causal and not shapes_only():  # the book's buffer is its causal mask: a bidirectional layer has none to
        return  # give (it takes one: a book's state dict loads into it)
    ctx = module.context_length
    state_dict[prefix + "mask"] = torch.empty(ctx, ctx, device="meta") if shapes_only() else module.mask  # (ctx, ctx)
    for key in [k for k in state_dict if k.startswith(prefix) and k != prefix + "mask"]:
        state_dict[key] = state_dict.pop(key)  # the book's key order: its own buffer before its layers' weights


@keeps_keys
def _accept_book_mask(module: _BookMask, state_dict: dict, prefix: str, *args: object) -> None:
    mask = state_dict.pop(prefix + "mask", None)
    error_msgs = args[-1]
    ctx = module.context_length
    if mask is not None and not isinstance(mask, torch.Tensor):  # (strict=False skips the all-or-nothing check)
        error_msgs.append(f"{prefix}mask must be a tensor of shape ({ctx}, {ctx}), got {type(mask).__name__}")
    elif mask is not None and tuple(mask.shape) != (ctx, ctx):
        error_msgs.append(f"size mismatch for {prefix}mask: expected ({ctx}, {ctx}) for context_length={ctx}, got {tuple(mask.shape)}")


class CausalAttention(_BookMask, AllOrNothing, nn.Module):
    """One attention head (the book's listing 3.3): (B, T, d_in) -> (B, T, d_out).

    Args:
        d_in: input width.
        d_out: output width, which is also the head size.
        context_length: the most tokens a forward pass may take.
        dropout: dropout on the attention weights, in [0, 1] (1.0 drops every weight in training).
        qkv_bias: bias in W_query / W_key / W_value.
        causal: True (the book) = token i sees tokens <= i; False = every token.
        backend: "auto", "math" or "sdpa" (see ``headwise.functional``).

    Example:
        >>> _ = torch.manual_seed(123)
        >>> ca = CausalAttention(3, 2, context_length=6, dropout=0.0)
        >>> ca(torch.rand(2, 6, 3)).shape
        torch.Size([2, 6, 2])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        qkv_bias: bool = False,
        *,
        causal: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self._book_layers(d_in, d_out, context_length, dropout, qkv_bias, causal=causal, backend=backend, kv_width=d_out, out_proj=False)

    def forward(self, x: Tensor, *, attention_mask: Tensor | None = None) -> Tensor:
        """x: (B, T, d_in); attention_mask: (B, T), 1/True = real token -> (B, T, d_out)."""
        x, attention_mask = checked_input(self, x, attention_mask)  # (B, T, d_in), (B, T) bool or None
        weight_cache.verify()  # a write through .data since the projections' copies were made (once, in the wrapper's forward)
        queries = project(self.W_query, x).unsqueeze(1)  # (B, 1, T, d_out): one head
        keys = project(self.W_key, x).unsqueeze(1)  # (B, 1, T, d_out)
        values = project(self.W_value, x).unsqueeze(1)  # (B, 1, T, d_out)
        p = self.dropout.p if self.training else 0.0
        context = attention(
            queries, keys, values, causal=self.causal, attention_mask=attention_mask, dropout_p=p, backend=self.backend
        )  # (B, 1, T, d_out)
        return context.squeeze(1)  # (B, T, d_out)


class MultiHeadAttentionWrapper(AllOrNothing, nn.Module):
    """``num_heads`` CausalAttention heads run one by one, outputs concatenated (listing 3.4).

    Note ``d_out`` is the size of *each* head here, so the output is (B, T, num_heads * d_out);
    in MultiHeadAttention ``d_out`` is the total. No output projection.

    Example:
        >>> _ = torch.manual_seed(123)
        >>> MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)(torch.rand(2, 6, 3)).shape
        torch.Size([2, 6, 4])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        causal: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        _checks.positive_int("num_heads", num_heads)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias, causal=causal, backend=backend) for _ in range(num_heads)]
        )

    def forward(self, x: Tensor, *, attention_mask: Tensor | None = None) -> Tensor:
        """x: (B, T, d_in); attention_mask: (B, T), 1/True = real token -> (B, T, num_heads * d_out)."""
        _checks.tokens(x, self.heads[0].d_in, "x")
        _checks.module_input(self, x, "x")  # (its own name in the error: the heads would give theirs)
        with weight_cache.checking(True):  # the heads' weights looked at once, not once a head (eager)
            return torch.cat([head(x, attention_mask=attention_mask) for head in self.heads], dim=-1)


class MultiHeadAttention(_BookMask, AttentionLayer):
    """Multi-head attention by weight splitting (listing 3.5): (B, T, d_in) -> (B, T, d_out).

    One projection per Q/K/V, split into heads with ``view`` + ``transpose``, attention for
    all heads at once, heads merged, then ``out_proj``.

    Args:
        d_in: input width.
        d_out: output width C = num_heads * head_dim (the total, unlike the wrapper).
        context_length: the most tokens a forward pass (plus a non-sliding cache) may hold.
        dropout: dropout on the attention weights, in [0, 1] (1.0 drops every weight in training).
        num_heads: H; must divide d_out.
        qkv_bias: bias in W_query / W_key / W_value (out_proj always has one, as in the book).
        causal: True (the book) = token i sees tokens <= i; False = bidirectional.
        window: sliding-window attention: token i sees tokens i-window+1 .. i (causal only).
        num_kv_heads: Hkv for grouped-query attention (default H): W_key and W_value are
            Hkv * head_dim wide; query head h reads key/value head h // (H // Hkv).
        softcap: scores become ``softcap * tanh(scores / softcap)`` (Gemma 2); None = off.
        sinks: a learned sink logit per head, the parameter ``sinks`` (H,), zeros at first
            (gpt-oss): each row's softmax gives it a share of the mass, and it has no value.
        alibi: ALiBi instead of positions: the standard slopes 2^(-8i/H) (BLOOM's rule when
            H is not a power of two), kept as the buffer ``alibi_slopes`` outside the state dict.
        kv_dim: the width of a context's tokens for cross-attention (default d_in): W_key and
            W_value read kv_dim features; pass ``context=`` to forward (with causal=False).
        backend: "auto", "math" or "sdpa".

    Example:
        >>> _ = torch.manual_seed(123)
        >>> mha = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
        >>> mha(torch.rand(2, 6, 3)).shape
        torch.Size([2, 6, 2])
        >>> cross = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2, causal=False, kv_dim=5)
        >>> cross(torch.rand(2, 6, 3), context=torch.rand(2, 9, 5)).shape
        torch.Size([2, 6, 2])
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
        *,
        causal: bool = True,
        window: int | None = None,
        num_kv_heads: int | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        alibi: bool = False,
        kv_dim: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        d_out, num_heads = _checks.positive_int("d_out", d_out), _checks.positive_int("num_heads", num_heads)
        self.num_kv_heads = _checks.heads("d_out", d_out, num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.window = _checks.window(window, _checks.boolean("causal", causal))
        self.softcap = _checks.softcap(softcap)
        self.kv_dim = d_in if kv_dim is None else _checks.positive_int("kv_dim", kv_dim)
        for name, flag in [("sinks", sinks), ("alibi", alibi)]:
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        kv_width = self.num_kv_heads * self.head_dim
        self._book_layers(
            d_in, d_out, context_length, dropout, qkv_bias, causal=causal, backend=backend, kv_width=kv_width, out_proj=True, kv_in=self.kv_dim
        )
        if sinks:  # after the book's layers: same seed, same weights as the book
            self.sinks = nn.Parameter(torch.zeros(num_heads))  # (H,)
        if alibi:
            self._alibi_of = (num_heads, 0)  # the slopes of heads start .. start + num_heads - 1 of this many (sharding moves start)
            self.register_buffer("alibi_slopes", alibi_slopes(num_heads), persistent=False)  # (H,)
            self.register_load_state_dict_post_hook(_slopes_after_assign)

    def _made_slopes(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        """The ALiBi slopes of this module's heads from their formula, (H,) on ``device`` in ``dtype``."""
        total, start = self._alibi_of
        with torch.device("cpu"):  # the formula's numbers, whatever the default device
            return alibi_slopes(total)[start : start + self.alibi_slopes.shape[0]].to(device, dtype)  # (H,)

    def _apply(self, fn: Callable, recurse: bool = True) -> MultiHeadAttention:
        """``to``, ``to_empty``, ``half`` ... and then the ALiBi slopes, where the move did not carry their values
        (``to_empty``; from "meta"), made again from their formula: they stay out of the state dict, so no load would."""
        before = self._buffers.get("alibi_slopes")
        super()._apply(fn, recurse)
        slopes = self._buffers.get("alibi_slopes")
        if slopes is None or slopes.is_meta:
            return self
        with torch.no_grad():
            if not before.is_meta and torch.equal(slopes, before.to(slopes.device, slopes.dtype)):
                return self  # carried (a cast or a copy): the module's own slopes, edited or not
            slopes.copy_(self._made_slopes(slopes.device, slopes.dtype))  # (H,)
        return self

    @property
    def attn_dropout_p(self) -> float:
        return self.dropout.p if self.training else 0.0

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, d_in) -> W_query(x) (B, T, C), W_key(x) and W_value(x) (B, T, Hkv*D), as one GEMM where it pays."""
        queries, keys, values = project_many((self.W_query, self.W_key, self.W_value), x)
        return queries, keys, values

    def project_out(self, context: Tensor) -> Tensor:
        """(B, T, C) -> out_proj(context) (B, T, C)."""
        return project(self.out_proj, context)

    def project_q(self, x: Tensor) -> Tensor:
        """(B, T, d_in) -> W_query(x) (B, T, C), for cross-attention."""
        return project(self.W_query, x)

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S, kv_dim) -> W_key(context), W_value(context) (B, S, Hkv*D), for cross-attention."""
        keys, values = project_many((self.W_key, self.W_value), context)
        return keys, values
