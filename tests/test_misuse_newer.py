"""The misuse catalogue of the newer surface: rotary embeddings, the Llama family's configs and loading,
generate, the heads page's encoder, parallelize and the command line.

As in ``test_misuse.py``, each case is ``Raises(error, match)`` (a ValueError/TypeError, or
FileNotFoundError for paths, whose message names the argument, what was expected and what was
given) or ``Agrees(fn)``: ``fn()`` returns ``(got, want)`` with ``want`` an independent float64
reference written here (the rotation, from its definition) or in ``tests/reference.py``.
The command line's cases must exit with status 2 and one error line, never a traceback.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from reference import reference_mha

import headwise as hw
from headwise.cli import main as cli
from headwise.models import LlamaConfig, LlamaForCausalLM, SentenceEncoder, load
from headwise.models.bert import BertConfig, BertModel
from headwise.models.llama_config import llama_config
from headwise.rope import RotaryEmbedding, check_scaling, inverse_frequencies

F64 = torch.float64


class Raises(NamedTuple):
    error: type[Exception]
    match: str


class Agrees(NamedTuple):
    fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    atol: float = 1e-6


def rnd(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- rotary embeddings
def reference_rotation(x: torch.Tensor, positions: list[list[int]], theta: float = 10000.0, layout: str = "rotate_half") -> torch.Tensor:
    """x (B, H, T, D) rotated in float64 from the definition: pair i turns by p * theta^(-2i/D) at position p."""
    x = x.double()
    d = x.shape[-1]
    out = x.clone()
    for b in range(x.shape[0]):
        for t in range(x.shape[2]):
            p = positions[b if len(positions) > 1 else 0][t]
            for i in range(d // 2):
                angle = p * theta ** (-2 * i / d)
                a, c = (i, i + d // 2) if layout == "rotate_half" else (2 * i, 2 * i + 1)
                u, w = x[b, :, t, a], x[b, :, t, c]
                out[b, :, t, a] = u * math.cos(angle) - w * math.sin(angle)
                out[b, :, t, c] = w * math.cos(angle) + u * math.sin(angle)
    return out


def rotated(start_or_ids, shape=(1, 2, 3, 8), layout="rotate_half", positions=None) -> Agrees:
    """RotaryEmbedding(D)(x, start_or_ids) in float32 against the float64 rotation at ``positions``."""

    def fn():
        x = rnd(*shape)
        got = RotaryEmbedding(shape[-1], layout=layout)(x, start_or_ids)
        return got.double(), reference_rotation(x, positions, layout=layout)

    return Agrees(fn, atol=2e-5)


X = rnd(1, 2, 3, 8)  # (B, H, T, D)
LONG = torch.long


ROPE: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("rope start -5", lambda: RotaryEmbedding(8)(X, -5), Raises(ValueError, r"positions \(an int start\) must be an int >= 0, got -5")),
    ("rope start -1", lambda: RotaryEmbedding(8)(X, -1), Raises(ValueError, r"positions \(an int start\) must be an int >= 0, got -1")),
    ("rope start -2", lambda: RotaryEmbedding(8)(X, -2), Raises(ValueError, r"must be an int >= 0, got -2")),
    ("rope start 2.5", lambda: RotaryEmbedding(8)(X, 2.5), Raises(TypeError, r"positions \(an int start\) must be an int >= 0, got 2.5")),
    ("rope start True", lambda: RotaryEmbedding(8)(X, True), Raises(TypeError, r"must be an int >= 0, got True")),
    ("rope start str", lambda: RotaryEmbedding(8)(X, "3"), Raises(TypeError, r"must be an int >= 0, got '3'")),
    ("rope start None", lambda: RotaryEmbedding(8)(X, None), Raises(TypeError, r"must be an int >= 0, got None")),
    ("rope float ids", lambda: RotaryEmbedding(8)(X, torch.zeros(1, 3)), Raises(TypeError, r"positions must be an int start or an integer tensor of shape \(batch, tokens=3\), got dtype torch.float32")),
    ("rope bool ids", lambda: RotaryEmbedding(8)(X, torch.zeros(1, 3, dtype=torch.bool)), Raises(TypeError, r"got dtype torch.bool")),
    ("rope ids too long", lambda: RotaryEmbedding(8)(X, torch.zeros(1, 4, dtype=LONG)), Raises(ValueError, r"positions must have shape \(batch, tokens\) = \(1, 3\), got \(1, 4\)")),
    ("rope ids widen a batch of 1", lambda: RotaryEmbedding(8)(X, torch.zeros(3, 3, dtype=LONG)), Raises(ValueError, r"positions must have shape \(batch, tokens\) = \(1, 3\), got \(3, 3\)")),
    ("rope ids of another batch", lambda: RotaryEmbedding(8)(rnd(2, 2, 3, 8), torch.zeros(3, 3, dtype=LONG)), Raises(ValueError, r"= \(2, 3\) or \(1, 3\), got \(3, 3\)")),
    ("rope ids 1-D", lambda: RotaryEmbedding(8)(X, torch.arange(3)), Raises(ValueError, r"positions must have shape \(batch, tokens\) = \(1, 3\), got \(3,\)")),
    ("rope ids 3-D", lambda: RotaryEmbedding(8)(X, torch.zeros(1, 1, 3, dtype=LONG)), Raises(ValueError, r"got \(1, 1, 3\)")),
    ("rope ids with 3-D x", lambda: RotaryEmbedding(8)(X[0], torch.zeros(1, 3, dtype=LONG)), Raises(ValueError, r"x must have shape \(batch, heads, tokens, head_dim\) with position ids, got \(2, 3, 8\)")),
    ("rope x is a list", lambda: RotaryEmbedding(8)([[0.0] * 8], 0), Raises(TypeError, r"x must be a torch.Tensor of shape \(..., tokens, head_dim=8\), got list")),
    ("rope x of ints", lambda: RotaryEmbedding(8)(torch.ones(1, 2, 3, 8, dtype=LONG), 0), Raises(TypeError, r"x must be a floating-point tensor, got dtype torch.int64")),
    ("rope x of another head size", lambda: RotaryEmbedding(8)(rnd(1, 2, 3, 6), 0), Raises(ValueError, r"x must have shape \(..., tokens, head_dim=8\), got \(1, 2, 3, 6\)")),
    ("rope x 1-D", lambda: RotaryEmbedding(8)(rnd(8), 0), Raises(ValueError, r"got \(8,\)")),
    ("rope head_dim 0", lambda: RotaryEmbedding(0), Raises(ValueError, r"head_dim must be a positive int, got 0")),
    ("rope odd head_dim", lambda: RotaryEmbedding(7), Raises(ValueError, r"head_dim must be even to rotate every dim \(dims rotate in pairs\), got 7; or pass an even rotary_dim")),
    ("rope rotary_dim past head_dim", lambda: RotaryEmbedding(8, rotary_dim=10), Raises(ValueError, r"rotary_dim must be an int in \[2, 8\], got 10")),
    ("rope theta inf", lambda: RotaryEmbedding(8, theta=math.inf), Raises(ValueError, r"theta must be a number in \(1, inf\), got inf")),
    ("rope theta nan", lambda: RotaryEmbedding(8, theta=math.nan), Raises(ValueError, r"theta must be a number in \(1, inf\), got nan")),
    ("rope theta 1", lambda: RotaryEmbedding(8, theta=1.0), Raises(ValueError, r"theta must be a number in \(1, inf\), got 1.0")),
    ("rope layout unknown", lambda: RotaryEmbedding(8, layout="gptj"), Raises(ValueError, r"layout must be one of \['rotate_half', 'interleaved'\], got 'gptj'")),
    ("rope scaling is an int", lambda: check_scaling(5), Raises(TypeError, r"rope_scaling must be a dict with a 'rope_type' or None, got int")),
    ("rope scaling factor inf", lambda: inverse_frequencies(8, scaling={"rope_type": "linear", "factor": math.inf}), Raises(ValueError, r"rope_scaling\['factor'\] must be a number in \(0, inf\), got inf")),
    ("rope scaling factor 0", lambda: check_scaling({"rope_type": "linear", "factor": 0}), Raises(ValueError, r"rope_scaling\['factor'\] must be a number in \(0, inf\), got 0")),
    ("rope scaling factor True", lambda: check_scaling({"rope_type": "linear", "factor": True}), Raises(TypeError, r"got True")),
    ("rope scaling yarn", lambda: check_scaling({"rope_type": "yarn", "factor": 2.0}), Raises(ValueError, r"rope_scaling's rope_type must be one of \['default', 'linear', 'llama3'\], got 'yarn'")),
    ("rope llama3 missing keys", lambda: check_scaling({"rope_type": "llama3", "factor": 8.0}), Raises(ValueError, r"missing \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]")),
    ("rope llama3 inf original length", lambda: check_scaling({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": math.inf}), Raises(ValueError, r"original_max_position_embeddings'\] must be a number in \(0, inf\), got inf")),
    ("rope tables of length -1", lambda: RotaryEmbedding(8).tables(-1), Raises(ValueError, r"length must be an int >= 0, got -1")),
    ("rope tables on 'gpu'", lambda: RotaryEmbedding(8).tables(5, "gpu"), Raises(ValueError, r"device must be a torch.device or a device string such as 'cpu', got 'gpu'")),
    ("rope ids on meta", lambda: RotaryEmbedding(8)(X, torch.zeros(1, 3, dtype=LONG, device="meta")), Raises(ValueError, r"positions is on meta but x is on cpu")),
    ("rope rotate, a layout misspelt", lambda: hw.rope.rotate(X, *(t[:3] for t in RotaryEmbedding(8).tables(3)), "Interleaved"),  # it ran as rotate_half
     Raises(ValueError, r"layout must be one of \['rotate_half', 'interleaved'\], got 'Interleaved'")),
    ("rope scaling factor 1e-310", lambda: RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": 1e-310}),  # in (0, inf), 1 / it is inf
     Raises(ValueError, r"rope_scaling \{'rope_type': 'linear', 'factor': 1e-310\} makes the frequencies infinite \(over theta=10000.0\)")),
    ("llama positions on meta", lambda: tiny_llama()(torch.tensor([[1, 2, 3]]), positions=torch.zeros(1, 3, dtype=LONG, device="meta")),
     Raises(ValueError, r"positions is on meta but the model's weights are on cpu")),
    ("llama positions of int16", lambda: tiny_llama()(torch.tensor([[1, 2, 3]]), positions=torch.zeros(1, 3, dtype=torch.int16)),
     Raises(TypeError, r"positions must hold int64 or int32 positions \(torch.long, as a tokenizer's ids\), got dtype torch.int16")),
    ("llama layer position_ids on meta", lambda: tiny_llama().model.layers[0].self_attn(rnd(1, 3, 16).float(), position_ids=torch.zeros(1, 3, dtype=LONG, device="meta")),
     Raises(ValueError, r"position_ids is on meta but hidden_states is on cpu")),
    ("rope at with t = -1", lambda: RotaryEmbedding(8).at(0, -1, torch.device("cpu")), Raises(ValueError, r"t must be an int >= 0, got -1")),
    ("rope start 0 = the rotation", rotated(0, positions=[[0, 1, 2]]), None),
    ("rope start 5 = the rotation", rotated(5, positions=[[5, 6, 7]]), None),
    ("rope interleaved start 2", rotated(2, layout="interleaved", positions=[[2, 3, 4]]), None),
    ("rope (1, T) ids shared by a batch of 2", rotated(torch.tensor([[4, 0, 9]]), shape=(2, 2, 3, 8), positions=[[4, 0, 9]]), None),
    ("rope (B, T) ids", rotated(torch.tensor([[0, 0, 1], [3, 4, 5]]), shape=(2, 2, 3, 8), positions=[[0, 0, 1], [3, 4, 5]]), None),
    ("rope int32 ids", rotated(torch.tensor([[1, 2, 3]], dtype=torch.int32), positions=[[1, 2, 3]]), None),
    ("rope start past the kept tables", rotated(200_000, positions=[[200_000, 200_001, 200_002]]), None),
    ("rope no tokens", Agrees(lambda: (RotaryEmbedding(8)(rnd(1, 2, 0, 8), 3).double(), torch.zeros(1, 2, 0, 8, dtype=F64))), None),
]


# ---------------------------------------------------------------------------------------------- Llama configs
BASE = {"vocab_size": 16, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 32}


def cfg(model_type: str = "llama", **changes) -> Callable[[], LlamaConfig]:
    return lambda: llama_config({**BASE, **changes}, model_type, Path("config.json"))


def field(model_type: str, name: str, want: float, **changes) -> Agrees:
    """A config field read from config.json, against the value transformers 5 reads."""
    return Agrees(lambda: (torch.tensor(float(getattr(cfg(model_type, **changes)(), name)), dtype=F64), torch.tensor(want, dtype=F64)), atol=0.0)


def windows(model_type: str, want: list, **changes) -> Agrees:
    return Agrees(lambda: (torch.tensor([-1 if w is None else w for w in cfg(model_type, **changes)().windows or [None] * 2], dtype=F64),
                           torch.tensor([-1 if w is None else w for w in want], dtype=F64)), atol=0.0)


CONFIGS: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("config rope_scaling is an int", cfg(rope_scaling=5), Raises(ValueError, r"config.json: rope_scaling must be an object \(a dict with a 'rope_type'\) or null, got int 5")),
    ("config rope_scaling is a list", cfg(rope_scaling=[1, 2]), Raises(ValueError, r"rope_scaling must be an object .*got list \[1, 2\]")),
    ("config rope_parameters is a str", cfg(rope_parameters="linear"), Raises(ValueError, r"rope_parameters must be an object .*got str 'linear'")),
    ("config rope_parameters is an int", cfg(rope_parameters=7), Raises(ValueError, r"rope_parameters must be an object .*got int 7")),
    ("config rope_parameters' theta wins over the top level", field("llama", "rope_theta", 500000.0, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), None),
    ("config rope_scaling's theta wins over rope_parameters'", field("llama", "rope_theta", 250000.0, rope_scaling={"rope_type": "default", "rope_theta": 250000.0}, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}), None),
    ("config top-level theta fills what rope_parameters lacks", field("llama", "rope_theta", 40000.0, rope_theta=40000.0, rope_parameters={"rope_type": "default"}), None),
    ("config partial factor unread under the default rope", field("llama", "partial_rotary_factor", 1.0, partial_rotary_factor=1.0, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}), None),
    ("config partial factor with a scaled rope", cfg(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     Raises(ValueError, r"config.json: unsupported llama settings: partial_rotary_factor=0.5 with rope_type 'linear' \(transformers' llama rotates every dimension of a head\)")),
    ("config factor Infinity", cfg(rope_scaling={"rope_type": "linear", "factor": math.inf}), Raises(ValueError, r"config.json: unsupported llama settings: rope_scaling\['factor'\] must be a number in \(0, inf\), got inf")),
    ("config theta Infinity at the top", cfg(rope_theta=math.inf), Raises(ValueError, r"config.json: invalid llama config: rope_theta must be a number in \(1, inf\), got inf")),
    ("config theta Infinity in rope_parameters", cfg(rope_parameters={"rope_type": "default", "rope_theta": math.inf}), Raises(ValueError, r"rope_theta must be a number in \(1, inf\), got inf")),
    ("config theta NaN", cfg(rope_theta=math.nan), Raises(ValueError, r"rope_theta must be a number in \(1, inf\), got nan")),
    ("config theta a string", cfg(rope_theta="10000"), Raises(ValueError, r"rope_theta must be a number in \(1, inf\), got '10000'")),
    ("config rope per layer type", cfg(rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}),
     Raises(ValueError, r"unsupported llama settings: rotary settings per layer type \(\['full_attention', 'sliding_attention'\]\)")),
    ("config rope_type yarn", cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}), Raises(ValueError, r"unsupported llama settings: rope_scaling's rope_type must be one of")),
    ("config hidden_act gelu", cfg(hidden_act="gelu"), Raises(ValueError, r"unsupported llama settings: hidden_act='gelu' \(supported: 'silu'\)")),
    ("config qwen3 layer_types unknown", cfg("qwen3", use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "global"]),
     Raises(ValueError, r"config.json: layer_types entries must be one of \['full_attention', 'sliding_attention'\], got 'global'")),
    ("config qwen3 layer_types unknown, sliding off", cfg("qwen3", layer_types=["full", "full"]), Raises(ValueError, r"layer_types entries must be one of .*got 'full'")),
    ("config qwen3 layer_types a string", cfg("qwen3", use_sliding_window=True, sliding_window=4, layer_types="sliding_attention"),
     Raises(ValueError, r"config.json: layer_types must be a list of \['full_attention', 'sliding_attention'\], one per layer, got str 'sliding_attention'")),
    ("config qwen3 layer_types too short", cfg("qwen3", layer_types=["full_attention"]), Raises(ValueError, r"layer_types must give one kind per layer \(num_hidden_layers=2\), got 1")),
    ("config qwen3 layer_types holding None", cfg("qwen3", layer_types=[None, "full_attention"]), Raises(ValueError, r"layer_types entries must be one of .*got None")),
    ("config qwen3 layer_types honoured", windows("qwen3", [None, 4], use_sliding_window=True, sliding_window=4, layer_types=["full_attention", "sliding_attention"]), None),
    ("config qwen3 sliding off, sliding layer_types", cfg("qwen3", sliding_window=4, layer_types=["sliding_attention", "sliding_attention"]),
     Raises(ValueError, r"layer_types names sliding layers but use_sliding_window is false")),  # transformers' Qwen3 fails on it
    ("config qwen3 sliding off: full everywhere", windows("qwen3", [None, None], sliding_window=4, layer_types=["full_attention", "full_attention"]), None),
    ("config mistral window 0", cfg("mistral", sliding_window=0), Raises(ValueError, r"invalid mistral config: sliding_window must be a positive int, got 0")),
    ("config heads 0", cfg(num_attention_heads=0), Raises(ValueError, r"num_attention_heads must be a positive int, got 0")),
    ("config rms_norm_eps negative", cfg(rms_norm_eps=-1e-6), Raises(ValueError, r"rms_norm_eps must be a number in \(0, inf\), got -1e-06")),
    ("config tie_word_embeddings a string", cfg(tie_word_embeddings="yes"), Raises(ValueError, r"tie_word_embeddings must be true or false, got 'yes'")),
    ("config odd rotary dims", lambda: LlamaConfig(**BASE, partial_rotary_factor=0.25, head_dim=4), Raises(ValueError, r"head_dim \* partial_rotary_factor must give an even number of rotary dims, got 1")),
]


def test_rope_theta_in_both_places_is_read_as_transformers_reads_it():
    transformers = pytest.importorskip("transformers")
    d = {**BASE, "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    theirs = transformers.LlamaConfig(**d).rope_parameters["rope_theta"]
    assert llama_config(d, "llama", Path("config.json")).rope_theta == theirs == 500000.0


def test_qwen3_layer_types_refused_where_transformers_refuses_them():
    transformers = pytest.importorskip("transformers")
    d = {**BASE, "use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention", "global"]}
    with pytest.raises(Exception, match=r"layer_types` entries must be in"):  # huggingface_hub's validation error wraps a ValueError
        transformers.Qwen3Config(**d)
    with pytest.raises(ValueError, match=r"layer_types entries must be one of"):
        llama_config(d, "qwen3", Path("config.json"))


# ---------------------------------------------------------------------------------------------- loading
def tiny_llama(dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**BASE)).eval().to(dtype)


def llama_dir(tmp: Path, config: dict | None = None, norms=torch.float32, others=torch.bfloat16) -> Path:
    """A Llama directory: config.json (``config`` over the tiny sizes) and model.safetensors with the norms in
    ``norms`` and every other tensor in ``others`` (a bf16 checkpoint with fp32 norms by default)."""
    from safetensors.torch import save_file

    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(norms if "norm" in k else others).contiguous() for k, v in tiny_llama().state_dict().items()}
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps({"model_type": "llama", **BASE, **(config or {})}))
    return tmp


def gpt2_dir(tmp: Path, model_type: object = "gpt2") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}))
    return tmp


def index_dir(tmp: Path, names: dict[str, dict]) -> Path:
    """A Llama directory whose weights are only the given index files (name -> weight_map)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps({"model_type": "llama", **BASE}))
    for name, weight_map in names.items():
        (tmp / name).write_text(json.dumps({"weight_map": weight_map}))
    return tmp


