"""What each attention head of an encoder looks at: the previous token, the next, itself, or [CLS]/[SEP].

``attention_maps`` observes a forward pass (``headwise.observe``) and computes each layer's
weights with ``headwise.attention_weights``; ``attention_mass`` averages, over the real
non-special query tokens, the weight each head puts on each kind of key; ``head_roles``
does both for sentences. All return data; the demo prints it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _checks
from ..functional import attention_weights, split_heads
from ..layer import AttentionLayer
from ..observe import observe
from .bert import BertModel, SentenceEncoder

#: The kinds of key a head may favour, in the order of ``HeadRoles.mass``'s last axis.
KINDS = ("previous", "next", "self", "[CLS]/[SEP]")


@dataclass(frozen=True)
class HeadRoles:
    """Where each head's attention goes, on average over real, non-special query tokens.

    Attributes:
        mass: (L, H, 4) mean weight on the previous token, the next token, the token itself
            and the special tokens ([CLS]/[SEP]); the rest of each row goes elsewhere.
        kinds: names of the 4 kinds, in ``mass`` order.
    """

    mass: Tensor
    kinds: tuple[str, ...] = KINDS

    def role(self, layer: int, head: int, *, threshold: float = 0.5) -> str | None:
        """The kind that gets at least ``threshold`` (a number in [0, 1]) of the head's weight, or None (mixed)."""
        threshold = _checks.number("threshold", threshold, low=0.0, high=1.0)
        layer = _checks.integer("layer", layer, low=0, high=self.mass.shape[0] - 1)
        head = _checks.integer("head", head, low=0, high=self.mass.shape[1] - 1)
        share, kind = self.mass[layer, head].max(dim=-1)
        return self.kinds[int(kind)] if float(share) >= threshold else None

    def heads(self, kind: str, *, threshold: float = 0.5) -> list[tuple[int, int, float]]:
        """``(layer, head, share)`` of every head whose role is ``kind``, the strongest first."""
        if kind not in self.kinds:
            raise ValueError(f"kind must be one of {list(self.kinds)}, got {kind!r}")
        k = self.kinds.index(kind)
        found = [
            (layer, head, float(self.mass[layer, head, k]))
            for layer in range(self.mass.shape[0])
            for head in range(self.mass.shape[1])
            if self.role(layer, head, threshold=threshold) == kind
        ]
        return sorted(found, key=lambda row: -row[2])


@torch.no_grad()
def attention_maps(model: BertModel, input_ids: Tensor, attention_mask: Tensor | None = None) -> list[Tensor]:
    """Every layer's attention weights on one batch: a list of L tensors (B, H, T, T).

    The forward pass is observed; each layer's queries and keys go through
    ``headwise.attention_weights`` with the same padding mask (True = real key).

    Raises:
        ValueError: the model's layers compute some of its heads only (sharded by ``headwise.parallel``).
    """
    if not isinstance(model, BertModel):
        hint = " (a SentenceEncoder: pass its .model)" if isinstance(model, SentenceEncoder) else ""
        raise TypeError(f"model must be a BertModel{hint}, got {type(model).__name__}")
    heads = model.config.num_attention_heads
    local = sorted({m.num_heads for m in model.modules() if isinstance(m, AttentionLayer)})
    if local and local != [heads]:
        raise ValueError(f"attention_maps needs every head in this process: the model's attention layers compute {local} of its "
                         f"{heads} heads (sharded by headwise.parallel); compute the maps on an unsharded copy")
    seen: dict[str, list[Tensor]] = {"queries": [], "keys": []}

    def keep(name: str, tensor: Tensor) -> None:
        if name in seen:
            seen[name].append(tensor)

    with observe(keep):
        model(input_ids, attention_mask)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    return [
        attention_weights(split_heads(q, head_dim), split_heads(k, head_dim), attention_mask=attention_mask)  # (B, H, T, T)
        for q, k in zip(seen["queries"], seen["keys"], strict=True)
    ]


