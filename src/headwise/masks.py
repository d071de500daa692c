"""Boolean attention masks, True = may attend (the convention of torch's SDPA).

Every mask headwise builds comes from one rule over absolute token positions: a query at
position p may see a key at position j when ``j <= p`` (causal) and, with a sliding window
W, ``j > p - W``. Queries are aligned bottom-right: with T queries over S keys, query i sits
at position ``i + S - T``, which is what decoding with a KV cache needs (torch's SDPA
``is_causal`` aligns top-left instead, wrong whenever T < S).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _checks


def position_mask(q_pos: Tensor, k_pos: Tensor, *, window: int | None = None) -> Tensor:
    """Causal (optionally windowed) mask from positions.

    Args:
        q_pos: (T,) absolute positions of the queries.
        k_pos: (S,) absolute positions of the keys.
        window: a query at p sees keys p-window+1 .. p; None = all earlier keys.

    Returns:
        (T, S) bool, True = may attend.
    """
    q_pos = q_pos.unsqueeze(-1)  # (T, 1)
    allowed = k_pos <= q_pos  # (T, S)
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def causal_mask(t: int, s: int, *, window: int | None = None, device=None) -> Tensor:
    """Bottom-right aligned causal mask: query i sees keys ``j <= i + s - t``.

    Args:
        t: queries T (a query placed before the first key sees nothing).
        s: keys S.
        window: a query at p sees keys p-window+1 .. p (a positive int); None = all earlier keys.

    Returns:
        (T, S) bool, True = may attend.

    Example:
        >>> causal_mask(2, 4)
        tensor([[ True,  True,  True, False],
                [ True,  True,  True,  True]])
    """
    _checks.integer("t", t, low=0)
    _checks.integer("s", s, low=0)
    if window is not None:
        _checks.positive_int("window", window)
    q_pos = torch.arange(s - t, s, device=device)  # (T,)
    k_pos = torch.arange(s, device=device)  # (S,)
    return position_mask(q_pos, k_pos, window=window)


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, S) bool, True = real token  ->  (B, 1, 1, S), broadcastable over heads and queries."""
    return attention_mask[:, None, None, :]  # (B, 1, 1, S)


def inert_padding(x: Tensor, real: Tensor | None) -> Tensor:
    """(B, T, C) input with NaN/Inf at padded tokens (``real`` (B, T) False) set to 0; finite values untouched.

    A padded token's query row would otherwise carry NaN weights, and their gradient reaches
    the real tokens' values (NaN * 0 in weights^T @ grad). A tensor subclass (DTensor under
    tensor parallelism) is returned unchanged; the core still zeroes padded keys and values.
    """
    if real is None or type(x) is not Tensor:  # a DTensor (tensor parallelism) cannot mix with the plain mask: left as it is
        return x
    return torch.where(real[:, :, None] | x.isfinite(), x, 0.0)  # (B, T, C)