INDEX = "model.safetensors.index.json"


_DIRS = tempfile.TemporaryDirectory(prefix="headwise-newer-")  # every model directory below, removed at exit


def tmpdir(name: str) -> Path:
    return Path(tempfile.mkdtemp(dir=_DIRS.name)) / name


LOADING: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("load model_type a list", lambda: load(gpt2_dir(tmpdir("a"), ["gpt2"])), Raises(ValueError, r"config.json: model_type must be a string, one of gpt2, bert, llama, mistral, qwen3; got \['gpt2'\]")),
    ("load model_type a dict", lambda: load(gpt2_dir(tmpdir("a"), {"name": "gpt2"})), Raises(ValueError, r"model_type must be a string, .*got \{'name': 'gpt2'\}")),
    ("load model_type missing", lambda: load(gpt2_dir(tmpdir("a"), None)), Raises(ValueError, r"config.json: model_type None is not supported; supported: gpt2, bert, llama, mistral, qwen3")),
    ("load model_type unknown", lambda: load(gpt2_dir(tmpdir("a"), "gpt3")), Raises(ValueError, r"model_type 'gpt3' is not supported; supported: gpt2, bert, llama")),
    ("load an index naming itself", lambda: load(index_dir(tmpdir("a"), {INDEX: {"lm_head.weight": INDEX}})),
     Raises(ValueError, r"model.safetensors.index.json: shard 'model.safetensors.index.json' is not a .safetensors file \(an index lists shards, not other indexes\)")),
    ("load two indexes naming each other", lambda: load(index_dir(tmpdir("a"), {INDEX: {"x": "other.safetensors.index.json"}, "other.safetensors.index.json": {"y": INDEX}})),
     Raises(ValueError, r"shard 'other.safetensors.index.json' is not a .safetensors file")),
    ("load an index naming a .bin", lambda: load(index_dir(tmpdir("a"), {INDEX: {"x": "pytorch_model.bin"}})), Raises(ValueError, r"shard 'pytorch_model.bin' is not a .safetensors file")),
    ("load an index without a weight_map", lambda: load(index_dir(tmpdir("a"), {INDEX: []})), Raises(ValueError, r"expected a 'weight_map' object of tensor name -> shard file")),
    ("load an index naming another directory", lambda: load(index_dir(tmpdir("a"), {INDEX: {"x": "../model.safetensors"}})), Raises(ValueError, r"shard '../model.safetensors' is not a file name in the same directory")),
    ("load an index naming a missing shard", lambda: load(index_dir(tmpdir("a"), {INDEX: {"x": "model-1.safetensors"}})), Raises(FileNotFoundError, r"index.json: names shard files that are not in .*: \['model-1.safetensors'\]")),
    ("load config dtype int8", lambda: load(llama_dir(tmpdir("a"), {"torch_dtype": "int8"})), Raises(ValueError, r"config.json: torch_dtype must be one of \['float32', 'bfloat16', 'float16', 'float64'\] or null, got 'int8'")),
    ("load config dtype a number", lambda: load(llama_dir(tmpdir("a"), {"dtype": 16})), Raises(ValueError, r"config.json: dtype must be one of .* or null, got 16")),
    ("load dtype argument a str", lambda: load(llama_dir(tmpdir("a")), dtype="bfloat16"), Raises(TypeError, r"dtype must be a torch.dtype or None, got str 'bfloat16' \(e.g. torch.bfloat16, not a string\)")),
    ("load no directory", lambda: load(tmpdir("missing")), Raises(FileNotFoundError, r"missing: no such directory")),
]


