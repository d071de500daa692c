"""Checks for what users pass to the models: token ids, HuggingFace-style attention masks, a forward's caches and
logits to keep, the sampling arguments of generate and of a request."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _checks, arguments
from ..cache import KVCache, PagedBatch


def token_ids(input_ids: object, vocab_size: int, name: str = "input_ids", limit: str = "vocab_size") -> tuple[int, int]:
    """Check ``input_ids`` is a (B, T) integer tensor of ids in [0, vocab_size); return (B, T).

    The range is read on the host once per call (on a GPU an id out of range would otherwise
    end in a device-side assert inside the embedding); the models call this once per forward
    or ``generate``, never per decode step.
    """
    if not isinstance(input_ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, shape (batch, tokens), got {type(input_ids).__name__}")
    if input_ids.ndim != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{name} must have shape (batch, tokens) with at least one row and one token, got {tuple(input_ids.shape)}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        kind = "integer token ids" if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool else "int64 or int32 token ids (embeddings take no other)"
        raise TypeError(f"{name} must hold {kind}, got dtype {input_ids.dtype}; convert with {name}.long()")
    in_range(input_ids, vocab_size, f"{name} must hold ids in [0, {limit}={vocab_size})", "ids")
    return input_ids.shape[0], input_ids.shape[1]


def in_range(t: Tensor, end: int | None, expected: str, what: str = "values") -> None:
    """Raise ValueError(``expected``, and the values given) unless every value of the integer tensor ``t`` lies in
    [0, end) (``end`` None: is not negative): one host read eagerly (on a GPU an index out of range would end in a device-side assert inside an
    embedding), an assert in the graph under ``torch.compile``, nothing for a meta tensor."""
    if not _checks.has_values(t) or t.numel() == 0:
        return
    if _checks.compiling():  # no host read inside a graph: an assert in it
        _checks.holds((t >= 0).all() if end is None else ((t >= 0) & (t < end)).all(), expected)
        return
    low, high = torch.stack([t.min(), t.max()]).tolist()  # one host read (a device sync on a GPU)
    if low < 0 or (end is not None and high >= end):
        raise ValueError(f"{expected}, got {what} from {low} to {high}")


def attention_mask(mask: object, shape: tuple[int, int], name: str = "attention_mask", *, device: torch.device | None = None) -> Tensor:
    """HuggingFace's (B, T) mask, 1/True = real token, as ints or bools -> (B, T) bool (on ``device``, the ids' device)."""
    if mask is None:
        raise TypeError(f"{name} must be a torch.Tensor of shape (batch, tokens) = {tuple(shape)}, 1/True = real token; got None")
    where = None if device is None else ("input_ids is", device)
    return _checks.attention_mask(mask, *shape, dims="(batch, tokens) of input_ids", name=name, device=where)


def on_model(input_ids: Tensor, weight: Tensor, name: str = "input_ids") -> None:
    """The ids (if a tensor; ``token_ids`` checks the rest) must be on the device of the model's embedding ``weight``."""
    if isinstance(input_ids, Tensor):
        _checks.same_device(name, input_ids, "the model's embeddings are", weight.device)


def ids_and_mask(input_ids: object, mask: object, vocab_size: int, weight: Tensor | None) -> tuple[int, int, Tensor | None]:
    """What every model checks first: ``input_ids`` (B, T) on ``weight``'s device (the embeddings;
    None skips that), ids in [0, vocab_size), and the padding mask -> (B, T, (B, T) bool or None)."""
    if weight is not None:
        on_model(input_ids, weight)
    b, t = token_ids(input_ids, vocab_size)
    is_token = None if mask is None else attention_mask(mask, (b, t), device=input_ids.device)  # (B, T) bool
    return b, t, is_token


def padding_only(is_token: Tensor | None) -> Tensor | None:
    """The key padding mask to pass on: None when nothing is padding (lets SDPA use is_causal).

    Asking costs one host read (a device sync on a GPU), once per forward or ``generate``:
    it buys mask-free fused attention in every layer (and every decode step) after it. Under
    ``torch.compile`` the mask is passed on as it is (the same numbers): a branch on its values
    would break the graph.
    """
    if is_token is None or _checks.compiling():
        return is_token
    if _checks.has_values(is_token) and bool(is_token.all()):
        return None
    return is_token


