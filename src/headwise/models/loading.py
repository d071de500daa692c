"""Reading a HuggingFace model directory: ``config.json`` plus the weights, safely and all-or-nothing.

- Weights come from ``model.safetensors`` (read without unpickling anything), or its shards
  listed in ``model.safetensors.index.json`` (every listed tensor must be in the shard the index
  names), or else from ``pytorch_model.bin`` through ``torch.load(..., weights_only=True)``, which
  refuses any pickled object that is not a tensor or a plain container.
- Every problem raises one error that names the file and says what is wrong: a missing
  directory or file, JSON that does not parse, a truncated or corrupt weights file, and (via
  ``headwise.loadable.remap``) every missing, unexpected and mis-shaped tensor at once.
- ``headwise.convert.load_checked`` checks the whole state dict before it copies a single tensor.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._optional import require

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PYTORCH_BIN = "pytorch_model.bin"
CONFIG = "config.json"
TOKENIZER = "tokenizer.json"


def model_directory(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, checked to be an existing directory."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike naming a HuggingFace model directory, got {type(path).__name__}")
    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: no such directory (expected a HuggingFace model directory with {CONFIG})")
    if not directory.is_dir():
        raise NotADirectoryError(f"{directory}: not a directory (pass the HuggingFace model directory that holds {CONFIG})")
    return directory


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object from ``file``; errors name the file."""
    if not file.is_file():
        raise FileNotFoundError(f"{file}: file not found")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config(directory: Path, model_type: str) -> dict[str, Any]:
    """``config.json`` of ``directory``, checked to describe a ``model_type`` model if it says."""
    file = directory / CONFIG
    config = read_json(file)
    found = config.get("model_type", model_type)
    if found != model_type:
        raise ValueError(f"{file}: describes model_type {found!r}, expected {model_type!r}")
    return config


def weights_file(directory: Path) -> Path:
    """The weights of ``directory``: model.safetensors, else its shards' index, else pytorch_model.bin."""
    for name in (SAFETENSORS, SAFETENSORS_INDEX, PYTORCH_BIN):
        if (directory / name).is_file():
            return directory / name
    if (directory / (PYTORCH_BIN + ".index.json")).is_file():
        raise ValueError(f"{directory / (PYTORCH_BIN + '.index.json')}: sharded .bin checkpoints are not supported; save with safetensors")
    raise FileNotFoundError(f"{directory}: no weights found (expected {SAFETENSORS}, {SAFETENSORS_INDEX} or {PYTORCH_BIN})")