@pytest.mark.parametrize(
    ("config", "norms", "others", "want"),
    [
        ({"torch_dtype": "bfloat16"}, torch.float32, torch.bfloat16, torch.bfloat16),  # fp32 norms come first in the file
        ({"dtype": "bfloat16"}, torch.float32, torch.bfloat16, torch.bfloat16),  # transformers 5's key
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, torch.float32, torch.bfloat16, torch.float32),  # dtype first, as transformers 5
        ({"torch_dtype": "float16"}, torch.bfloat16, torch.bfloat16, torch.float16),  # the config decides, not the file
        ({}, torch.float32, torch.bfloat16, torch.bfloat16),  # no dtype: what most of the weights are
        ({}, torch.bfloat16, torch.float32, torch.float32),
        ({"torch_dtype": None}, torch.float32, torch.bfloat16, torch.bfloat16),
    ],
)
def test_a_checkpoints_dtype_is_the_configs_else_most_of_its_weights(tmp_path, config, norms, others, want):
    model = load(llama_dir(tmp_path, config, norms, others))
    assert {p.dtype for p in model.parameters()} == {want}


def test_bf16_checkpoint_with_fp32_norms_loads_in_bf16_with_the_float32_models_numbers(tmp_path):
    """The bf16 weights run in bf16: their logits within bf16 rounding of the float32 model's (same weights)."""
    model = load(llama_dir(tmp_path, {"torch_dtype": "bfloat16"}))
    wide = load(tmp_path, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        got, want = model(ids), wide(ids)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want.double()).abs().max() < 0.05 * want.abs().max()


