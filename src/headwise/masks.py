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
    _ids("q_pos", q_pos, 1, "(T,)")
    _ids("k_pos", k_pos, 1, "(S,)")
    if window is not None:
        _checks.positive_int("window", window)
    q_pos = q_pos.unsqueeze(-1)  # (T, 1)
    allowed = k_pos <= q_pos  # (T, S)
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def _ids(name: str, t: object, ndim: int, dims: str) -> None:
    """``t`` must be an integer tensor of ``ndim`` dims (``dims``); its values are not read."""
    if _checks.integer_tensor(name, t, f"an integer tensor of shape {dims}").ndim != ndim:
        raise ValueError(f"{name} must have shape {dims}, got {tuple(t.shape)}")


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
    device = _checks.device("device", device)
    _checks.integer("s", s, low=0)
    if window is not None:
        _checks.positive_int("window", window)
    q_pos = torch.arange(s - t, s, device=device)  # (T,)
    k_pos = torch.arange(s, device=device)  # (S,)
    return position_mask(q_pos, k_pos, window=window)


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, S) bool, True = real token  ->  (B, 1, 1, S), broadcastable over heads and queries."""
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a (B, S) tensor, True = real token, got {type(attention_mask).__name__}")
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be a (B, S) tensor, True = real token, got shape {tuple(attention_mask.shape)}")
    return attention_mask[:, None, None, :]  # (B, 1, 1, S)


def inert_padding(x: Tensor, real: Tensor | None) -> Tensor:
    """(B, T, C) input with NaN/Inf at padded tokens (``real`` (B, T) False) set to 0; finite values untouched.

    A padded token's query row would otherwise carry NaN weights, and their gradient reaches
    the real tokens' values (NaN * 0 in weights^T @ grad). A replicated DTensor (tensor parallelism's
    input) is zeroed in its local copy, the same on every rank; another tensor subclass is returned
    unchanged (the core still zeroes padded keys and values).
    """
    if real is None:
        return x
    if type(x) is Tensor:
        return torch.where(real[:, :, None] | x.isfinite(), x, 0.0)  # (B, T, C)
    placements = getattr(x, "placements", None)  # a DTensor's (to_local and from_local carry the gradient)
    if placements is None or not all(p.is_replicate() for p in placements):
        return x
    local = x.to_local()  # (B, T, C): the whole tensor on every rank
    return type(x).from_local(torch.where(real[:, :, None] | local.isfinite(), local, 0.0), x.device_mesh, placements)


def document_mask(q_documents: Tensor, k_documents: Tensor) -> Tensor:
    """(B, T) and (B, S) document ids -> (B, 1, T, S) bool: True where query and key share a document."""
    _ids("q_documents", q_documents, 2, "(B, T)")
    _ids("k_documents", k_documents, 2, "(B, S)")
    if q_documents.shape[0] != k_documents.shape[0]:
        raise ValueError(f"q_documents and k_documents must have one row per batch, got {tuple(q_documents.shape)} and {tuple(k_documents.shape)}")
    return q_documents[:, None, :, None] == k_documents[:, None, None, :]  # (B, 1, T, S)


def documents_from_position_ids(position_ids: Tensor) -> Tensor:
    """Document ids of packed rows from their positions: a new document wherever positions restart at 0.

    transformers' packing convention (e.g. ``DataCollatorWithFlattening``): each document's
    positions count 0, 1, 2, ... within a row.

    Args:
        position_ids: (B, T) integer positions.

    Returns:
        (B, T) int64 ids, 0, 1, 2, ... per row (a row not starting at 0 starts with document 0).

    Example:
        >>> documents_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
        tensor([[0, 0, 0, 1, 1, 2]])
    """
    _checks.integer_tensor("position_ids", position_ids, "a (B, T) integer tensor")
    if position_ids.ndim != 2:
        raise ValueError(f"position_ids must be a (B, T) integer tensor, got shape {tuple(position_ids.shape)}")
    _checks.position_ids(position_ids, *position_ids.shape)
    starts = position_ids == 0  # (B, T)
    starts[:, :1] = False  # the row's first token opens document 0
    return starts.long().cumsum(-1)  # (B, T)


def documents_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Document ids from cumulative lengths (flash-attn's ``cu_seqlens``: 0, len_0, len_0 + len_1, ...).

    Args:
        cu_seqlens: (N + 1,) non-decreasing integers starting at 0, N documents.

    Returns:
        (1, total) int64 ids: document i covers positions cu_seqlens[i] .. cu_seqlens[i+1] - 1.

    Example:
        >>> documents_from_cu_seqlens(torch.tensor([0, 3, 5]))
        tensor([[0, 0, 0, 1, 1]])
    """
    _checks.integer_tensor("cu_seqlens", cu_seqlens, "a 1-D integer tensor (0, len_0, len_0 + len_1, ...)")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with at least one entry (0), got shape {tuple(cu_seqlens.shape)}")
    if not _checks.has_values(cu_seqlens):  # (meta: no lengths to count the ids by)
        raise ValueError("cu_seqlens must hold values the ids are counted by (not a meta tensor, nor one vmap batches), got "
                         f"one on {cu_seqlens.device}")
    lengths = cu_seqlens.long().diff()  # (N,): int64 (narrower ints wrap in the difference, and repeat counts take no less)
    if int(cu_seqlens[0]) != 0 or bool((lengths < 0).any()):  # one host read: lengths are needed there anyway
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu_seqlens.tolist()}")
    ids = torch.arange(lengths.numel(), device=cu_seqlens.device)  # (N,)
    return ids.repeat_interleave(lengths)[None]  # (1, total)


def positions(is_token: Tensor | None, b: int, t: int, device: torch.device, start: int | Tensor = 0) -> Tensor:
    """(B, T) position ids of T new tokens: start .. start+T-1, or with padding ``is_token`` (B, T) bool start + the
    count of real tokens before (a pad: start), as HuggingFace's ``generate`` numbers them; ``start`` one int for
    every row, or (B, 1) each row's own (a padded cache's real tokens)."""
    if is_token is None:
        if isinstance(start, int):
            return torch.arange(start, start + t, device=device).expand(b, t)  # (B, T)
        return start + torch.arange(t, device=device)  # (B, T)
    return (is_token.long().cumsum(-1) - 1).masked_fill(~is_token, 0) + start  # (B, T)
