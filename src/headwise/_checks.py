"""Argument checks shared by the modules: each raises ValueError/TypeError naming the argument."""

from __future__ import annotations

import torch
from torch import Tensor


def positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def dropout(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


def heads(width_name: str, width: int, num_heads: int, num_kv_heads: int | None) -> int:
    """Check that the heads split the width; return num_kv_heads (default num_heads)."""
    positive_int("num_heads", num_heads)
    if width % num_heads:
        raise ValueError(f"{width_name} ({width}) must be divisible by num_heads ({num_heads})")
    if num_kv_heads is None:
        return num_heads
    positive_int("num_kv_heads", num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    return num_kv_heads


def window(value: int | None, causal: bool) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"window must be a positive int or None, got {value!r}")
    if not causal:
        raise ValueError("window (sliding-window attention) needs causal=True, got causal=False")
    return value


def tokens(x: object, d_in: int, name: str = "x") -> tuple[int, int]:
    """Check ``x`` is (batch, tokens, d_in) float; return (B, T)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (batch, tokens, {d_in}), got {type(x).__name__}")
    if x.ndim != 3 or x.shape[-1] != d_in:
        raise ValueError(f"{name} must have shape (batch, tokens, d_in={d_in}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x.shape[0], x.shape[1]


def key_padding_mask(mask: object, b: int, t: int, dims: str = "(batch, tokens)") -> None:
    """Check a key padding mask is a bool tensor of shape (b, t); ``dims`` names that shape in the message."""
    if mask is None:
        return
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"key_padding_mask must be a bool tensor (True = real token), got {got}")
    if tuple(mask.shape) != (b, t):
        raise ValueError(f"key_padding_mask must have shape {dims} = {(b, t)}, got {tuple(mask.shape)}")


def context(t: int, past: int, context_length: int, sliding: bool) -> None:
    """Tokens beyond context_length break the book's mask: say so instead."""
    if not sliding and past + t > context_length:
        cached = f" ({past} cached + {t} new)" if past else ""
        raise ValueError(f"got {past + t} tokens{cached}, more than context_length={context_length}")
