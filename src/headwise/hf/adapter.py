"""The translator: transformers' attention arguments onto ``headwise.attention``, and nothing else.

Every attention class that calls transformers' ``AttentionInterface`` (Llama, Gemma, gpt-oss,
DeepSeek, BERT, BART, Whisper, GPT-2, GPT-J and most others) hands its queries, keys and values
to ``attend``:

    transformers                          headwise.attention
    query (B, H, T, D)                    q
    key, value (B, Hkv, S, D / Dv)        k, v (grouped heads read in place, never repeated)
    attention_mask: from ``mask``         mask (bool, True = may attend); where transformers would
                                          have skipped it, causal or nothing masked; where it is
                                          causal (a window) or nothing but padding, causal, window
                                          and attention_mask (see ``mask``)
    is_causal (or module.is_causal)       causal, only when the model built no mask at all
    scaling, dropout                      scale, dropout_p
    softcap (Gemma 2), s_aux (gpt-oss)    softcap, sinks
    position_bias (T5-style)              an additive float mask
    output_attentions                     a second result from ``headwise.attention_weights``

The mask comes from transformers' own mask builder (``masking_utils.sdpa_mask``: causal, sliding
windows, padding, packed rows, static-cache slots, chunks), registered under the same name in
``AttentionMaskInterface``: without it transformers passes no mask at all. transformers' cache
has already appended the new keys and values when ``attend`` is called, so headwise's cache
is not used. An argument that would change the result and that headwise cannot honour raises
a TypeError naming it, never a wrong answer.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from .._optional import require
from ..functional import attention, attention_weights
from ..masks import position_mask
from .routing import refuse_never_routed

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
        "num_items_in_batch",  # the loss's normaliser (transformers' Trainer passes it with every batch)
        "seq_idx",  # a packed row's sequence index for Mamba's layers (attention reads the packing from the mask)
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
    "sinks": "a sink logit per query (headwise's sinks are one per head, gpt-oss's s_aux)",
}


def register(name: str = "headwise") -> str:
    """Make ``attn_implementation=name`` run transformers' attention layers on headwise.

    Registers ``attend`` in ``transformers.AttentionInterface`` and ``mask`` in
    ``transformers.AttentionMaskInterface`` under ``name`` (both, or transformers would pass no
    mask). Needs the ``hf`` extra (transformers). ``name`` may be none of transformers' own
    (``"sdpa"``, ``"eager"``, ...), nor start with ``"paged|"``, which transformers strips.

    Only layers that call ``AttentionInterface`` run on headwise. Others compute attention in
    their own code and never call it (see ``headwise.hf.routing``):

    - a whole architecture that builds its masks through ``mask`` (Bloom, MPT, XGLM, Longformer,
      BigBird, RoFormer, MPNet, ...): its first forward raises a TypeError naming it;
    - a whole architecture that builds its masks itself (DeBERTa, OpenAI GPT, FSMT, Funnel,
      ProphetNet, ...): headwise sees nothing; the model runs as it would on eager;
    - an architecture that picks its attention class from a table of its own (GPT-Neo, Bark,
      GIT, SAM): transformers raises ``KeyError: 'headwise'`` while building it, which
      ``headwise.hf.load`` turns into a TypeError naming the class;
    - some layers of a model whose others call it (CLAP's audio tower, Gemma 3n's and 4's
      audio towers, BigBird-Pegasus' encoder, DETR-style deformable attention): nothing fails;
      those layers do not run on headwise, and where they read transformers' mask
      (BigBird-Pegasus' encoder on a padded batch) they compute something else than eager.

    ``headwise.hf.check(model)`` raises unless every attention layer of a loaded model runs on
    headwise; ``headwise.hf.load(model_class, path)`` loads and checks in one call.

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
    mappings = (transformers.AttentionInterface._global_mapping, transformers.AttentionMaskInterface._global_mapping)
    taken = {n for mapping in mappings for n, f in mapping.items() if getattr(f, "__module__", "").startswith("transformers.")}
    read = name.removeprefix("paged|")  # the name a model loaded with ``name`` looks up ("paged|eager" aside)
    if read in taken or read.split("|")[-1] == "eager":  # transformers' own (eager is its models' code, in no mapping)
        raise ValueError(f"name {name!r} is an attention implementation transformers already has (one of {sorted(taken | {'eager'})}): "
                         "registering headwise under it would run every model loaded with it in this process on headwise; "
                         "choose another name (by default 'headwise')")
    if read != name:
        raise ValueError(f"name {name!r}: transformers reads a name starting with 'paged|' as the name after it ({read!r}), so a "
                         f"model loaded with {name!r} would not run on what is registered under it; register {read!r}")
    transformers.AttentionInterface.register(name, attend)
    transformers.AttentionMaskInterface.register(name, mask)
    return name


def mask(*args, allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False, **kwargs) -> Tensor:
    """The mask ``attend`` receives: transformers' ``sdpa_mask`` (see ``register``), never None.

    ``sdpa_mask`` may answer None in two cases that mean opposite things: a plain causal mask it
    skips (``allow_is_causal_skip``: SDPA's ``is_causal`` says the same) and a bidirectional mask
    with nothing padded (``allow_is_bidirectional_skip``: no mask at all). The layer cannot tell
    which (its ``is_causal`` may be missing, or say the opposite of the mask transformers built),
    so the mask is always built. Where transformers would have skipped it, ``attend`` recognises
    the very tensor returned here and runs without reading it (causal, or nothing masked); so too
    where it is, in every row, causal over the last T of S positions (a sliding window or not) or
    every key, but for keys no query sees (``_meaning``: a batch's padding, a static cache's
    empty slots): ``attend`` runs it as ``causal``, ``window`` and a (B, S) ``attention_mask``, which
    the prompt and decode kernels take. A copy or a slice of it is read as the mask it is, and so is any other
    mask (packed rows, chunks, a prefill into a static cache). Under ``torch.compile`` every mask is
    read. The cost: a skippable mask is built (T * S bools when nothing is padded, once per forward:
    the layers share it) where transformers would build none, and each other mask is compared with
    what it may stand for (its last row first, then once in full: B * T * S bools, eight a word).

    An architecture none of whose attention layers calls the interface (Bloom, MPT, XGLM, ...)
    still builds its masks here: it is refused by name (``routing.never_routed``).

    Returns:
        (B, 1, T, S) bool, True = may attend.

    Raises:
        TypeError: ``config`` (passed by transformers) is of an architecture headwise never runs.
        ModuleNotFoundError: transformers is not installed (the message names the ``hf`` extra).
    """
    try:
        from transformers.masking_utils import sdpa_mask
    except ModuleNotFoundError:
        require("transformers", "hf", "building transformers' attention masks for headwise")  # names the extra
        raise  # transformers is there, its masking_utils is not (a release before 5)

    if not _checks.compiling() and "config" in kwargs:
        refuse_never_routed(kwargs["config"])  # the layers that read this mask would never call attend

    def build(causal_skip: bool = False, bidirectional_skip: bool = False) -> Tensor | None:
        return sdpa_mask(*args, allow_is_causal_skip=causal_skip, allow_is_bidirectional_skip=bidirectional_skip, **kwargs)

    if _checks.compiling():
        return build()  # (B, 1, T, S)
    for causal, allowed in ((True, allow_is_causal_skip), (False, allow_is_bidirectional_skip)):
        if allowed and build(causal, not causal) is None:
            return _remember(build(), Meaning(causal=causal, top_left=causal))  # (B, 1, T, S)
    built = build()  # (B, 1, T, S)
    meaning = _meaning(built)
    return built if meaning is None else _remember(built, meaning)


@dataclass(frozen=True, eq=False)  # eq=False: a tensor field has no truth value to compare by
class Meaning:
    """What a mask ``mask`` built stands for, which ``attend`` runs in place of reading it: causal (the queries at the
    last T of S positions, each seeing its last ``window`` keys where one is set) or every key, of the keys that
    ``real`` marks ((B, S) bool, False = padding; None: all). ``top_left``: a causal mask transformers would have skipped
    (SDPA's ``is_causal``, aligned top-left: for 1 < T < S, a prefill into an empty static cache, whose keys past the
    first T are empty slots)."""

    causal: bool
    window: int | None = None
    real: Tensor | None = None
    top_left: bool = False


def _meaning(built: Tensor | None) -> Meaning | None:
    """What a mask (B, 1, T, S) stands for where it is, in every row, causal with the queries at the last T of S
    positions (each seeing its last W keys: a sliding layer's; or every key up to its own: a prompt, or a chunk after
    cached keys) or every key, but for keys no query sees in a prompt (padding, a static cache's empty slots); None for
    any other mask (packed rows, chunks, a prefill into a static cache's first slots). A decode step's padding runs in
    the C++ decode kernel, which reads no padded key's row (other runners take the keys with their padded rows zeroed,
    a copy). Read on the host: one comparison of the B x T x S bools a candidate (a last row's first), once
    a mask; a decode step's (T == 1) in one sum, the keys its one query sees."""
    if built is None or built.dtype != torch.bool or built.dim() != 4 or built.shape[1] != 1 or 0 in built.shape:
        return None
    rows = built[:, 0]  # (B, T, S)
    B, T, S = rows.shape
    last = rows[:, -1]  # (B, S): the last query's keys
    if T == 1:  # a decode step: its one query sees the keys it sees, a window's or padding's alike (the loop's first answer)
        seen = int(last.sum())  # one host read
        return None if seen == 0 else Meaning(causal=True, window=None, real=None if seen == B * S else last.clone())  # (B, S)
    if not last.any():
        return None
    first = int(torch.where(last.any(-1), last.int().argmax(-1), S).min())  # the earliest key a last query sees
    positions = torch.arange(S, device=built.device)
    causal = [(True, w) for w in (None, S - first) if T <= S and (w is None or first > 0)]  # no window first: W = S - first
    for is_causal, window in [*causal, (False, None)]:
        band = position_mask(positions[S - T :], positions, window=window) if is_causal else last.new_ones(T, S)  # (T, S)
        # each key's flag read where the band's first query to see it sees it (False where none does): a real key if
        # the mask is the band's
        witness = (positions - (S - T)).clamp(0, T - 1) if is_causal else positions.new_full((S,), T - 1)  # (S,)
        real = rows[:, witness, positions] & band[witness, positions]  # (B, S)
        if not torch.equal(last, band[-1] & real):  # the last query's keys first: (B, S), a cheap look
            continue
        seen = max(0, S - T - window + 1) if window is not None else 0  # the first key the band shows any query
        padded = not bool(real[:, seen:].all())  # else the keys no query sees lie outside every window
        if all(_same(rows[b], band & real[b]) for b in range(B)):  # (T, S) a row, not (B, T, S) at once
            return Meaning(causal=is_causal, window=window, real=real if padded else None)
    return None


def _same(a: Tensor, b: Tensor) -> bool:
    """``torch.equal`` of two bool tensors of one shape, eight bools a word where their rows allow it (one byte each)."""
    if a.shape[-1] % 8 == 0 and a.is_contiguous() and b.is_contiguous():
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    return torch.equal(a, b)


#: The masks ``mask`` built that ``attend`` runs as what they stand for, by id (with a weak reference that drops the
#: entry when the mask dies): where transformers' ``sdpa_mask`` would have answered None, and where ``_meaning`` reads it.
_MEANINGS: dict[int, tuple[weakref.ref, Meaning]] = {}


def _remember(built: Tensor, meaning: Meaning) -> Tensor:
    key = id(built)
    _MEANINGS[key] = (weakref.ref(built, lambda _: _MEANINGS.pop(key, None)), meaning)
    return built


def _stands_for(attention_mask: Tensor | None) -> Meaning | None:
    """What a mask ``mask`` built stands for (itself, not a copy or a slice); None for any other mask."""
    if attention_mask is None or _checks.compiling():
        return None
    held = _MEANINGS.get(id(attention_mask))
    return held[1] if held is not None and held[0]() is attention_mask else None


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
        module: the calling attention layer; its ``is_causal`` (True if missing) is read only
            where the model built no mask at all.
        query: (B, H, T, D).
        key: (B, Hkv, S, D), everything the layer's cache holds (Hkv divides H).
        value: (B, Hkv, S, Dv); Dv may differ from D (multi-head latent attention).
        attention_mask: the mask ``mask`` built ((B, 1, T, S) bool, True = may attend; one
            transformers would have skipped runs as what it stands for), a 4D bool or additive
            float mask the caller built, or None (the model built none).
        dropout: dropout on the weights (transformers passes 0.0 in eval mode).
        scaling: multiplies the scores; None = 1/sqrt(D).
        is_causal: overrides ``module.is_causal`` (where the model built no mask).
        softcap: Gemma 2's logit cap: scores become softcap * tanh(scores / softcap).
        s_aux: (H,) gpt-oss's sink logits, one per query head.
        position_bias: (B or 1, H, T, S) additive bias (T5-style relative positions).
        **kwargs: ``output_attentions`` and the model's bookkeeping (``INERT``); anything else raises.

    Returns:
        ((B, T, H, Dv) context, (B, H, T, S) weights or None): weights only when the model asks
        for attentions.
    """
    _refuse(kwargs)
    for label, t in (("query", query), ("key", key), ("value", value)):  # (their shapes are the core's to check)
        if not isinstance(t, Tensor):
            raise TypeError(f"{label} must be a torch.Tensor of shape (B, H, T, D), got {type(t).__name__}")
    _check_bias(position_bias, query, key)
    if isinstance(attention_mask, Tensor) and not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
        raise TypeError(f"attention_mask (the 4D mask the model passed) must be bool (True = may attend) or an additive float mask, "
                        f"got dtype {attention_mask.dtype}")
    meaning = _stands_for(attention_mask)
    window = real = None
    if meaning is not None:  # a mask built here: run as what it stands for, without reading it
        attention_mask, causal, window, real = None, meaning.causal, meaning.window, meaning.real
    elif attention_mask is None:  # the model built no mask: the layer says what it is
        causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    else:
        causal = False  # the mask already holds causality
    T, S = query.shape[2], key.shape[2]
    if (meaning is None or meaning.top_left) and attention_mask is None and causal and 1 < T < S:
        # SDPA's is_causal is aligned top-left: only a prefill into an empty static cache gets
        # here, whose keys past the first T are empty slots (sdpa slices them off too)
        key, value = key[:, :, :T], value[:, :, :T]  # (B, Hkv, T, D), (B, Hkv, T, Dv)
        position_bias = None if position_bias is None else position_bias[..., :T]  # (B, H, T, T)
    bias = _with_bias(attention_mask, position_bias)  # (B, 1 or H, T, S) or None
    terms = dict(causal=causal, window=window, mask=bias, attention_mask=real, softcap=softcap, sinks=s_aux, scale=scaling)
    try:
        context = attention(query, key, value, dropout_p=float(dropout), **terms)  # (B, H, T, Dv)
    except (TypeError, ValueError) as e:
        if type(e) not in (TypeError, ValueError):
            raise
        raise type(e)(f"{e} ({_NAMES})") from None
    weights = attention_weights(query, key, **terms) if _weights_wanted(kwargs) else None  # (B, H, T, S or T)
    if weights is not None and weights.shape[-1] < S:  # the empty slots cut off above: weight 0 each, as eager gives them
        weights = F.pad(weights, (0, S - weights.shape[-1]))  # (B, H, T, S)
    return context.transpose(1, 2), weights  # (B, T, H, Dv)


#: What ``attend``'s refusals (``headwise.attention``'s) call transformers' arguments.
_NAMES = ("headwise.hf.attend hands transformers' query, key, value, attention_mask (with position_bias), dropout, scaling "
          "and s_aux to headwise.attention as q, k, v, mask, dropout_p, scale and sinks")


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
    _checks.broadcasts("position_bias", position_bias, (query.shape[0], query.shape[1], query.shape[2], key.shape[2]), "(B, H, T, S)")


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