def read_sharded(index: Path) -> dict[str, Tensor]:
    """Every tensor listed in a ``model.safetensors.index.json``, each read from the shard it names."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: expected a 'weight_map' object of tensor name -> shard file")
    state: dict[str, Tensor] = {}
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if Path(shard).name != shard:
            raise ValueError(f"{index}: shard {shard!r} is not a file name in the same directory")
        if not shard.endswith(".safetensors"):  # an index naming an index (itself, or one naming it back) would never end
            raise ValueError(f"{index}: shard {shard!r} is not a .safetensors file (an index lists shards, not other indexes)")
    if missing := [shard for shard in shards if not (index.parent / shard).is_file()]:  # before any is read: the index's fault
        raise FileNotFoundError(f"{index}: names shard files that are not in {index.parent}: {missing}")
    for shard in shards:
        tensors = read_weights(index.parent / shard)
        listed = {key for key, file in weight_map.items() if file == shard}
        absent, unlisted = sorted(listed - tensors.keys()), sorted(tensors.keys() - listed)
        if absent:
            raise ValueError(f"{index.parent / shard}: lacks tensors the index puts there: {absent}")
        if unlisted:  # what a single file would hand the model's check (which refuses what it does not hold): not dropped
            raise ValueError(f"{index.parent / shard}: holds tensors the index does not list: {unlisted[:10]}"
                             f"{' ...' if len(unlisted) > 10 else ''}; list them in {index.name}, or take them out of the shard")
        state.update({key: tensors[key] for key in listed})
    return state


def read_weights(file: Path) -> dict[str, Tensor]:
    """Every tensor in ``file`` (.safetensors, a shards' index, or a .bin read with ``weights_only=True``)."""
    if file.name.endswith(".safetensors.index.json"):
        return read_sharded(file)
    if not file.is_file():
        raise FileNotFoundError(f"{file}: file not found")
    if file.suffix == ".safetensors":
        safetensors = require("safetensors", "models", "reading .safetensors weights")
        from safetensors.torch import load_file

        try:
            return float_weights(load_file(file), file)
        except (safetensors.SafetensorError, OSError) as e:
            raise ValueError(f"{file}: cannot read it as safetensors, the file is truncated or corrupt ({e})") from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # (torch's message goes on to advise weights_only=False: not for a file to be trusted)
        if "unsupported global" not in str(e).lower():  # torch names the class or function it will not call; bad bytes, an operand
            raise ValueError(f"{file}: cannot read it as a PyTorch checkpoint, the file is truncated or corrupt") from None
        raise ValueError(f"{file}: refused to load: it holds more than tensors (read with weights_only=True: objects whose "
                         "loading runs code are never unpickled); re-save the weights with safetensors") from None
    except Exception as e:  # garbage bytes reach the unpickler's internals: KeyError, IndexError, ... as well as RuntimeError
        reason = str(e) or type(e).__name__
        raise ValueError(f"{file}: cannot read it as a PyTorch checkpoint, the file is truncated or corrupt ({reason})") from None
    if isinstance(state, dict) and all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        return float_weights(state, file)
    if isinstance(state, dict):
        nested = [k for k, v in state.items() if isinstance(v, dict)]
        if nested:  # a training checkpoint: {"state_dict": {...}, "epoch": 3, ...}
            raise ValueError(
                f"{file}: expected a dict of tensors (a state dict), got a dict whose entry {nested[0]!r} is a dict "
                f"(a training checkpoint?): save that inner state dict (model.state_dict()) as {PYTORCH_BIN}"
            )
        bad = next(k for k, v in state.items() if not (isinstance(k, str) and isinstance(v, Tensor)))
        if not isinstance(bad, str):
            raise ValueError(f"{file}: expected a dict of tensors by name (a state dict), got the key {bad!r} of type {type(bad).__name__}")
        raise ValueError(f"{file}: expected a dict of tensors (a state dict), got entry {bad!r} of type {type(state[bad]).__name__}")
    raise ValueError(f"{file}: expected a dict of tensors (a state dict), got {type(state).__name__}")


def float_weights(state: dict[str, Tensor], file: Path) -> dict[str, Tensor]:
    """``state`` unless it holds int8 or 8-bit float tensors: quantized weights (their scales apart), which every model
    here loads only as floats."""
    for kind, keys in (("int8", [key for key, t in state.items() if t.dtype == torch.int8]),
                       ("float8", [key for key, t in state.items() if t.is_floating_point() and t.element_size() == 1])):
        if keys:
            raise ValueError(
                f"{file}: holds {kind} (quantized) weights, e.g. {keys[:3]}; headwise loads float checkpoints only: "
                "load the float model, then quantize it with headwise.quantize.int8_weights(model)"
            )
    return state


def same_values(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors hold the same shape, dtype and values, a NaN equal to a NaN (a tied copy of a weight that
    holds one is still its copy)."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.eq(a, b).logical_or_(a.isnan() & b.isnan()).all())


def tied_head(head: Tensor | None, embedding: Tensor | None, embedding_name: str, why: str) -> list[str]:
    """What is wrong with a tied checkpoint's ``lm_head.weight`` beside the embedding it must copy, as lines of the load's
    error (``problems``: listed with every other bad key); none where either is absent or it is that copy."""
    if head is None or embedding is None or same_values(head, embedding):
        return []
    if head.shape != embedding.shape:
        return [f"lm_head.weight has shape {tuple(head.shape)}, {embedding_name} {tuple(embedding.shape)}; {why}"]
    return [f"lm_head.weight differs from {embedding_name}{'' if head.dtype == embedding.dtype else f' (a {head.dtype} against a {embedding.dtype})'}; {why}"]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def checkpoint_dtype(config: dict[str, Any], state: dict[str, Tensor], file: Path) -> torch.dtype:
    """The dtype a checkpoint runs in: config.json's ``dtype`` (``torch_dtype`` before transformers 5), as
    transformers reads it; without one, the floating dtype that holds most of the weights' elements (a
    bf16 checkpoint with a few fp32 norms is bf16), float32 if none. ``file`` is config.json, for errors."""
    for key in ("dtype", "torch_dtype"):
        name = config.get(key)
        if name is None:
            continue
        if not isinstance(name, str) or name.removeprefix("torch.") not in DTYPES:
            raise ValueError(f"{file}: {key} must be one of {list(DTYPES)} or null, got {name!r}")
        return DTYPES[name.removeprefix("torch.")]
    sizes: dict[torch.dtype, int] = {}
    for t in state.values():
        if t.is_floating_point():
            sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    return max(sizes, key=sizes.__getitem__) if sizes else torch.float32


def read_tokenizer(directory: Path, user: str):
    """``directory / tokenizer.json`` as a ``tokenizers.Tokenizer``; ``user`` names who reads it in errors.

    Raises:
        ModuleNotFoundError: ``tokenizers`` is not installed (the message names the extra).
        FileNotFoundError / ValueError: the file is missing or cannot be read.
    """
    Tokenizer = require("tokenizers", "models", f"{user}'s tokenizer").Tokenizer
    file = directory / TOKENIZER
    if not file.is_file():
        raise FileNotFoundError(f"{file}: file not found ({user} reads the tokenizer from {TOKENIZER})")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the tokenizers library raises bare Exceptions
        raise ValueError(f"{file}: cannot read the tokenizer ({e})") from None