# ---------------------------------------------------------------------------------------------- the encoder's tokenizer
def tiny_bert_dir(tmp: Path, vocab: dict[str, int], vocab_size: int = 8) -> Path:
    """A sentence-transformers style directory: BERT config, weights and a WordLevel tokenizer.json with ``vocab``."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    tmp.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "bert", "vocab_size": vocab_size, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8}
    torch.manual_seed(0)
    model = BertModel(BertConfig(**{k: v for k, v in config.items() if k != "model_type"}))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "tokenizer.json"))
    return tmp


VOCAB = {"[PAD]": 0, "[UNK]": 1, "a": 2, "cat": 3}


def encoder(vocab: dict[str, int]) -> SentenceEncoder:
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)).eval()
    return SentenceEncoder(bert, Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))


ENCODER: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("encoder tokenizer.json ids skip past the vocabulary", lambda: SentenceEncoder.from_pretrained(tiny_bert_dir(tmpdir("a"), {**VOCAB, "dog": 99})),
     Raises(ValueError, r"tokenizer.json: the tokenizer's ids go up to 99, but the model's vocab_size is 8 \(ids 0..7\): they do not belong together \(token 'dog' is id 99\)")),
    ("encoder id equal to vocab_size", lambda: encoder({**VOCAB, "dog": 8}), Raises(ValueError, r"ids go up to 8, but the model's vocab_size is 8")),
    ("encoder sentence with a lone surrogate", lambda: encoder(VOCAB).encode(["a caf\udce9"]),
     Raises(ValueError, r"sentences\[0\] is not valid Unicode text: '\\udce9' at character 5 \(bytes that were not UTF-8\?\)")),
]


# ---------------------------------------------------------------------------------------------- generate (the Llama family)
PROMPT = torch.tensor([[1, 2, 3]])


def attention():
    """The first layer's LlamaAttention of the tiny model: (B, T, 16) -> (B, T, 16)."""
    return tiny_llama().model["layers"][0].self_attn