def attention_mass(weights: list[Tensor], special: Tensor, is_token: Tensor) -> Tensor:
    """Mean weight each head puts on the previous / next / same / special key.

    Args:
        weights: L tensors (B, H, T, T), rows summing to 1.
        special: (B, T) bool, True at [CLS]/[SEP] (and other special) tokens.
        is_token: (B, T) bool, True at real (not padding) tokens.

    Returns:
        (L, H, 4) float32 in ``KINDS`` order, averaged over queries that are real and not special.
        A previous or next key that is special or padding counts as special or not at all,
        never as "previous" / "next".

    Raises:
        TypeError: ``weights`` is not a list or tuple of floating-point tensors (any floating
            dtype: they are read as float32); ``special`` or ``is_token`` is not a bool tensor.
        ValueError: ``weights`` is empty, or one of them is not (B, H, T, T) with the same shape
            and device as ``weights[0]`` (the error names its index); ``special`` or ``is_token``
            is not (B, T) on that device.
    """
    B, _, T, _ = _layer_weights(weights)
    for name, mask in (("special", special), ("is_token", is_token)):
        _token_mask(name, mask, B, T, weights[0].device)
    i = torch.arange(T, device=weights[0].device)
    plain = is_token & ~special  # (B, T) keys that are ordinary tokens
    queries = plain.float()  # (B, T) the queries averaged over
    n = queries.sum().clamp(min=1)
    out = []
    for w in weights:
        w = w.float()  # (B, H, T, T)
        diag = [torch.zeros_like(w[..., 0]) for _ in range(3)]  # 3 x (B, H, T)
        diag[0][..., 1:] = w[..., i[1:], i[:-1]] * plain[:, None, :-1]  # previous key, if ordinary
        diag[1][..., :-1] = w[..., i[:-1], i[1:]] * plain[:, None, 1:]  # next key, if ordinary
        diag[2] = w[..., i, i]  # itself
        on_special = (w * special[:, None, None, :]).sum(-1)  # (B, H, T)
        per_query = torch.stack([*diag, on_special], dim=-1)  # (B, H, T, 4)
        out.append((per_query * queries[:, None, :, None]).sum(dim=(0, 2)) / n)  # (H, 4)
    return torch.stack(out)  # (L, H, 4)


def _layer_weights(weights: object) -> torch.Size:
    """The (B, H, T, T) shape every tensor of ``weights`` (a non-empty list or tuple) shares."""
    if not isinstance(weights, (list, tuple)):
        hint = ": wrap one layer's in a list, or pass list(t) for L layers stacked (L, B, H, T, T)" if isinstance(weights, Tensor) else ""
        raise TypeError(f"weights must be a list of L tensors (B, H, T, T), one per layer, got {type(weights).__name__}{hint}")
    if not weights:
        raise ValueError(f"weights must hold at least one layer's (B, H, T, T) tensor, got an empty {type(weights).__name__}")
    for i, w in enumerate(weights):
        name = f"weights[{i}]"
        if not isinstance(w, Tensor):
            raise TypeError(f"{name} must be a tensor (B, H, T, T), got {type(w).__name__}")
        if not w.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (attention weights, rows summing to 1), got dtype {w.dtype}")
        if w.ndim != 4 or w.shape[-1] != w.shape[-2]:
            raise ValueError(f"{name} must be (B, H, T, T): one (T, T) map per batch row and head, got shape {tuple(w.shape)}")
        if w.shape != weights[0].shape:
            raise ValueError(f"{name} has shape {tuple(w.shape)} but weights[0] has {tuple(weights[0].shape)}: "
                             "every layer's must be the same (B, H, T, T)")
        _checks.same_device(name, w, "weights[0]", weights[0].device)
    return weights[0].shape


def _token_mask(name: str, mask: object, B: int, T: int, device: torch.device) -> None:
    """``mask`` must be a bool (B, T) tensor on ``device``, where the weights are."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a bool tensor (B, T), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (B, T), got dtype {mask.dtype}: pass {name}.bool() for a 0/1 mask")
    if mask.shape != (B, T):
        raise ValueError(f"{name} must be (B, T) = {(B, T)}, the weights' batch and tokens, got shape {tuple(mask.shape)}")
    _checks.same_device(name, mask, "the weights", device)


def special_tokens(encoder: SentenceEncoder, input_ids: Tensor, attention_mask: Tensor, name: str, given: object) -> Tensor:
    """(N, T) bool: where the tokens the encoder's post-processor adds sit ([CLS] and [SEP], or a RoBERTa-style
    tokenizer's <s> and </s>, by their ids); a ValueError naming ``name`` (``given``) when nothing else is real."""
    special = torch.isin(input_ids, torch.tensor(encoder.special_ids, dtype=input_ids.dtype, device=input_ids.device))  # (N, T)
    if not (attention_mask.bool() & ~special).any():
        names = " and ".join(dict.fromkeys(encoder.special_tokens)) or "the special tokens"
        raise ValueError(f"{name} must hold a token besides {names} (the heads are profiled over them), got {given!r}")
    return special


def head_roles(encoder: SentenceEncoder, sentences: list[str]) -> HeadRoles:
    """Run ``sentences`` through ``encoder`` and profile every head (see ``attention_mass``)."""
    if not isinstance(encoder, SentenceEncoder):
        raise TypeError(
            f"encoder must be a SentenceEncoder (a BertModel with its tokenizer), got {type(encoder).__name__}; "
            "for a model without a tokenizer, use attention_maps(model, input_ids, attention_mask) and attention_mass"
        )
    input_ids, attention_mask = encoder.tokenize(sentences)  # (N, T) x2
    special = special_tokens(encoder, input_ids, attention_mask, "sentences", sentences)  # (N, T)
    weights = attention_maps(encoder.model, input_ids, attention_mask)
    return HeadRoles(attention_mass(weights, special, attention_mask))
