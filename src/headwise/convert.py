"""Conversions that keep the function exactly, and loading that is all-or-nothing.

State-dict conversions are pure ``dict -> dict`` functions; they raise one ValueError naming
every missing, unexpected and mis-shaped key before anything is loaded (``remap`` and
``check_state``, from ``headwise.loadable``, where every loader's check lives).

Module conversions show the book's claim in code (the formulations compute one function):
- ``wrapper_to_mha``: the stacked heads' weights, concatenated, are MultiHeadAttention's
  projections (its out_proj set to the identity);
- ``mha_to_gpt2`` / ``gpt2_to_mha``: W_query, W_key, W_value stacked are GPT-2's c_attn.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from .config import GPT2Config
from .fused import GPT2MultiHeadAttention
from .loadable import StateDictError, check_loadable, check_state, remap
from .teaching import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper

#: HuggingFace GPT-2 stores these as Conv1D weights, (in, out): transposed on the way in.
HF_GPT2_TRANSPOSED = ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def is_legacy_gpt2_buffer(key: str) -> bool:
    """Old GPT-2 checkpoints carry ``attn.bias`` (a causal tril) and ``attn.masked_bias``."""
    parts = key.split(".")
    return parts[-1] in ("bias", "masked_bias") and (len(parts) == 1 or parts[-2] == "attn")


def load_checked(
    module: nn.Module,
    state: Mapping[str, Tensor],
    *,
    rename: Callable[[str], str] = lambda key: key,
    transposed: tuple[str, ...] = (),
    ignore: Callable[[str], bool] = lambda key: False,
    source: str | os.PathLike[str] = "state dict",
    named: Callable[[str], str] = lambda key: key,
    problems: Sequence[str] = (),
) -> nn.Module:
    """Check ``state`` completely against ``module`` (``check_state``; ``named``: a missing key's name in ``state``,
    ``rename``'s inverse; ``problems``: the caller's own findings, listed with the rest), then load it strictly.

    A module built on the meta device (``with torch.device("meta")``) is checked from its
    shapes alone and only then given memory (``to_empty``; the strict load fills every
    entry), so a checkpoint that does not fit its config fails before anything the size of
    the config is allocated. (A module that keeps plain tensor attributes, which ``to_empty``
    does not move, must be checked on a meta copy with ``check_state`` and built for real.)

    Raises:
        ValueError: naming ``source`` and listing every problem at once; ``module`` is then
            unchanged.
    """
    converted = check_state(module, state, rename=rename, transposed=transposed, ignore=ignore, source=source, named=named,
                            problems=problems)  # raises before anything changes
    if any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers()):
        volatile = [name for name, _ in module.named_buffers() if name not in module.state_dict()]
        if volatile:  # to_empty would leave them uninitialised: nothing in the checkpoint fills them
            raise ValueError(f"cannot load into a module on the meta device with non-persistent buffers: {volatile}")
        module.to_empty(device="cpu")  # memory only now; load_state_dict fills every entry of it
    nn.Module.load_state_dict(module, converted, strict=True)  # torch's copy: the whole state was checked above (not again by AllOrNothing)
    return module


def _module(name: str, module: object, cls: type, function: str) -> None:
    if not isinstance(module, cls):
        others = {MultiHeadAttentionWrapper: "wrapper_to_mha", MultiHeadAttention: "mha_to_gpt2", GPT2MultiHeadAttention: "gpt2_to_mha"}
        hint = next((f"; for a {kind.__name__} use {fn}" for kind, fn in others.items() if isinstance(module, kind)), "")
        raise TypeError(f"{function} converts a {cls.__name__}: {name} must be one, got {type(module).__name__}{hint}")


def _after_attn(key: str) -> str:
    """``h.0.attn.c_attn.weight`` -> ``c_attn.weight``: drop a prefix ending in an ``attn`` component."""
    return ("." + key).rsplit(".attn.", 1)[-1].lstrip(".")


def gpt2_attention_from_hf(module: GPT2MultiHeadAttention, state: Mapping[str, Tensor]) -> GPT2MultiHeadAttention:
    """Load a HuggingFace ``GPT2Attention`` state dict (Conv1D, (in, out) weights) into ``module``.

    Keys may carry a prefix ending in ``attn.`` (``h.0.attn.c_attn.weight``) or none
    (``c_attn.weight``); the legacy ``bias`` / ``masked_bias`` buffers are ignored.
    """
    _module("module", module, GPT2MultiHeadAttention, "gpt2_attention_from_hf")
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to tensors (a state dict), got {type(state).__name__}")
    return load_checked(module, state, rename=_after_attn, transposed=HF_GPT2_TRANSPOSED, ignore=is_legacy_gpt2_buffer)


@torch.no_grad()
def wrapper_to_mha(wrapper: MultiHeadAttentionWrapper) -> MultiHeadAttention:
    """The MultiHeadAttention that computes exactly what ``wrapper`` computes.

    Head i's W_query rows become rows [i*d, (i+1)*d) of W_query (the same for keys and
    values); out_proj is the identity with zero bias, since the wrapper just concatenates.
    The heads must be alike (a head changed by hand is a ValueError naming it); the result is
    in the wrapper's mode (``training``).
    """
    _module("wrapper", wrapper, MultiHeadAttentionWrapper, "wrapper_to_mha")
    if len(wrapper.heads) == 0:
        raise ValueError("wrapper_to_mha needs at least one head: wrapper.heads is empty")
    first = wrapper.heads[0]
    for i, head in enumerate(wrapper.heads):
        _module(f"wrapper.heads[{i}]", head, CausalAttention, "wrapper_to_mha")
        for field, value in _head_fields(head).items():
            if value != _head_fields(first)[field]:
                raise ValueError(f"wrapper_to_mha needs alike heads: heads[{i}] has {field}={value}, heads[0] has {_head_fields(first)[field]}")
    shapes, biases = _head_fields(first)["shapes"], _head_fields(first)["biases"]
    if set(shapes) != {(first.d_out, first.d_in)}:
        raise ValueError(f"wrapper_to_mha needs W_query, W_key and W_value of (d_out, d_in) = {(first.d_out, first.d_in)}: "
                         f"the heads' are {shapes}")
    if len(set(biases)) != 1:
        raise ValueError(f"MultiHeadAttention has one qkv_bias for W_query, W_key and W_value: the heads' biases are (W_query, W_key, "
                         f"W_value) = {biases}")
    h, d = len(wrapper.heads), first.d_out
    mha = MultiHeadAttention(
        first.d_in, h * d, first.context_length, first.dropout.p, h, biases[0],
        causal=first.causal, backend=first.backend,
    ).to(first.W_query.weight)  # built in the source dtype/device: copying into float32 would round float64 weights
    for name in ("W_query", "W_key", "W_value"):
        target = getattr(mha, name)
        target.weight.copy_(torch.cat([getattr(head, name).weight for head in wrapper.heads]))  # (C, d_in)
        if target.bias is not None:
            target.bias.copy_(torch.cat([getattr(head, name).bias for head in wrapper.heads]))  # (C,)
    mha.out_proj.weight.copy_(torch.eye(h * d, dtype=mha.out_proj.weight.dtype, device=mha.out_proj.weight.device))
    mha.out_proj.bias.zero_()
    return mha.train(wrapper.training)


def _head_fields(head: CausalAttention) -> dict[str, object]:
    """What one head of a wrapper must share with the others for one MultiHeadAttention to compute them all."""
    w, layers = head.W_query.weight, (head.W_query, head.W_key, head.W_value)
    return {"d_in": head.d_in, "d_out": head.d_out, "context_length": head.context_length, "dropout": head.dropout.p,
            "shapes": tuple(tuple(layer.weight.shape) for layer in layers), "biases": tuple(layer.bias is not None for layer in layers),
            "causal": head.causal, "backend": head.backend, "dtype": w.dtype, "device": w.device}


def _linear_into(target: nn.Linear, source: nn.Linear) -> None:
    """``source``'s weight and bias into ``target`` (a zero bias where ``source`` has none)."""
    target.weight.copy_(source.weight)
    if target.bias is not None:
        target.bias.copy_(source.bias if source.bias is not None else torch.zeros_like(target.bias))