def model_call(
    model: object, input_ids: object, attention_mask: object, positions: object, cache: object, logits_to_keep: object, weight: Tensor, layers: int
) -> tuple[int, int, Tensor | None, int | Tensor]:
    """What a causal LM's ``forward`` checks before it runs (each layer checks its own cache after).

    Returns (B, T, the padding mask to pass on ((B, T) bool, None when nothing is padding),
    ``logits_to_keep``). ``cache`` must be None or one cache per layer, all ``KVCache`` or all
    ``PagedKVCache.batch(...)`` (then B = 1 and nothing is padding).
    """
    b, t, is_token = ids_and_mask(input_ids, attention_mask, model.vocab_size, weight)
    if cache is not None:
        if not isinstance(cache, (list, tuple)) or len(cache) != layers:
            got = f"a {type(cache).__name__} of {len(cache)}" if isinstance(cache, (list, tuple)) else type(cache).__name__
            raise TypeError(
                f"cache must be a list of one cache per layer ({layers}): model.new_caches(batch_size, max_len), "
                f"or each layer's PagedKVCache.batch(seq_ids, new_tokens); got {got}"
            )
        if not (all(isinstance(c, KVCache) for c in cache) or all(isinstance(c, PagedBatch) for c in cache)):
            raise TypeError(f"cache must hold KVCaches or paged batches, one kind, got {sorted({type(c).__name__ for c in cache})}")
        if isinstance(cache[0], PagedBatch) and (b != 1 or is_token is not None):
            raise ValueError(f"a paged batch packs its sequences' real tokens in one row: input_ids (1, T) and no attention_mask, got B={b}")
        caches_agree(model, cache, b, t, weight)
    if positions is not None:
        _checks.position_ids(positions, b, t, "positions", device=("the model's weights are", weight.device))
    return b, t, padding_only(is_token), logits_kept(logits_to_keep, t)


def caches_agree(model: object, cache: list, b: int, t: int, weight: Tensor) -> None:
    """A TypeError or ValueError unless every layer's cache takes the call's t new tokens: each layer checks its own
    cache as it writes, so a later layer's refusal would leave the earlier layers' caches written (and caches holding
    different tokens would attend apart, at the first one's positions). Every cache is checked here as its layer's call
    will check it (``arguments.cache_takes`` and the cache's ``check_append`` of keys of the layer's shape, in the
    model's dtype (``weight``'s) on its device: the key heads, head size, dtype, device, window, room, a batch not used
    already); and across layers: ``KVCache``s of one length and padding state, paged batches of the same sequences after
    the same lengths; each cache its own layer's (none given twice, none another module's)."""
    if not _checks.compiling():  # a traced id() is a guard on the object; generate's compiled step makes its own caches
        _each_layers_own(model, cache)
    first = cache[0]
    paged = isinstance(first, PagedBatch)
    grads = _keys_want_grad(model)
    for i, (c, attn) in enumerate(zip(cache, model.attention_layers(), strict=False)):  # the causal LMs: one attention a block
        if paged:
            if (c.seq_ids, c.new_tokens, c.starts) != (first.seq_ids, first.new_tokens, first.starts):
                raise ValueError(f"cache[{i}] batches sequences {c.seq_ids} of {c.new_tokens} new tokens after {c.starts}, cache[0] "
                                 f"{first.seq_ids} of {first.new_tokens} after {first.starts}: one batch per layer of the same tokens")
        else:
            held, want = (c.k.shape[0], c.k.shape[1], c.head_dim), (b, attn.num_kv_heads, attn.head_dim)
            if held != want:
                raise ValueError(f"cache[{i}] holds (B, Hkv, D) = {held}; layer {i} writes {want}")
            if (len(c), c.padded, c.dtype) != (len(first), first.padded, first.dtype):
                raise ValueError(f"cache[{i}] holds {len(c)} tokens ({c.dtype}, padded: {c.padded}), cache[0] {len(first)} ({first.dtype}, "
                                 f"padded: {first.padded}): one cache per layer, each given the same tokens (model.new_caches)")
            c.check_room(t, f"cache[{i}]")
        keys = torch.empty((), dtype=c.dtype, device=weight.device, requires_grad=grads[i])  # as the layer's keys will be
        keys = keys.expand(b, attn.num_kv_heads, t, attn.head_dim)  # (B, Hkv, T, D) as written: no memory
        try:
            arguments.cache_takes(c, weight.dtype, _checks.window(attn.window, attn.causal))
            c.check_append(keys, keys)
        except (TypeError, ValueError) as e:
            raise type(e)(f"cache[{i}] (layer {i}): {e}") from None