GENERATE: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("generate max_new_tokens 0", lambda: tiny_llama().generate(PROMPT, max_new_tokens=0), Raises(ValueError, r"max_new_tokens must be a positive int, got 0")),
    ("generate max_new_tokens True", lambda: tiny_llama().generate(PROMPT, max_new_tokens=True), Raises(TypeError, r"max_new_tokens must be a positive int, got True")),
    ("generate max_new_tokens 2.0", lambda: tiny_llama().generate(PROMPT, max_new_tokens=2.0), Raises(TypeError, r"max_new_tokens must be a positive int, got 2.0")),
    ("generate past the context", lambda: tiny_llama().generate(PROMPT, max_new_tokens=40), Raises(ValueError, r"prompt \(3 tokens\) \+ max_new_tokens \(40\) exceeds max_position_embeddings=32")),
    ("generate temperature negative", lambda: tiny_llama().generate(PROMPT, max_new_tokens=1, temperature=-1.0), Raises(ValueError, r"temperature \(0 = greedy\) must be a number in \[0, inf\), got -1.0")),
    ("generate temperature inf", lambda: tiny_llama().generate(PROMPT, max_new_tokens=1, temperature=math.inf), Raises(ValueError, r"temperature \(0 = greedy\) must be a number in \[0, inf\), got inf")),
    ("generate temperature nan", lambda: tiny_llama().generate(PROMPT, max_new_tokens=1, temperature=math.nan), Raises(ValueError, r"got nan")),
    ("generate top_k 0", lambda: tiny_llama().generate(PROMPT, max_new_tokens=1, temperature=1.0, top_k=0), Raises(ValueError, r"top_k \(or None\) must be a positive int, got 0")),
    ("generate eos past the vocabulary", lambda: tiny_llama().generate(PROMPT, max_new_tokens=1, eos_token_id=16), Raises(ValueError, r"eos_token_id \(or None\) must be an int in \[0, 15\], got 16")),
    ("generate float ids", lambda: tiny_llama().generate(PROMPT.float(), max_new_tokens=1), Raises(TypeError, r"input_ids must hold .*got dtype torch.float32")),
    ("generate ids past the vocabulary", lambda: tiny_llama().generate(torch.tensor([[1, 16]]), max_new_tokens=1), Raises(ValueError, r"input_ids must hold ids in \[0, vocab_size=16\), got ids from 1 to 16")),
    ("generate right-padded prompt", lambda: tiny_llama().generate(torch.tensor([[1, 2, 0]]), attention_mask=torch.tensor([[1, 1, 0]]), max_new_tokens=1),
     Raises(ValueError, r"attention_mask marks it as padding in rows \[0\]: pad prompts on the left")),
    ("generate gap between real tokens, windowed", lambda: LlamaForCausalLM(LlamaConfig(**BASE, windows=(None, 3))).generate(
        torch.ones(3, 4, dtype=LONG), max_new_tokens=1, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 0, 1, 1], [0, 1, 0, 1]])),
     Raises(ValueError, r"attention_mask has padding between real tokens in rows \[1, 2\]: with a sliding window generate takes")),
    ("llama attention position_ids of floats", lambda: attention()(rnd(1, 3, 16), position_ids=torch.zeros(1, 3)),
     Raises(TypeError, r"position_ids must be an integer tensor of shape \(batch, tokens\) = \(1, 3\), got dtype torch.float32")),
    ("llama attention position_ids widening a batch", lambda: attention()(rnd(1, 3, 16), position_ids=torch.zeros(3, 3, dtype=LONG)),
     Raises(ValueError, r"position_ids must have shape \(batch, tokens\) = \(1, 3\), got \(3, 3\)")),
]


