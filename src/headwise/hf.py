"""headwise inside transformers: ``attn_implementation="headwise"`` for any model that asks for it.

    import headwise.hf
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=headwise.hf.register())

Every attention class that calls transformers' ``AttentionInterface`` (Llama, Gemma, gpt-oss,
DeepSeek, BERT, BART, Whisper, GPT-2 and most others) then hands its queries, keys and values to
``attend``, which translates transformers' arguments onto ``headwise.attention`` and nothing else:

    transformers                          headwise.attention
    query (B, H, T, D)                    q
    key, value (B, Hkv, S, D / Dv)        k, v (grouped heads read in place, never repeated)
    attention_mask: from ``mask``         mask (bool, True = may attend), or None: causal (see ``mask``)
    is_causal (or module.is_causal)       causal (only when no mask came: a mask already holds it)
    scaling, dropout                      scale, dropout_p
    softcap (Gemma 2), s_aux (gpt-oss)    softcap, sinks
    position_bias (T5-style)              an additive float mask
    output_attentions                     a second result from ``headwise.attention_weights``

The mask comes from transformers' own mask builder (``masking_utils.sdpa_mask``: causal, sliding
windows, padding, packed rows, static-cache slots, chunks), registered under the same name in
``AttentionMaskInterface``: without it transformers passes no mask at all. A bidirectional mask
is always built, so a None from it means causal and nothing else. transformers' cache
has already appended the new keys and values when ``attend`` is called, so headwise's cache
is not used. An argument that would change the result and that headwise cannot honour raises
a TypeError naming it, never a wrong answer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ._optional import require
from .functional import attention, attention_weights

#: Arguments transformers passes that change nothing in attention itself: bookkeeping of the
#: model around it. ``sliding_window`` is already in the mask transformers builds (as eager and
#: sdpa, the adapter reads it from there).
INERT = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "output_router_logits",
        "output_hidden_states",
        "encoder_hidden_states",
        "return_dict",
        "deterministic",
        "sliding_window",
    }
)

#: Arguments that would change the result and that the adapter does not translate, with what they are.
REFUSED = {
    "cu_seq_lens_q": "packed sequences given as cumulative lengths (flash-attention's varlen form)",
    "cu_seq_lens_k": "packed sequences given as cumulative lengths (flash-attention's varlen form)",
    "max_length_q": "packed sequences given as cumulative lengths (flash-attention's varlen form)",
    "max_length_k": "packed sequences given as cumulative lengths (flash-attention's varlen form)",
    "cache": "a paged KV cache (continuous batching)",
    "indices": "sparse attention over selected key indices",
    "block_indices": "block-sparse attention",
}


def register(name: str = "headwise") -> str:
    """Make ``attn_implementation=name`` run every transformers attention layer on headwise.

    Registers ``attend`` in ``transformers.AttentionInterface`` and ``mask`` in
    ``transformers.AttentionMaskInterface`` under ``name`` (both, or transformers would pass no
    mask). Needs the ``hf`` extra (transformers).

    Returns:
        ``name``, to hand to ``from_pretrained(..., attn_implementation=...)`` or
        ``model.set_attn_implementation(...)``.

    Example:
        >>> register()
        'headwise'
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    transformers = require("transformers", "hf", "running transformers models on headwise")
    transformers.AttentionInterface.register(name, attend)
    transformers.AttentionMaskInterface.register(name, mask)
    return name


def mask(*args, allow_is_bidirectional_skip: bool = False, **kwargs) -> Tensor | None:
    """The mask ``attend`` receives: transformers' ``sdpa_mask`` (see ``register``), built so that
    None has one meaning.

    ``sdpa_mask`` answers None in two cases that mean opposite things: a plain causal mask it may
    skip (``allow_is_causal_skip``: SDPA's ``is_causal`` says the same) and a bidirectional mask
    with nothing padded (``allow_is_bidirectional_skip``: no mask at all). ``attend`` cannot tell
    them apart, so the bidirectional one is always built, whatever transformers asks: None then
    only ever stands for the causal mask.

    Returns:
        (B, 1, T, S) bool, True = may attend; or None where SDPA's ``is_causal`` (aligned
        top-left) says the same: a causal mask with nothing padded, or one query that sees every key.
    """
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, allow_is_bidirectional_skip=False, **kwargs)


