"""The whole models the decode benchmark runs: random checkpoints saved as a user's are, and each library's copy.

Two shapes (``MODELS``), random weights from transformers' own initialisation, written by
``save_pretrained`` into a directory every engine then reads (``checkpoint``):

- ``gpt2``: GPT-2 small (12 layers, C = 768, 12 heads, vocabulary 50257, the head tied to the embedding);
- ``llama``: a Llama of the same size (12 layers, C = 768, 12 query and 4 KV heads, SwiGLU of
  2048, vocabulary 32000, an untied head).

A tokenizer is saved beside the weights because the engines' converters read one: a byte-level
BPE whose merges are pairs of bytes, as many as the vocabulary has rows. The benchmark feeds
token ids, so how it would split text does not matter. ``tiny=True``: two layers of width 64 and
a vocabulary of 320, for tests (the timings mean nothing).

Precisions (``PRECISIONS``): fp32; bf16; int8 (int8 weights with a scale per row, fp32
activations: ``headwise.quantize.int8_weights``); int8-bf16 (int8 weights, bf16 activations and KV cache);
int8-a8 (int8 weights and each row of activations rounded to int8, exact integer sums:
``int8_weights(model, activations="int8")``, the arithmetic of CTranslate2's int8 and llama.cpp's q8_0).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .. import _checks
from ..models.llama_config import LlamaConfig

MODELS = ("gpt2", "llama")
PRECISIONS = ("fp32", "bf16", "int8", "int8-bf16", "int8-a8")
#: The dtype of activations (and of the KV cache) at each precision.
ACTIVATIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32, "int8-bf16": torch.bfloat16, "int8-a8": torch.float32}

#: GPT-2 small's width and depth, Llama's parts: 4 KV heads (GQA 3), SwiGLU of 8/3 C, Llama 2's vocabulary.
GPT2_SMALL_LLAMA = LlamaConfig(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
)
#: transformers config fields of each model, full size and tiny.
SIZES = {
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12},
    "llama": {"vocab_size": GPT2_SMALL_LLAMA.vocab_size, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
}
TINY = {
    "gpt2": {"vocab_size": 320, "n_positions": 256, "n_embd": 64, "n_layer": 2, "n_head": 4},
    "llama": {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5},
}


def default_root() -> Path:
    """Where checkpoints and the engines' conversions are kept: ``$HEADWISE_BENCH_DIR`` or ``~/.cache/headwise/bench``."""
    return Path(os.environ.get("HEADWISE_BENCH_DIR") or Path.home() / ".cache" / "headwise" / "bench")


def check(model: str, precision: str | None = None) -> None:
    if model not in MODELS:
        raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")


def checkpoint(model: str, root: Path | None = None, *, tiny: bool = False, seed: int = 0, init_std: float = 0.02, positions: int = 0) -> Path:
    """The directory of ``model``'s random checkpoint under ``root`` (default ``default_root()``), written once.

    ``init_std``: the standard deviation transformers initialises the weights with (larger: logits
    further apart, so that greedy choices do not hang on rounding). ``positions``: at least this
    many positions (more than the model's own: a checkpoint of its own).
    """
    check(model)
    _checks.number("init_std", init_std, low=0.0, low_open=True)
    _checks.integer("positions", positions, low=0)
    sizes = dict((TINY if tiny else SIZES)[model])
    key = "n_positions" if model == "gpt2" else "max_position_embeddings"
    longer = positions > sizes[key]
    sizes[key] = max(positions, sizes[key])
    name = (f"{model}{'-tiny' if tiny else ''}-seed{seed}" + ("" if init_std == 0.02 else f"-std{init_std:g}")
            + (f"-positions{positions}" if longer else ""))
    directory = (root or default_root()) / name
    if (directory / "config.json").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    import transformers

    special = {"bos_token_id": sizes["vocab_size"] - 1, "eos_token_id": sizes["vocab_size"] - 1, "initializer_range": init_std}
    with torch.random.fork_rng():  # seeded weights without touching the caller's RNG
        torch.manual_seed(seed)
        if model == "gpt2":  # n_ctx, as GPT-2's own config.json has it: llama.cpp's converter reads it
            hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**sizes, **special, n_ctx=sizes["n_positions"]))
        else:
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, **special, tie_word_embeddings=False))
    hf.save_pretrained(directory)
    tokenizer(sizes["vocab_size"]).save_pretrained(directory)
    return directory


def tokenizer(vocab_size: int):
    """A byte-level BPE of exactly ``vocab_size`` tokens: the 256 byte symbols, pairs of them, and ``<|endoftext|>`` last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _checks.integer("vocab_size", vocab_size, low=258)
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols)}
    merges = []
    for a in symbols:
        for b in symbols:
            if len(vocab) == vocab_size - 1:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    vocab["<|endoftext|>"] = vocab_size - 1
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>")


def headwise_model(directory: Path, precision: str) -> nn.Module:
    """headwise's model of the checkpoint at ``precision``, built as a user builds it (outside inference mode)."""
    from ..models import load
    from ..quantize import int8_weights

    check("gpt2", precision)
    model = load(directory).to(ACTIVATIONS[precision]).eval()
    if not precision.startswith("int8"):
        return model
    return int8_weights(model, activations="int8" if precision == "int8-a8" else "bf16")


def transformers_model(directory: Path, precision: str) -> nn.Module | None:
    """transformers' model of the checkpoint (SDPA attention, no end-of-sequence stop); None for int8 (no such CPU path)."""
    check("gpt2", precision)
    if precision.startswith("int8"):
        return None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=ACTIVATIONS[precision], attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None  # every engine generates every token asked for
    return model


def matrix_elements(model: nn.Module) -> int:
    """Weight elements a decode step reads: every projection and the LM head (a tied head once); not the embedding tables."""
    from ..quantize import Int8Linear

    count = sum(m.weight.numel() for m in model.modules() if type(m) in (nn.Linear, Int8Linear))
    tied = getattr(type(model), "tied_embedding", None)
    if tied is not None and model.lm_head is None:
        count += model.get_submodule(tied).weight.numel()
    return count


def kv_bytes(model: nn.Module, cache_dtype: torch.dtype | None = None) -> int:
    """Bytes one token's keys and values take in the model's caches of ``cache_dtype`` over all layers (8-bit rows with
    their scales)."""
    return sum(c.k[0, :, 0].nbytes + c.v[0, :, 0].nbytes for c in model.new_caches(1, 1, cache_dtype))


def cache_keyword(function: Callable) -> str:
    """The name a transformers ``function`` (a model's or a layer's ``forward``, ``create_causal_mask``) takes its cache by:
    ``cache`` since transformers 5.24 (where ``past_key_values`` is deprecated, to be removed), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(function).parameters else "past_key_values"