# ---------------------------------------------------------------------------------------------- the core's empty batches
def empty(shape) -> Agrees:
    """MultiHeadAttention on an input with no tokens or no rows: an empty output of the right shape (the reference's)."""

    def fn():
        torch.manual_seed(0)
        m = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, qkv_bias=True).double().eval()
        x = torch.zeros(*shape, dtype=F64)
        ref = reference_mha(x, m.W_query.weight, m.W_key.weight, m.W_value.weight, m.W_query.bias, m.W_key.bias, m.W_value.bias,
                            m.out_proj.weight, m.out_proj.bias, 2, causal=True)
        with torch.no_grad():
            return m(x), ref

    return Agrees(fn)


EMPTY: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("mha no tokens (T=0)", empty((2, 0, 8)), None),
    ("mha no rows (B=0)", empty((0, 3, 8)), None),
    ("gpt2 attention no rows (B=0)", Agrees(lambda: (hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=8))(torch.zeros(0, 3, 8)).double(),
                                                    torch.zeros(0, 3, 8, dtype=F64)), atol=0.0), None),
]


# ---------------------------------------------------------------------------------------------- parallelize
PARALLEL: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("parallelize a str mesh", lambda: hw_parallelize()(hw.MultiHeadAttention(8, 8, 4, 0.0, num_heads=2), "cpu"),
     Raises(TypeError, r"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got str")),
    ("parallelize None mesh", lambda: hw_parallelize()(hw.MultiHeadAttention(8, 8, 4, 0.0, num_heads=2), None),
     Raises(TypeError, r"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got NoneType")),
]


def hw_parallelize():
    pytest.importorskip("torch.distributed")
    from headwise.parallel import parallelize

    return parallelize


# ---------------------------------------------------------------------------------------------- arguments at their edges
def _paged_batch(seq_ids, new_tokens):
    pool = hw.PagedKVCache(4, 4, 2, 4)
    pool.add(0)
    return pool.batch(seq_ids, new_tokens)


def _many(prompts):
    from headwise.models.batching import generate_many

    return generate_many(tiny_llama(), prompts, max_new_tokens=2)


EDGES: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    ("KVCache on a GPU torch cannot see", lambda: hw.KVCache(1, 2, 8, 4, device="cuda") if not torch.cuda.is_available() else hw.KVCache(1, 2, 8, 4, device="nope"),
     Raises(ValueError, r"device=.*(needs a GPU that torch can see|must be a torch.device or a device string)")),
    ("PagedKVCache device not a device", lambda: hw.PagedKVCache(4, 4, 2, 4, device="nope"), Raises(ValueError, r"device must be a torch.device or a device string such as 'cpu', got 'nope'")),
    ("causal_mask device not a device", lambda: hw.causal_mask(3, 3, device="nope"), Raises(ValueError, r"device must be a torch.device or a device string")),
    ("KVCache batch_size past 64 bits", lambda: hw.KVCache(2**63, 2, 8, 4), Raises(ValueError, r"batch_size must be a positive int below 2\*\*63, got 9223372036854775808")),
    ("config size past 64 bits", lambda: hw.GPT2Config(n_layer=2**63), Raises(ValueError, r"n_layer must be a positive int below 2\*\*63")),
    ("llama windows an int", lambda: LlamaConfig(**BASE, windows=5), Raises(TypeError, r"windows must be a tuple of one window \(an int, or None\) per layer, or None, got int")),
    ("llama rope_theta below 1", lambda: LlamaConfig(**BASE, rope_theta=0.5), Raises(ValueError, r"rope_theta must be a number in \(1, inf\), got 0.5")),
    ("llama rope_scaling without its type", lambda: LlamaConfig(**BASE, rope_scaling={"factor": 2.0}),
     Raises(ValueError, r"rope_scaling needs a 'rope_type' \(or 'type'\) key to say how to scale by \['factor'\]")),
    ("llama more heads than width", lambda: LlamaConfig(**(BASE | {"num_attention_heads": 32})),
     Raises(ValueError, r"num_attention_heads \(32\) must be at most hidden_size \(16\) when head_dim is not set")),
    ("paged batch of an int", lambda: _paged_batch(0, [1]), Raises(TypeError, r"seq_ids must be a list of ints \(one a sequence\), got int")),
    ("generate_many of None", lambda: _many(None), Raises(TypeError, r"prompts must be a list of 1-D tensors of token ids, got NoneType")),
    ("preset a list", lambda: hw.GPT2Config.from_preset(["gpt2"]), Raises(ValueError, r"unknown preset \['gpt2'\]")),
    ("load_state_dict of None", lambda: hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2).load_state_dict(None),
     Raises(TypeError, r"state_dict must be a mapping of names to tensors \(module.state_dict\(\)\), got NoneType")),
    ("plan of a list", lambda: hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2).plan([[0.0] * 8]), Raises(TypeError, r"x must be a torch.Tensor of shape \(batch, tokens, 8\), got list")),
    ("observe a non-callable", lambda: hw.observe(5).__enter__(), Raises(TypeError, r"fn must be a callable \(name, tensor\) -> None, got int")),
    ("observe a model", lambda: hw.observe(hw.CausalAttention(4, 4, 3, 0.0)).__enter__(),
     Raises(TypeError, r"fn must be a callable \(name, tensor\) -> None, got CausalAttention: observe watches every module")),
    ("mha causal 1", lambda: hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, causal=1), Raises(TypeError, r"causal must be True or False, got int 1")),
    ("mha qkv_bias a str", lambda: hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, qkv_bias="yes"), Raises(TypeError, r"qkv_bias must be True or False, got str 'yes'")),
    ("cache update in_order a str", lambda: hw.KVCache(1, 2, 8, 4).update(rnd(1, 2, 1, 4), rnd(1, 2, 1, 4), in_order="yes"),
     Raises(TypeError, r"in_order must be True or False, got str 'yes'")),
    ("model check a str", lambda: tiny_llama()(torch.tensor([[1, 2]]), check="no"), Raises(TypeError, r"check must be True or False, got str 'no'")),
    ("int8 stack of a Linear", lambda: __import__("headwise.quantize", fromlist=["Int8Linear"]).Int8Linear.stack([torch.nn.Linear(8, 4)]),
     Raises(TypeError, r"layers must be one or more Int8Linear layers, got \['Linear'\]")),
    ("int8_errors of a Linear", lambda: __import__("headwise.quantize", fromlist=["int8_errors"]).int8_errors(torch.nn.Linear(2, 2), tiny_llama(), torch.tensor([[1, 2]])),
     Raises(TypeError, r"original must be a causal LM of headwise.models \(new_caches, generate\), got Linear")),
    ("int8 dequantized to int64", lambda: __import__("headwise.quantize", fromlist=["Int8Linear"]).Int8Linear(rnd(4, 8)).dequantized(torch.long),
     Raises(TypeError, r"dtype must be a floating-point torch.dtype .*got torch.int64")),
]

