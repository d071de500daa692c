"""The configuration of the Llama family (Llama 2/3, Mistral, Qwen3), read from HuggingFace's config.json.

One frozen dataclass covers the three: they differ in a few fields, not in structure.
Mistral adds a sliding window, Qwen3 an RMSNorm over each head's queries and keys (QK-norm)
and an explicit head size. Rotary settings are read from either spelling HuggingFace has used:
``rope_theta`` + ``rope_scaling`` (transformers 4 and the hub's files) or ``rope_parameters``
(transformers 5).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

from .. import _checks
from ..config import store
from ..rope import check_scaling

MODEL_TYPES = ("llama", "mistral", "qwen3")
LAYER_TYPES = ("full_attention", "sliding_attention")  # the attention kinds of layer_types this family runs

#: What transformers' config class of each model type gives a key config.json leaves out, where
#: ``LlamaConfig``'s default differs (a key present, even as null, is read as it is).
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"intermediate_size": 14336, "num_key_value_heads": 8, "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen3": {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "sliding_window": 4096},
}
#: Keys a model type's transformers modules never read (Mistral's projections have no bias, nor Qwen3's MLP).
IGNORED: dict[str, tuple[str, ...]] = {"llama": (), "mistral": ("attention_bias", "mlp_bias"), "qwen3": ("mlp_bias",)}


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes and switches of a Llama-family decoder; names as in HuggingFace's configs.

    ``num_key_value_heads`` < ``num_attention_heads`` is grouped-query attention;
    ``head_dim`` defaults to hidden_size // num_attention_heads (Qwen3 sets it apart);
    ``windows`` gives each layer's sliding window (None = full attention); ``qk_norm``
    normalises queries and keys per head before the rotation (Qwen3).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    qk_norm: bool = False
    windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "max_position_embeddings", "num_attention_heads"):
            store(self, name)
        for name in ("head_dim", "num_key_value_heads"):
            if getattr(self, name) is not None:
                store(self, name)
        if self.head_dim is None and self.num_attention_heads > self.hidden_size:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be at most hidden_size ({self.hidden_size}) when "
                             "head_dim is not set: head_dim = hidden_size // num_attention_heads would be 0")
        _checks.heads(
            "num_attention_heads * head_dim", self.num_attention_heads * self.head_size, self.num_attention_heads, self.num_key_value_heads,
            names=("num_attention_heads", "num_key_value_heads"),
        )
        store(self, "rms_norm_eps", _checks.epsilon)
        store(self, "rope_theta", partial(_checks.number, low=1.0, high=math.inf, low_open=True, high_open=True))  # the rotation's base
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be true or false, got {getattr(self, name)!r}")
        store(self, "partial_rotary_factor", partial(_checks.number, low=0.0, high=1.0, low_open=True))
        store(self, "attention_dropout", _checks.dropout)
        scaling = check_scaling(self.rope_scaling)
        if scaling is not None and scaling["rope_type"] == "default":  # ({} or the default named: no scaling, equal to None)
            object.__setattr__(self, "rope_scaling", None)
        elif scaling is not None:  # its numbers as checked (plain ints and floats, for JSON); its other keys as given
            object.__setattr__(self, "rope_scaling", {**self.rope_scaling, **{k: v for k, v in scaling.items() if k != "rope_type"}})
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"head_dim * partial_rotary_factor must give an even number of rotary dims, got {self.rotary_dim}")
        if self.windows is not None:
            if not isinstance(self.windows, (tuple, list)):
                raise TypeError(f"windows must be a tuple of one window (an int, or None) per layer, or None, got {type(self.windows).__name__}")
            if len(self.windows) != self.num_hidden_layers:
                raise ValueError(f"windows must give one window per layer ({self.num_hidden_layers}), got {len(self.windows)}")
            object.__setattr__(self, "windows", tuple(_checks.window(w, causal=True) for w in self.windows))

    @classmethod
    def from_dict(cls, d: dict[str, Any], model_type: str | None = None) -> LlamaConfig:
        """From a HuggingFace ``config.json`` dict, read as ``headwise.models.load`` reads the file (``llama_config``:
        the model type's defaults, its rope settings). ``model_type``: "llama", "mistral" or "qwen3"; None = the
        dict's own ``model_type`` (else "llama"); given, the dict's must agree."""
        if not isinstance(d, dict):
            raise TypeError(f"d must be a dict (a parsed config.json), got {type(d).__name__}")
        own = d.get("model_type")
        model_type = model_type if model_type is not None else own if own is not None else "llama"
        if model_type not in DEFAULTS:
            raise ValueError(f"model_type must be one of {sorted(DEFAULTS)}, got {model_type!r}")
        if own is not None and own != model_type:
            raise ValueError(f"the dict describes model_type {own!r}, not {model_type!r}")
        return llama_config(d, model_type, "config dict")

    def __hash__(self) -> int:
        """Every field's, the rope scaling's items too (a dict has no hash of its own)."""
        return hash(tuple(_frozen(getattr(self, f.name)) for f in fields(self)))

    @property
    def kv_heads(self) -> int:
        """Hkv: num_key_value_heads, or H when not set."""
        return self.num_attention_heads if self.num_key_value_heads is None else self.num_key_value_heads

    @property
    def head_size(self) -> int:
        """D: head_dim, or hidden_size // num_attention_heads when not set."""
        return self.hidden_size // self.num_attention_heads if self.head_dim is None else self.head_dim

    @property
    def rotary_dim(self) -> int:
        """R: the dims of each head that rotate, int(D * partial_rotary_factor) as HuggingFace rounds."""
        return int(self.head_size * self.partial_rotary_factor)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (None = full causal attention)."""
        return None if self.windows is None else self.windows[layer]


def _frozen(value: object) -> object:
    """``value`` with its dicts and lists as tuples (of sorted items), which hash."""
    if isinstance(value, dict):
        return tuple(sorted((key, _frozen(item)) for key, item in value.items()))
    return tuple(_frozen(item) for item in value) if isinstance(value, list) else value


def llama_config(d: dict[str, Any], model_type: str, file: os.PathLike[str]) -> LlamaConfig:
    """A ``LlamaConfig`` from a HuggingFace config dict of ``model_type``; what cannot run here is an error naming ``file``.

    Keys left out take ``model_type``'s defaults (``DEFAULTS``), keys its modules never read are dropped (``IGNORED``): as transformers runs the file.
    """
    d = {**DEFAULTS[model_type], **{key: value for key, value in d.items() if key not in IGNORED[model_type]}}
    unsupported = []
    if d.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={d['hidden_act']!r} (supported: 'silu')")
    rope = _rope(d, file)
    # transformers 5 reads rope_scaling (else rope_parameters) first; top-level values only fill what it lacks
    theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else rope
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "llama3":  # as transformers reads the length
        # the model was trained at: a top-level value first (Phi-3's files keep it there), else the dict's, else max_position_embeddings
        if "original_max_position_embeddings" in d:
            scaling = {**scaling, "original_max_position_embeddings": d["original_max_position_embeddings"]}
        elif "original_max_position_embeddings" not in scaling:
            scaling = {**scaling, "original_max_position_embeddings": d.get("max_position_embeddings", 2048)}
    try:
        check_scaling(scaling)
    except (TypeError, ValueError) as e:
        unsupported.append(str(e))
    if partial != 1.0:  # transformers 5's llama, mistral and qwen3 read the factor for a scaled rope only
        if scaling is not None:  # (their tables then cover part of each head and the rotation all of it: they fail)
            unsupported.append(f"partial_rotary_factor={partial!r} with rope_type {scaling.get('rope_type', scaling.get('type'))!r} "
                               f"(transformers' {model_type} rotates every dimension of a head)")
        partial = 1.0  # the default rope: every dimension rotates, the factor unread, as transformers runs the file
    if nested := [key for key in rope if key in LAYER_TYPES]:
        unsupported.append(f"rotary settings per layer type ({nested}); supported: one set for every layer")
    _layer_types(d, file)
    if model_type == "qwen3" and "head_dim" in d and d["head_dim"] is None:  # (Llama's and Mistral's mean hidden // heads)
        raise ValueError(f"{file}: invalid qwen3 config: head_dim must be a positive int (transformers' Qwen3 takes no null), got None")
    kinds = d.get("layer_types")
    if model_type == "mistral" and d.get("sliding_window") is not None and isinstance(kinds, list) and set(kinds) != {"sliding_attention"}:
        unsupported.append(f"layer_types={kinds!r} with sliding_window (transformers' Mistral slides every layer, its Auto "
                           "classes may run such a file as another model: which layers slide is not one reading)")
    if unsupported:
        raise ValueError(f"{file}: unsupported {model_type} settings: {'; '.join(unsupported)}")
    known = {f.name for f in fields(LlamaConfig)} - {"rope_theta", "rope_scaling", "partial_rotary_factor", "qk_norm", "windows"}
    # a null is read as it is (refused by name) but where it means something: the heads' defaults
    kwargs = {key: d[key] for key in known if key in d and (d[key] is not None or key not in ("num_key_value_heads", "head_dim"))}
    try:
        return LlamaConfig(
            **kwargs, rope_theta=theta, rope_scaling=scaling, partial_rotary_factor=partial,
            qk_norm=model_type == "qwen3", windows=_windows(d, model_type),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: invalid {model_type} config: {e}") from None


def _rope(d: dict[str, Any], file: os.PathLike[str]) -> dict[str, Any]:
    """The rotary settings: ``rope_scaling`` if set, else ``rope_parameters``, else none; each must be an object."""
    for key in ("rope_scaling", "rope_parameters"):
        value = d.get(key)
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{file}: {key} must be an object (a dict with a 'rope_type') or null, got {type(value).__name__} {value!r}")
    return dict(d.get("rope_scaling") or d.get("rope_parameters") or {})


def _windows(d: dict[str, Any], model_type: str) -> tuple[int | None, ...] | None:
    """Each layer's sliding window as HuggingFace's Mistral / Qwen3 decide it (Llama: none); the fields it reads checked
    by their names first (``llama_config`` names the file)."""
    n, window = d.get("num_hidden_layers", 32), d.get("sliding_window")
    kinds = d.get("layer_types")
    if model_type == "qwen3" and window is None and isinstance(kinds, list) and "sliding_attention" in kinds:
        raise ValueError("layer_types names sliding layers but sliding_window is null (transformers' Qwen3 cannot run such "
                         "a file)")
    if model_type == "llama" or window is None:
        return None
    n, window = _checks.positive_int("num_hidden_layers", n), _checks.positive_int("sliding_window", window)
    if model_type == "mistral":
        return (window,) * n
    sliding = d.get("use_sliding_window", False)
    if not isinstance(sliding, bool):
        raise TypeError(f"use_sliding_window must be true or false, got {sliding!r}")
    if not sliding:  # qwen3: sliding only when switched on, in the layers past max_window_layers
        if kinds is not None and "sliding_attention" in kinds:
            raise ValueError("layer_types names sliding layers but use_sliding_window is false (transformers' Qwen3 cannot run "
                             "such a file: which layers slide is not one reading)")
        return None
    if not kinds:
        first = _checks.integer("max_window_layers", d.get("max_window_layers", 28), low=0)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


def _layer_types(d: dict[str, Any], file: os.PathLike[str]) -> None:
    """``layer_types``, if given: a list of one known attention kind per layer (as transformers checks every model
    type's)."""
    kinds, n = d.get("layer_types"), d.get("num_hidden_layers", 32)
    if kinds is None:
        return
    if not isinstance(kinds, list):
        raise ValueError(f"{file}: layer_types must be a list of {list(LAYER_TYPES)}, one per layer, got {type(kinds).__name__} {kinds!r}")
    unknown = sorted({repr(kind) for kind in kinds if not isinstance(kind, str) or kind not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"{file}: layer_types entries must be one of {list(LAYER_TYPES)}, got {', '.join(unknown)}")
    if isinstance(n, int) and len(kinds) != n:
        raise ValueError(f"{file}: layer_types must give one kind per layer (num_hidden_layers={n}), got {len(kinds)}")