def _keys_want_grad(model: object) -> list[bool]:
    """For each block, whether autograd will record its layer's keys (a cache for inference only refuses them): grad on,
    and a parameter they depend on wants a gradient: the embeddings', an earlier block's, or the block's own before its
    attention's output (its first norm and attention where it names them, ``flat_parts``; else any of its own)."""
    blocks = list(model.blocks)
    if not torch.is_grad_enabled():
        return [False] * len(blocks)
    later = [*blocks, model.final_norm, *([] if model.lm_head is None else [model.lm_head])]
    apart = {id(p) for m in later for p in m.parameters()}
    flows = any(p.requires_grad for p in model.parameters() if id(p) not in apart)  # the embeddings
    wanted = []
    for block in blocks:
        names = vars(type(block)).get("flat_parts")
        before = [getattr(block, name) for name in names[:2]] if names else [block]
        wanted.append(flows or any(p.requires_grad for m in before for p in m.parameters()))
        flows = flows or any(p.requires_grad for p in block.parameters())
    return wanted


def _each_layers_own(model: object, cache: list) -> None:
    """A ValueError unless every cache (a paged batch's pool) is given once and belongs to no other module than its layer."""
    held: dict[int, int] = {}
    for i, (c, attn) in enumerate(zip(cache, model.attention_layers(), strict=False)):
        pool = c.cache if isinstance(c, PagedBatch) else c
        if (j := held.setdefault(id(pool), i)) != i:
            raise ValueError(f"cache[{i}] is cache[{j}]: give every layer a cache of its own (a shared cache mixes their keys and values)")
        pool.check_owner(attn)


def logits_kept(logits_to_keep: object, t: int) -> int | Tensor:
    """HuggingFace's ``logits_to_keep``: an int k in [0, T] (0 = every position, else the last k), or a (N,)
    integer tensor of positions in [0, T) (read on the host once: an index out of range would wrap or fail)."""
    if not isinstance(logits_to_keep, Tensor):
        return _checks.integer("logits_to_keep (0 = all positions, or a 1-D tensor of positions)", logits_to_keep, low=0, high=t)
    _checks.integer_tensor("logits_to_keep as a tensor", logits_to_keep, "1-D integer positions (N,)")
    if logits_to_keep.ndim != 1:
        raise ValueError(f"logits_to_keep as a tensor must be 1-D integer positions (N,), got shape {tuple(logits_to_keep.shape)}")
    if _checks.has_values(logits_to_keep) and logits_to_keep.numel():
        _checks.holds(
            ((logits_to_keep >= 0) & (logits_to_keep < t)).all(), f"logits_to_keep must hold positions in [0, T={t})",
            lambda: f", got {logits_to_keep.tolist()}",
        )
    return logits_to_keep