@torch.no_grad()
def mha_to_gpt2(mha: MultiHeadAttention) -> GPT2MultiHeadAttention:
    """GPT-2's layout of ``mha``: c_attn = [W_query; W_key; W_value] (zero bias if it had none), causal or not.

    GPT-2's layout has one input width and no softcap, sinks or ALiBi: a module using any of
    them is refused (a ValueError naming it) rather than converted without it."""
    _module("mha", mha, MultiHeadAttention, "mha_to_gpt2")
    if mha.d_in != mha.d_out or mha.kv_dim != mha.d_in:
        raise ValueError(f"GPT-2's c_attn reads one width: d_in == d_out == kv_dim; got d_in={mha.d_in}, d_out={mha.d_out}, kv_dim={mha.kv_dim}")
    terms = [name for name, on in (("softcap", mha.softcap is not None), ("sinks", hasattr(mha, "sinks")), ("alibi", hasattr(mha, "alibi_slopes"))) if on]
    if terms:
        raise ValueError(f"GPT-2's layout has no {', '.join(terms)}: mha_to_gpt2 would drop it; got a MultiHeadAttention with {', '.join(terms)}")
    config = GPT2Config(
        n_positions=mha.context_length, n_embd=mha.d_out, n_head=mha.num_heads,
        n_kv_head=mha.num_kv_heads, attn_pdrop=mha.dropout.p, resid_pdrop=0.0,
    )
    attn = GPT2MultiHeadAttention(config, window=mha.window, backend=mha.backend, causal=mha.causal).to(mha.W_query.weight)
    layers = (mha.W_query, mha.W_key, mha.W_value)
    attn.c_attn.weight.copy_(torch.cat([layer.weight for layer in layers]))  # (C + 2*Hkv*D, C)
    attn.c_attn.bias.copy_(torch.cat([layer.bias if layer.bias is not None else layer.weight.new_zeros(layer.out_features) for layer in layers]))
    _linear_into(attn.c_proj, mha.out_proj)
    return attn.train(mha.training)