CASES = ROPE + CONFIGS + LOADING + ENCODER + GENERATE + EMPTY + PARALLEL + EDGES


@pytest.mark.parametrize(("call", "expect"), [(c, e) for _, c, e in CASES], ids=[name for name, _, _ in CASES])
def test_misuse_of_the_newer_surface(call, expect):
    if expect is None:  # the case is an Agrees
        call, expect = None, call
    if isinstance(expect, Agrees):
        got, want = expect.fn()
        assert got.shape == want.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want.double(), atol=expect.atol, rtol=0)
        return
    with pytest.raises(expect.error, match=expect.match):
        call()


# ---------------------------------------------------------------------------------------------- the command line
BAD_COMMAND_LINES = [
    (["explain", "--batch", "0"], r"argument --batch: expected an int in \[1, 64\], got 0"),
    (["explain", "--batch", "-3"], r"argument --batch: expected an int in \[1, 64\], got -3"),
    (["explain", "--tokens", "x"], r"argument --tokens: expected an int in \[1, 4096\], got 'x'"),
    (["explain", "--tokens", "0"], r"argument --tokens: expected an int in \[1, 4096\], got 0"),
    (["explain", "--d-in", "1e9"], r"argument --d-in: expected an int in \[1, 4096\], got '1e9'"),
    (["explain", "--d-out", ""], r"argument --d-out: expected an int in \[1, 4096\], got ''"),
    (["explain", "--heads", "2.5"], r"argument --heads: expected an int in \[1, 4096\], got '2.5'"),
    (["explain", "--seed", str(2**64)], r"argument --seed: expected an int in \[0, 18446744073709551615\], got 18446744073709551616"),
    (["explain", "--seed", "-1"], r"argument --seed: expected an int in \[0, 18446744073709551615\], got -1"),
    (["explain", "--rope", "--d-out", "4"], r"--d-out does not apply with --rope"),
    (["explain", "--rope", "--tokens", "4", "--bidirectional"], r"--tokens, --bidirectional do not apply with --rope"),
    (["explain", "--rope", "--alibi"], r"--alibi does not apply with --rope"),
    (["explain", "--softcap", "nan"], r"argument --softcap: expected a finite number > 0, got 'nan'"),
    (["explain", "--softcap", "-1"], r"argument --softcap: expected a finite number > 0, got '-1'"),
    (["explain", "--documents", "2,x"], r"argument --documents: expected a comma list of document lengths: expected an int in \[1, 4096\], got 'x'"),
    (["explain", "--documents", "2,0,1"], r"argument --documents: expected a comma list of document lengths: expected an int in \[1, 4096\], got 0"),
    (["explain", "--head-dim", "4"], r"--head-dim does not apply without --rope"),
    (["explain", "--rope", "--head-dim", "0"], r"argument --head-dim: expected an int in \[1, 4096\], got 0"),
    (["explain", "--rope", "--head-dim", "3"], r"head_dim \* partial_rotary_factor must give an even number|even"),
    (["heads", "--text", ""], r"argument --text: expected a sentence, got an empty string"),
    (["heads", "--text", "caf\udce9"], r"argument --text: expected a sentence in UTF-8, got bytes that are not UTF-8 \(b'\\xe9' at character 3\)"),
    (["heads", "--out", ""], r"argument --out: expected a file name, got an empty string"),
    (["heads", "--model", ""], r"argument --model: expected a directory, got an empty string"),
    (["grade", "x.py", "--timeout", "0"], r"argument --timeout: expected a finite number in \(0, 86400\], got '0'"),
    (["grade", "x.py", "--timeout", "nan"], r"argument --timeout: expected a finite number in \(0, 86400\], got 'nan'"),
    (["grade", "x.py", "--timeout", "inf"], r"argument --timeout: expected a finite number in \(0, 86400\], got 'inf'"),
    (["grade", ""], r"argument path: expected a .py file or a module path, got an empty string"),
    (["grade", "x.py", "--class", ""], r"argument --class: expected a class name, got an empty string"),
    (["bench", "--tokens", ""], r"argument --tokens: expected a comma list of positive ints with no empty entries, got ''"),
    (["bench", "--tokens", "128,,256"], r"with no empty entries, got '128,,256'"),
    (["bench", "--tokens", "0"], r"argument --tokens: expected a comma list of positive ints: expected a positive int, got 0"),
    (["bench", "--modes", "hf", "--tokens", "1"], r"--modes hf times a prompt of the first --tokens value, at least 2, got 1"),
    (["bench", "--modes", "forward,hf", "--tokens", "1,64"], r"--modes hf times a prompt of the first --tokens value, at least 2, got 1"),
    (["bench", "--plot", "out.txt"], r"--plot out.txt: matplotlib draws no 'txt'; name it .png \(or one of "),
    (["bench", "--tokens", "8,16,8"], r"argument --tokens: expected a comma list of positive ints, each once, got '8,16,8' \(8 more than once\)"),
    (["bench", "--modes", "forward,forward"], r"argument --modes: expected a comma list of modes, each once, got 'forward,forward'"),
    (["bench", "--dtype", ""], r"argument --dtype: expected a comma list of dtypes with no empty entries, got ''"),
    (["bench", "--dtype", "fp16"], r"argument --dtype: expected a comma list of dtypes: expected one of fp32, bf16, got 'fp16'"),
    (["bench", "--modes", ""], r"argument --modes: expected a comma list of modes with no empty entries, got ''"),
    (["bench", "--modes", "forward,sideways"], r"expected one of forward, backward, memory, decode, compile, hf, serving, model-decode, got 'sideways'"),
    (["bench", "--preset", "huge"], r"argument --preset: expected a comma list of presets: expected one of small, medium, tiny, got 'huge'"),
    (["bench", "--impls", ""], r"argument --impls: expected a comma list of name substrings with no empty entries, got ''"),
    (["bench", "--batch", "0"], r"argument --batch: expected a positive int, got 0"),
    (["bench", "--repeats", "-1"], r"argument --repeats: expected a positive int, got -1"),
    (["bench", "--warmup", "-1"], r"argument --warmup: expected an int >= 0, got -1"),
    (["bench", "--max-scores-gib", "-1"], r"argument --max-scores-gib: expected a finite number > 0, got '-1'"),
    (["bench", "--max-scores-gib", "nan"], r"argument --max-scores-gib: expected a finite number > 0, got 'nan'"),
    (["bench", "--markdown", ""], r"argument --markdown: expected a file name, got an empty string"),
    (["bench", "--json", ""], r"argument --json: expected a file name, got an empty string"),
    (["bench", "--device", "tpu"], r"argument --device: invalid choice: 'tpu'"),
    (["bench", "--modes", "decode", "--dtype", "bf16"], r"--dtype applies to --modes forward,backward,memory,compile only, not to --modes decode"),
    (["bench", "--modes", "decode", "--impls", "fused"], r"--impls applies to --modes forward,backward,memory only"),
    (["bench", "--modes", "memory", "--warmup", "3"], r"--warmup applies to --modes forward,backward,decode,hf,compile only, not to --modes memory"),
    (["bench", "--modes", "memory", "--repeats", "3"], r"--repeats applies to --modes forward,backward,decode,hf,compile only, not to --modes memory"),
    (["bench", "--modes", "decode", "--max-scores-gib", "2"], r"--max-scores-gib applies to --modes forward,backward,memory only"),
    (["bench", "--modes", "hf", "--dtype", "bf16"], r"--dtype applies to --modes forward,backward,memory,compile only, not to --modes hf"),
    (["bench", "--modes", "serving", "--tokens", "64"], r"--tokens applies to --modes forward,backward,memory,decode,hf,compile only, not to --modes serving"),
    (["bench", "--modes", "model-decode", "--batch", "8"], r"--batch applies to --modes forward,backward,memory,decode,hf,compile only, not to --modes model-decode"),
    (["bench", "--list", "--batch", "2"], r"--list lists the implementations and runs nothing: it takes no other flags, got --batch"),
    (["bench", "--modes", "hf", "--markdown", "t.md"], r"--markdown applies to --modes forward,backward,memory,decode,compile only, not to --modes hf"),
    (["bench", "--modes", "serving", "--json", "r.json"], r"--json applies to --modes forward,backward,memory,decode,compile only, not to --modes serving"),
    (["bench", "--modes", "model-decode", "--plot", "p.png"], r"--plot applies to --modes forward,backward,memory,decode,compile only, not to --modes model-decode"),
    (["bench", "--modes", "hf", "--no-ceiling"], r"--no-ceiling applies to --modes forward,backward,memory,decode,compile only, not to --modes hf"),
    (["bench", "--impls", "nothing-like-this", "--no-ceiling", "--plot", "", "--tokens", "8", "--preset", "tiny"], r"impls \['nothing-like-this'\] match no implementation"),
    (["bench", "--modes", "decode", "--tokens", "2000", "--no-ceiling", "--plot", ""], r"mode 'decode' takes contexts in \[2, 1024\] \(GPT-2's n_positions\), got \[2000\]"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_COMMAND_LINES, ids=[" ".join(a) for a, _ in BAD_COMMAND_LINES])
def test_bad_command_lines_exit_2_with_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"headwise {argv[0]}: error: "), err
    assert "Traceback" not in err
    assert re.search(message, errors[0]), errors[0]


