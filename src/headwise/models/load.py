"""``load(path)``: the model a HuggingFace directory describes, chosen by its config.json's ``model_type``."""

from __future__ import annotations

import os

import torch
from torch import nn

from . import loading
from .bert import BertModel
from .gpt2 import GPT2LMHeadModel
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM

#: model_type -> the class that loads it.
SUPPORTED: dict[str, type[nn.Module]] = {
    "gpt2": GPT2LMHeadModel,
    "bert": BertModel,
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def load(path: str | os.PathLike[str], *, dtype: torch.dtype | None = None) -> nn.Module:
    """Load the model in a HuggingFace directory, in eval mode.

    Args:
        path: a directory with config.json and the weights (model.safetensors, its shards
            with model.safetensors.index.json, or pytorch_model.bin).
        dtype: for the Llama family, the parameters' dtype (default the checkpoint's);
            GPT-2 and BERT load in float32 and take no other.

    Returns:
        A ``GPT2LMHeadModel``, ``BertModel``, ``LlamaForCausalLM``, ``MistralForCausalLM`` or
        ``Qwen3ForCausalLM``.

    Raises:
        ValueError: config.json names no model_type, or one not in ``SUPPORTED`` (the message
            lists them); or whatever the model's ``from_pretrained`` raises.

    Example:
        >>> model = headwise.models.load("path/to/Qwen3-0.6B")          # doctest: +SKIP
    """
    directory = loading.model_directory(path)
    file = directory / loading.CONFIG
    model_type = loading.read_json(file).get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"{file}: model_type must be a string, one of {', '.join(SUPPORTED)}; got {model_type!r}")
    if model_type not in SUPPORTED:
        raise ValueError(f"{file}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}")
    cls = SUPPORTED[model_type]
    if dtype is not None and not isinstance(dtype, torch.dtype):  # (one check for every model type: a string is not one)
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r} (e.g. torch.bfloat16, not a string)")
    if issubclass(cls, LlamaForCausalLM):
        return cls.from_pretrained(directory, dtype=dtype)
    if dtype not in (None, torch.float32):
        raise ValueError(f"dtype={dtype} is not supported for {model_type}; it loads in float32 (pass dtype=None)")
    return cls.from_pretrained(directory)