@torch.no_grad()
def gpt2_to_mha(attn: GPT2MultiHeadAttention) -> MultiHeadAttention:
    """The MultiHeadAttention (qkv_bias=True) computing exactly what ``attn`` computes, in its mode (``training``).

    GPT-2's resid dropout (after c_proj) has no place in MultiHeadAttention: converted in training
    mode with ``attn.resid_dropout.p > 0`` it is refused (a ValueError) rather than dropped; in eval
    mode it acts nowhere, and the result computes the same (switched to training, without it). The
    dropouts are read from the module's own ``nn.Dropout``s (what its forward runs), not its config."""
    _module("attn", attn, GPT2MultiHeadAttention, "gpt2_to_mha")
    c, resid_p = attn.config, attn.resid_dropout.p
    if attn.training and resid_p > 0:
        raise ValueError(
            f"MultiHeadAttention has no dropout after out_proj: gpt2_to_mha of a module in training mode would drop GPT-2's "
            f"resid_dropout.p={resid_p}; convert it in eval mode (attn.eval()), or with attn.resid_dropout.p = 0"
        )
    mha = MultiHeadAttention(
        c.n_embd, c.n_embd, c.n_positions, attn.attn_dropout.p, c.n_head, qkv_bias=attn.c_attn.bias is not None,
        window=attn.window, num_kv_heads=c.n_kv_head, backend=attn.backend, causal=attn.causal,
    ).to(attn.c_attn.weight)
    kv = attn.num_kv_heads * attn.head_dim
    sizes = [attn.d_in, kv, kv]
    biases = attn.c_attn.bias.split(sizes) if attn.c_attn.bias is not None else (None,) * 3
    for layer, w, b in zip((mha.W_query, mha.W_key, mha.W_value), attn.c_attn.weight.split(sizes), biases, strict=True):
        layer.weight.copy_(w)
        if b is not None:
            layer.bias.copy_(b)
    _linear_into(mha.out_proj, attn.c_proj)
    return mha.train(attn.training)


__all__ = ["HF_GPT2_TRANSPOSED", "StateDictError", "check_loadable", "check_state", "gpt2_attention_from_hf", "gpt2_to_mha",
           "is_legacy_gpt2_buffer", "load_checked", "mha_to_gpt2", "remap", "wrapper_to_mha"]  # fmt: skip