def test_bench_compile_takes_the_flags_its_harness_reads():
    """--modes compile times Case(preset, batch, tokens, dtype) with repeats and warmup: those flags are not refused."""
    import argparse

    from headwise.bench import cli as bench_cli

    class Parser:
        def error(self, message: str) -> None:
            raise AssertionError(message)

    args = argparse.Namespace(_memory_child=None, device="cpu", plot=None, list=False, variants=False, modes=["compile"], preset=["tiny"],
                              tokens=[8], batch=1, dtype=["fp32", "bf16"], impls=None, max_scores_gib=None, warmup=0, repeats=1)
    checked = bench_cli._checked(Parser(), args)
    assert (checked.tokens, checked.batch, checked.dtype, checked.repeats) == ([8], 1, ["fp32", "bf16"], 1)


def test_heads_text_in_another_encoding_is_one_line_from_a_real_shell(tmp_path):
    """The bytes of 'café' in Latin-1, as a shell would pass them: exit 2, one line, nothing written."""
    out = tmp_path / "heads.html"
    run = subprocess.run([sys.executable, "-m", "headwise.cli", "heads", "--text", b"caf\xe9", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "headwise heads: error: argument --text: expected a sentence in UTF-8, got bytes that are not UTF-8 (b'\\xe9' at character 3)"
    )
    assert not out.exists()


def test_the_catalogue_is_large_and_named_once():
    names = [name for name, _, _ in CASES]
    assert len(names) == len(set(names))
    assert len(CASES) + len(BAD_COMMAND_LINES) >= 80


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: the tables are made on it")
def test_rope_tables_on_cuda_without_a_gpu_say_so():
    with pytest.raises(ValueError, match=r"device='cuda' needs a GPU that torch can see"):
        RotaryEmbedding(8).tables(5, "cuda")
