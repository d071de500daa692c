"""headwise: multi-head attention, from the book's lesson to a fast drop-in layer."""

from .cache import KVCache, PagedKVCache
from .config import GPT2Config
from .convert import gpt2_attention_from_hf, gpt2_to_mha, mha_to_gpt2, wrapper_to_mha
from .functional import attention, attention_weights
from .fused import GPT2MultiHeadAttention
from .layer import ContextCache
from .masks import causal_mask
from .observe import observe
from .teaching import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper

__all__ = [
    "CausalAttention",
    "ContextCache",
    "GPT2Config",
    "GPT2MultiHeadAttention",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "PagedKVCache",
    "attention",
    "attention_weights",
    "causal_mask",
    "gpt2_attention_from_hf",
    "gpt2_to_mha",
    "mha_to_gpt2",
    "observe",
    "wrapper_to_mha",
]
__version__ = "0.1.0"
