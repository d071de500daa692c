"""Text in, text out: a tokenizer around ``model.generate``.

``generate_text(model, tokenizer, prompt)`` encodes the prompt, continues it with the model's
``generate`` (greedy by default) and decodes the new tokens. The tokenizer is anything with
``encode(text).ids`` and ``decode(ids)``: a ``tokenizers.Tokenizer``, read from a HuggingFace
directory's ``tokenizer.json`` or trained on the spot (``examples/generate_text.py`` trains a
byte-level BPE and a tiny GPT-2 offline, then lets it speak).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .. import _checks
from .generate import GenerationMixin


class Encoding(Protocol):
    ids: list[int]


class Tokenizer(Protocol):
    """What ``generate_text`` reads of a tokenizer (``tokenizers.Tokenizer`` has it)."""

    def encode(self, sequence: str) -> Encoding: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


def generate_text(
    model: GenerationMixin,
    tokenizer: Tokenizer,
    prompt: str | Sequence[str],
    *,
    max_new_tokens: int = 32,
    temperature: float = 0.0,
    top_k: int | None = None,
    eos_token: str | None = None,
    generator: torch.Generator | None = None,
) -> str | list[str]:
    """Continue ``prompt`` with ``model`` and return the continuation as text (the prompt not repeated).

    Args:
        model: a causal language model of ``headwise.models`` (GPT-2, the Llama family), in eval mode.
        tokenizer: its tokenizer: ``encode(text).ids`` and ``decode(ids)`` (a ``tokenizers.Tokenizer``).
        prompt: one text, or a list of texts continued as one batch (padded on the left).
        max_new_tokens, temperature, top_k, generator: as ``model.generate`` (temperature 0 = greedy).
        eos_token: a token (e.g. ``"<|endoftext|>"``) that ends a continuation, or None.

    Returns:
        The continuation of each prompt: a string for a string, a list for a list. Each is the
        decoded prompt-and-continuation with the decoded prompt cut off, so a character whose
        bytes straddle the two comes out whole.

    Example:
        >>> from headwise.models.text import generate_text     # a model and tokenizer: examples/generate_text.py
        >>> generate_text(model, tokenizer, "Beautiful is better than")  # doctest: +SKIP
        ' ugly.\\nExplicit is better than implicit.\\n...'
    """
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"model must be a causal language model of headwise.models (with generate), got {type(model).__name__}")
    if not all(callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
        raise TypeError(f"tokenizer must have encode(text).ids and decode(ids), such as tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    single = isinstance(prompt, str)
    prompts = [prompt] if single else prompt
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompt must be a non-empty str or a non-empty list of non-empty str, got {prompt!r}")
    if not prompts or not all(prompts):  # the right types, an empty value: a ValueError
        raise ValueError(f"prompt must be a non-empty str or a non-empty list of non-empty str, got {prompt!r}")
    encoded = [list(tokenizer.encode(p).ids) for p in prompts]
    empty = [p for p, ids in zip(prompts, encoded, strict=True) if not ids]
    if empty:
        raise ValueError(f"prompt {empty[0]!r} encodes to no tokens with this tokenizer")
    vocab = model.vocab_size
    high = max(max(ids) for ids in encoded)
    if high >= vocab:
        raise ValueError(f"the tokenizer gives id {high} for {prompts!r}, but the model's vocab_size is {vocab}: are they a pair?")
    eos = _eos_id(tokenizer, eos_token)
    longest = max(len(ids) for ids in encoded)
    pad = 0 if eos is None else eos  # under the mask: any id in the vocabulary
    device = next(model.parameters()).device if isinstance(model, torch.nn.Module) else None
    ids = torch.tensor([[pad] * (longest - len(e)) + e for e in encoded], device=device)  # (B, T), padded on the left
    mask = torch.tensor([[False] * (longest - len(e)) + [True] * len(e) for e in encoded], device=device)  # (B, T), True = real
    out = model.generate(ids, attention_mask=None if bool(mask.all()) else mask, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, eos_token_id=eos, generator=generator)  # (B, T + n)
    texts = []
    for e, row in zip(encoded, out[:, longest:].tolist(), strict=True):
        new = row[: row.index(eos)] if eos is not None and eos in row else row  # up to the end token
        head = tokenizer.decode(e)
        whole = tokenizer.decode(e + new)
        texts.append(whole[len(head):] if whole.startswith(head) else tokenizer.decode(new))
    return texts[0] if single else texts


def _eos_id(tokenizer: Tokenizer, eos_token: object) -> int | None:
    if eos_token is None:
        return None
    if not isinstance(eos_token, str):
        raise TypeError(f"eos_token must be a token of the tokenizer (str) or None, got {type(eos_token).__name__}")
    token_to_id = getattr(tokenizer, "token_to_id", None)
    eos = token_to_id(eos_token) if callable(token_to_id) else None
    if eos is None:
        raise ValueError(f"eos_token {eos_token!r} is not a token of this tokenizer")
    return _checks.integer("the id of eos_token", eos, low=0)
