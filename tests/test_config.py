"""Every config field is checked for type and range when the config is built; from config.json the file is named too."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from headwise import GPT2Config
from headwise.config import FromDict
from headwise.models import LlamaConfig
from headwise.models.bert import BertConfig


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("layer_norm_epsilon", -1.0, r"layer_norm_epsilon must be a number in \(0, inf\), got -1.0"),
        ("layer_norm_epsilon", math.nan, r"layer_norm_epsilon must be a number in \(0, inf\), got nan"),
        ("layer_norm_epsilon", 0.0, r"layer_norm_epsilon must be a number in \(0, inf\), got 0.0"),
        ("layer_norm_epsilon", math.inf, r"layer_norm_epsilon must be a number in \(0, inf\), got inf"),
        ("n_layer", 0, r"n_layer must be a positive int, got 0"),
        ("n_head", 5, r"n_embd \(768\) must be divisible by n_head \(5\)"),
        ("n_kv_head", 0, r"n_kv_head must be a positive int, got 0"),
        ("n_kv_head", 5, r"n_head \(12\) must be divisible by n_kv_head \(5\)"),
        ("attn_pdrop", 1.5, r"attn_pdrop must be a number in \[0, 1\], got 1.5"),
    ],
)
def test_gpt2_config_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        GPT2Config(**{field: value})
    with pytest.raises(ValueError, match=match):
        GPT2Config.from_dict({field: value, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("n_embd", 768.0, r"n_embd must be a positive int, got 768.0"),
        ("vocab_size", None, r"vocab_size must be a positive int, got None"),
        ("n_head", "12", r"n_head must be a positive int, got '12'"),
        ("layer_norm_epsilon", "1e-5", r"layer_norm_epsilon must be a number in \(0, inf\), got '1e-5'"),
        ("embd_pdrop", True, r"embd_pdrop must be a number in \[0, 1\], got True"),
    ],
)
def test_gpt2_config_fields_of_the_wrong_type(field, value, match):
    with pytest.raises(TypeError, match=match):
        GPT2Config(**{field: value})
    with pytest.raises(TypeError, match=match):
        GPT2Config.from_dict({field: value, "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("layer_norm_eps", -1e-12, r"layer_norm_eps must be a number in \(0, inf\), got -1e-12"),
        ("layer_norm_eps", math.nan, r"layer_norm_eps must be a number in \(0, inf\), got nan"),
        ("hidden_act", ["gelu"], r"hidden_act must be one of \['gelu', 'gelu_new', 'gelu_pytorch_tanh'\], got \['gelu'\]"),
        ("num_attention_heads", 0, r"num_attention_heads must be a positive int, got 0"),
        ("num_attention_heads", 7, r"hidden_size \(768\) must be divisible by num_attention_heads \(7\)"),
        ("type_vocab_size", -2, r"type_vocab_size must be a positive int, got -2"),
        ("hidden_dropout_prob", -0.1, r"hidden_dropout_prob must be a number in \[0, 1\], got -0.1"),
    ],
)
def test_bert_config_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        BertConfig(**{field: value})


def test_from_dict_is_shared_and_takes_only_dicts():
    assert GPT2Config.from_dict is not None and issubclass(GPT2Config, FromDict) and issubclass(BertConfig, FromDict)
    assert BertConfig.from_dict({"hidden_size": 64, "num_attention_heads": 4, "pooler_type": "x"}).hidden_size == 64
    with pytest.raises(TypeError, match=r"d must be a dict \(a parsed config.json\), got list"):
        GPT2Config.from_dict([("n_embd", 64)])


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("rms_norm_eps", -1e-6, r"rms_norm_eps must be a number in \(0, inf\), got -1e-06"),
        ("rms_norm_eps", math.inf, r"rms_norm_eps must be a number in \(0, inf\), got inf"),
        ("rope_theta", math.nan, r"rope_theta must be a number in \(1, inf\), got nan"),
        ("rope_theta", 0.0, r"rope_theta must be a number in \(1, inf\), got 0.0"),
        ("head_dim", 0, r"head_dim must be a positive int, got 0"),
        ("num_attention_heads", 0, r"num_attention_heads must be a positive int, got 0"),
        ("num_key_value_heads", 3, r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(3\)"),
    ],
)
def test_llama_config_fields(field, value, match):
    from headwise.models import LlamaConfig

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**(base | {field: value}))
    with pytest.raises(TypeError, match=r"attention_bias must be true or false, got 'yes'"):  # a flag of another type
        LlamaConfig(**(base | {"attention_bias": "yes"}))


@pytest.mark.parametrize(
    ("cls", "ints"),
    [
        (GPT2Config, {"vocab_size": 100, "n_positions": 32, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_kv_head": 2}),
        (LlamaConfig, {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 32}),
        (BertConfig, {"vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
                      "max_position_embeddings": 32, "type_vocab_size": 2}),
    ],
)
def test_a_config_built_from_numpy_ints_keeps_plain_ints_and_round_trips_through_json(cls, ints):
    """Sizes read from a numpy array are taken, and kept as ints: the config writes to JSON and reads back equal."""
    extra = {"windows": [np.int64(8), None]} if cls is LlamaConfig else {}
    config = cls(**{name: np.int64(value) for name, value in ints.items()}, **extra)
    fields = dataclasses.asdict(config)
    assert all(type(fields[name]) is int for name in ints)
    if extra:
        assert config.windows == (8, None) and type(config.windows[0]) is int
    again = cls(**json.loads(json.dumps(fields)))
    assert again == config and again == cls(**ints, **({"windows": (8, None)} if extra else {}))


@pytest.mark.parametrize(
    ("cls", "floats"),
    [
        (GPT2Config, {"layer_norm_epsilon": 1e-5, "attn_pdrop": 0.25, "resid_pdrop": 0.5, "embd_pdrop": 0.125}),
        (LlamaConfig, {"rms_norm_eps": 1e-6, "rope_theta": 500000.0, "partial_rotary_factor": 1.0, "attention_dropout": 0.25}),
        (BertConfig, {"layer_norm_eps": 1e-12, "hidden_dropout_prob": 0.25, "attention_probs_dropout_prob": 0.5}),
    ],
)
def test_a_config_built_from_numpy_floats_keeps_plain_floats_and_round_trips_through_json(cls, floats):
    """Rates and epsilons as numpy scalars (float32 ones too, not a subclass of float) are taken and kept as floats."""
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4} if cls is LlamaConfig else {}
    config = cls(**base, **{name: np.float32(value) for name, value in floats.items()})
    fields = dataclasses.asdict(config)
    assert all(type(fields[name]) is float and fields[name] == float(np.float32(value)) for name, value in floats.items())
    assert cls(**json.loads(json.dumps(fields))) == config


@pytest.mark.parametrize("value", [torch.tensor(0.5), "0.5", None, [0.5]])
def test_a_rate_of_the_wrong_type_is_a_type_error(value):
    with pytest.raises(TypeError, match=r"attn_pdrop must be a number in \[0, 1\], got"):
        GPT2Config(attn_pdrop=value)


def test_rope_scaling_numbers_given_as_numpy_scalars_are_kept_plain_and_round_trip_through_json():
    """A ``rope_scaling`` read from numpy (a float32 factor, an int64 original length) keeps its keys and writes to JSON."""
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4}
    given = {"rope_type": "llama3", "factor": np.float32(8.0), "low_freq_factor": np.float64(1.0), "high_freq_factor": np.float32(4.0),
             "original_max_position_embeddings": np.int64(8192), "note": "kept"}
    config = LlamaConfig(**base, rope_scaling=given)
    scaling = config.rope_scaling
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192, "note": "kept"}
    assert [type(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")] == [float, float, float, int]
    assert given["factor"].dtype == np.float32  # the caller's dict is not changed
    fields = dataclasses.asdict(config)
    assert LlamaConfig(**json.loads(json.dumps(fields))) == config


def test_a_llama_config_with_rope_scaling_hashes_and_no_scaling_is_one_value():
    scaled = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})
    a, b = LlamaConfig(**scaled), LlamaConfig(**json.loads(json.dumps(scaled)))
    assert a == b and hash(a) == hash(b) and len({a, b, LlamaConfig()}) == 2  # (a dict field had no hash)
    assert LlamaConfig(rope_scaling={}) == LlamaConfig(rope_scaling={"rope_type": "default"}) == LlamaConfig()
    assert LlamaConfig(rope_scaling={}).rope_scaling is None


def test_llama_config_from_dict_reads_a_config_json_as_loading_does():
    d = {"hidden_size": 64, "num_attention_heads": 8, "num_hidden_layers": 2, "intermediate_size": 96, "vocab_size": 50,
         "sliding_window": 8, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, "torch_dtype": "float32"}
    mistral = LlamaConfig.from_dict(d, "mistral")
    assert mistral.windows == (8, 8) and mistral.rope_theta == 500.0 and mistral.rope_scaling["factor"] == 2.0
    assert mistral.kv_heads == 8 and LlamaConfig.from_dict(d).kv_heads == 8  # Mistral's default 8, Llama's: every head
    assert mistral.max_position_embeddings == 131072  # Mistral's default, where the dict leaves it out
    assert LlamaConfig.from_dict(d).windows is None  # Llama: no window whatever the dict says
    assert LlamaConfig.from_dict({**d, "model_type": "mistral"}) == mistral  # the dict's own type by default
    with pytest.raises(ValueError, match=r"the dict describes model_type 'mistral', not 'qwen3'"):
        LlamaConfig.from_dict({**d, "model_type": "mistral"}, "qwen3")
    with pytest.raises(ValueError, match=r"model_type must be one of \['llama', 'mistral', 'qwen3'\], got 'gpt2'"):
        LlamaConfig.from_dict(d, "gpt2")
    with pytest.raises(TypeError, match=r"d must be a dict"):
        LlamaConfig.from_dict([("hidden_size", 64)])