def kept(x: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """(B, T, C) -> (B, T, C) for 0, the last k positions (B, k, C) for an int k, or those listed (B, N, C)."""
    if isinstance(logits_to_keep, Tensor):
        return x[:, logits_to_keep]  # (B, N, C)
    return x[:, -logits_to_keep:] if logits_to_keep else x  # (B, k or T, C)


def check_sampling(
    max_new_tokens: object, temperature: object, top_k: object, eos_token_id: object, vocab_size: int
) -> tuple[int, int | None, int | None]:
    """ValueError/TypeError naming the first of generate's arguments that is out of range or of the wrong type;
    returns max_new_tokens, top_k and eos_token_id as plain ints (a numpy id becomes an int; None stays None)."""
    max_new_tokens = _checks.positive_int("max_new_tokens", max_new_tokens)
    return (max_new_tokens, *check_choice(temperature, top_k, eos_token_id, vocab_size))


def check_choice(temperature: object, top_k: object, eos_token_id: object, vocab_size: int) -> tuple[int | None, int | None]:
    """``check_sampling`` less the count: the arguments that choose and stop tokens; returns top_k and eos_token_id as ints."""
    _checks.number("temperature (0 = greedy)", temperature, low=0.0, high=math.inf, high_open=True)
    if top_k is not None:
        top_k = _checks.positive_int("top_k (or None)", top_k)
    if eos_token_id is not None:
        eos_token_id = _checks.integer("eos_token_id (or None)", eos_token_id, low=0, high=vocab_size - 1)
    return top_k, eos_token_id


#: The largest seed a ``torch.Generator`` takes (an unsigned 64-bit int).
SEED_HIGH = 2**64 - 1


def check_request(
    model: object, prompt: object, max_new_tokens: object, eos_token_id: object, temperature: object, top_k: object, seed: object
) -> tuple[int, int | None, int | None, int | None]:
    """ValueError/TypeError naming the first argument of a request that ``model`` cannot serve (nothing is allocated);
    returns max_new_tokens, top_k, eos_token_id and seed as plain ints (None stays None)."""
    if not isinstance(prompt, Tensor):  # the type is wrong (generate says so the same way)
        raise TypeError(f"prompt must be a 1-D tensor of token ids (T,), got {type(prompt).__name__}")
    if prompt.ndim != 1:
        raise ValueError(f"prompt must be a 1-D tensor of token ids (T,), got {tuple(prompt.shape)}")
    if len(prompt) == 0:
        raise ValueError("prompt must hold at least one token id, got an empty tensor of shape (0,)")
    vocab = model.vocab_size
    on_model(prompt, next(model.parameters()), "prompt")
    token_ids(prompt[None], vocab, "prompt")
    max_new_tokens, top_k, eos_token_id = check_sampling(max_new_tokens, temperature, top_k, eos_token_id, vocab)
    if seed is not None:
        seed = _checks.integer("seed (or None)", seed, low=0, high=SEED_HIGH)
    check_length(model, len(prompt), max_new_tokens)
    return max_new_tokens, top_k, eos_token_id, seed


def check_length(model: object, t: int, max_new_tokens: int, is_token: Tensor | None = None) -> None:
    """Refuse a prompt of ``t`` tokens and ``max_new_tokens`` that would take positions past the model's limit (its
    config's, or a layer's ``context_length`` set lower, where that layer keeps every key).

    The last new token is chosen, never fed back: positions 0 .. t + max_new_tokens - 2 are taken. Left
    padding (``is_token`` (B, t) False) takes none: the longest row's real tokens count, read only where t would not fit.
    A meta mask has no values to read: there the padded width counts, and the message says so.
    """
    name, limit = model.context_limit()
    for i, attn in enumerate(model.attention_layers() if hasattr(model, "attention_layers") else ()):
        n = getattr(attn, "context_length", None)  # a layer's own bound, where it keeps every key (no ring of its window)
        if getattr(attn, "window", None) is None and isinstance(n, int) and (limit is None or n < limit):
            name, limit = f"layer {i}'s context_length", n
    padded = ""
    if limit is not None and t + max_new_tokens - 1 > limit and is_token is not None:
        if _checks.has_values(is_token):
            t = int(is_token.sum(-1).max())  # the one host read, on this path only
        else:
            padded = ", counting the left padding: a meta attention_mask has no values to read the real lengths from"
    if limit is not None and t + max_new_tokens - 1 > limit:
        raise ValueError(f"prompt ({t} tokens) + max_new_tokens ({max_new_tokens}) exceeds {name}={limit} by "
                         f"{t + max_new_tokens - 1 - limit} (the last new token takes no position: it is never fed back{padded})")
