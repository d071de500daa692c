"""Checks for what users pass to the models: token ids and HuggingFace-style attention masks."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _checks


def token_ids(input_ids: object, vocab_size: int, name: str = "input_ids") -> tuple[int, int]:
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
    if not _checks.has_values(input_ids):
        return input_ids.shape[0], input_ids.shape[1]
    expected = f"{name} must hold ids in [0, vocab_size={vocab_size})"
    if torch.compiler.is_compiling():  # no host read inside a graph: an assert in it
        _checks.holds(((input_ids >= 0) & (input_ids < vocab_size)).all(), expected)
        return input_ids.shape[0], input_ids.shape[1]
    low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()  # one host read (a device sync on a GPU)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{expected}, got ids from {low} to {high}")
    return input_ids.shape[0], input_ids.shape[1]


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
    real = None if mask is None else attention_mask(mask, (b, t), device=input_ids.device)  # (B, T) bool
    return b, t, real


def padding_only(real: Tensor | None) -> Tensor | None:
    """The key padding mask to pass on: None when nothing is padding (lets SDPA use is_causal).

    Asking costs one host read (a device sync on a GPU), once per forward or ``generate``:
    it buys mask-free fused attention in every layer (and every decode step) after it. Under
    ``torch.compile`` the mask is passed on as it is (the same numbers): a branch on its values
    would break the graph.
    """
    if real is None or torch.compiler.is_compiling():
        return real
    if _checks.has_values(real) and bool(real.all()):
        return None
    return real
