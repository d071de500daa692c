"""Model configurations: frozen dataclasses with HuggingFace's field names, checked when built.

``FromDict`` gives GPT-2's and BERT's configs ``from_dict`` (a ``config.json`` dict; other keys ignored; the Llama
family's ``LlamaConfig.from_dict`` reads its model type's defaults and rope settings as loading does);
``GPT2Config`` lives here with its exact-name presets (``BertConfig`` in ``headwise.models.bert``).
Every field is checked for type and range in ``__post_init__``, so a bad ``config.json`` fails
while the config is built, naming the field, and never as NaN logits later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

from . import _checks

C = TypeVar("C", bound="FromDict")


class FromDict:
    """``from_dict`` for a config dataclass: keys that are not fields are ignored (HuggingFace adds many)."""

    @classmethod
    def from_dict(cls: type[C], d: dict[str, Any]) -> C:
        """From a HuggingFace ``config.json`` dict; keys that are not fields are ignored."""
        if not isinstance(d, dict):
            raise TypeError(f"d must be a dict (a parsed config.json), got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def store(config: object, name: str, check: Callable[[str, object], object] = _checks.positive_int) -> None:
    """Check the field ``name`` of a frozen config with ``check`` (a positive int by default) and keep what it returns:
    a plain ``int`` or ``float`` (a numpy scalar passes the check, but would not write to JSON)."""
    object.__setattr__(config, name, check(name, getattr(config, name)))


@dataclass(frozen=True)
class GPT2Config(FromDict):
    """GPT-2 hyper-parameters, named as in HuggingFace's ``config.json``.

    ``n_kv_head`` (None = ``n_head``) turns on grouped-query attention; GPT-2 itself has none.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None
    attn_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            store(self, name)
        if self.n_kv_head is not None:
            store(self, "n_kv_head")
        _checks.heads("n_embd", self.n_embd, self.n_head, self.n_kv_head, names=("n_head", "n_kv_head"))
        for name in ("attn_pdrop", "resid_pdrop", "embd_pdrop"):
            store(self, name, _checks.dropout)
        store(self, "layer_norm_epsilon", _checks.epsilon)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> GPT2Config:
        """``GPT2Config.from_preset("gpt2-medium")``; overrides replace fields."""
        if not isinstance(name, str) or name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; valid: {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25),
}