def attend(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention function, computed by ``headwise.attention``.

    Args:
        module: the calling attention layer (its ``is_causal`` says causal unless ``is_causal`` is given).
        query: (B, H, T, D).
        key: (B, Hkv, S, D), everything the layer's cache holds (Hkv divides H).
        value: (B, Hkv, S, Dv); Dv may differ from D (multi-head latent attention).
        attention_mask: the mask ``mask`` built ((B, 1, T, S) bool, True = may attend), a 4D
            bool or additive float mask the caller built, or None.
        dropout: dropout on the weights (transformers passes 0.0 in eval mode).
        scaling: multiplies the scores; None = 1/sqrt(D).
        is_causal: overrides ``module.is_causal``.
        softcap: Gemma 2's logit cap: scores become softcap * tanh(scores / softcap).
        s_aux: (H,) gpt-oss's sink logits, one per query head.
        position_bias: (B or 1, H, T, S) additive bias (T5-style relative positions).
        **kwargs: ``output_attentions`` and the model's bookkeeping (``INERT``); anything else raises.

    Returns:
        ((B, T, H, Dv) context, (B, H, T, S) weights or None): weights only when the model asks
        for attentions.
    """
    _refuse(kwargs)
    _check_bias(position_bias, query, key)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    T, S = query.shape[2], key.shape[2]
    if attention_mask is None and causal and 1 < T < S:
        # transformers' None means SDPA's is_causal, aligned top-left: only a prefill into an empty
        # static cache gets here, whose keys past the first T are empty slots (sdpa slices them off too)
        key, value = key[:, :, :T], value[:, :, :T]  # (B, Hkv, T, D), (B, Hkv, T, Dv)
        position_bias = None if position_bias is None else position_bias[..., :T]  # (B, H, T, T)
    causal = causal and attention_mask is None  # a mask from transformers already holds causality
    bias = _with_bias(attention_mask, position_bias)  # (B, 1 or H, T, S) or None
    terms = dict(causal=causal, mask=bias, softcap=softcap, sinks=s_aux, scale=scaling)
    context = attention(query, key, value, dropout_p=float(dropout), **terms)  # (B, H, T, Dv)
    weights = attention_weights(query, key, **terms) if _weights_wanted(kwargs) else None  # (B, H, T, S)
    return context.transpose(1, 2), weights  # (B, T, H, Dv)


def _refuse(kwargs: dict) -> None:
    """Raise on any argument that would change attention and is not translated."""
    for name, value in kwargs.items():
        if name in INERT or name == "output_attentions" or value is None:
            continue
        what = REFUSED.get(name)
        if what is not None:
            raise TypeError(f"attn_implementation='headwise' does not support {what}: transformers passed {name!r}")
        raise TypeError(
            f"attn_implementation='headwise' got an argument it does not know, {name!r} ({type(value).__name__}): "
            "rather than ignore what may change the result, it refuses"
        )


def _check_bias(position_bias: object, query: Tensor, key: Tensor) -> None:
    """``position_bias`` is None or a float tensor that broadcasts to (B, H, T, S); checked here, by
    its own name, before it is folded into the mask (q and k themselves are the core's to check)."""
    if position_bias is None:
        return
    if not isinstance(position_bias, Tensor) or not position_bias.is_floating_point():
        what = f"dtype {position_bias.dtype}" if isinstance(position_bias, Tensor) else type(position_bias).__name__
        raise TypeError(f"position_bias must be a floating-point torch.Tensor (an additive bias), got {what}")
    if not (isinstance(query, Tensor) and isinstance(key, Tensor) and query.ndim == key.ndim == 4):
        return
    want = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])  # (B, H, T, S)
    try:
        ok = torch.broadcast_shapes(position_bias.shape, want) == want
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"position_bias must broadcast to (B, H, T, S) = {want}, got shape {tuple(position_bias.shape)}")


def _with_bias(mask: Tensor | None, position_bias: Tensor | None) -> Tensor | None:
    """A bool mask (True = may attend) and an additive bias as one additive mask (-inf = may not)."""
    if position_bias is None:
        return mask
    if mask is None:
        return position_bias  # (B, H, T, S)
    if mask.dtype == torch.bool:
        return position_bias.masked_fill(~mask, -math.inf)  # (B, H, T, S)
    return position_bias + mask  # (B, H, T, S): both additive


def _weights_wanted(kwargs: dict) -> bool:
    """True when the model asks for attention weights: ``output_attentions`` passed down, or, for
    models that record them with hooks instead (GPT-2), transformers' active output collector."""
    if kwargs.get("output_attentions"):
        return True
    from transformers.utils import output_capturing

    collector = getattr(output_capturing, "_active_collector", None)
    wanted = collector.get() if collector is not None else None
    return bool(wanted) and ("attentions" in wanted or "cross_attentions" in wanted)
