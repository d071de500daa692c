"""GPT-2's attention layout: one fused ``c_attn`` for Q, K and V, ``c_proj`` after the merge.

Module names copy HuggingFace's checkpoint keys (``attn.c_attn``, ``attn.c_proj``) so that
pretrained GPT-2 weights load with a key copy plus a transpose (their Conv1D stores (in,
out); see ``headwise.convert``).
"""

from __future__ import annotations

from torch import Tensor, nn

from . import _checks
from .cache import KVCache, cached_attention
from .config import GPT2Config
from .functional import check_backend, merge_heads, split_heads
from .linear import project
from .observe import report


class GPT2MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection: (B, T, C) -> (B, T, C).

    Args:
        config: ``GPT2Config`` (n_embd = C, n_head = H, n_kv_head = Hkv, n_positions,
            attn_pdrop on the weights, resid_pdrop after c_proj).
        window: sliding-window attention, token i sees tokens i-window+1 .. i.
        backend: "auto", "math" or "sdpa".

    ``c_attn`` maps C -> C + 2·Hkv·D, laid out [queries | keys | values], each head by head.

    Example:
        >>> attn = GPT2MultiHeadAttention(GPT2Config())
        >>> attn(torch.randn(2, 8, 768)).shape
        torch.Size([2, 8, 768])
    """

    def __init__(self, config: GPT2Config, *, window: int | None = None, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
        self.config = config
        self.embed_dim = config.n_embd
        self.num_heads = config.n_head
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.split_size = self.embed_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.window = _checks.window(window, causal=True)
        self.backend = check_backend(backend)
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_size)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    def _split_heads(self, tensor: Tensor, num_heads: int, attn_head_size: int, name: str = "") -> Tensor:
        """(B, T, num_heads * attn_head_size) -> (B, num_heads, T, attn_head_size)."""
        return split_heads(tensor, num_heads, name)

    def _merge_heads(self, tensor: Tensor, num_heads: int, attn_head_size: int) -> Tensor:
        """(B, num_heads, T, attn_head_size) -> (B, T, num_heads * attn_head_size)."""
        return merge_heads(tensor)

    def forward(self, hidden_states: Tensor, *, key_padding_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        """Args: hidden_states (B, T, C); key_padding_mask (B, T) bool, True = real token;
        cache a ``KVCache`` of (B, Hkv, *, D). Returns (B, T, C)."""
        b, t = _checks.tokens(hidden_states, self.embed_dim, "hidden_states")
        _checks.key_padding_mask(key_padding_mask, b, t)
        past = len(cache) if cache is not None else 0
        _checks.context(t, past, self.config.n_positions, sliding=cache is not None and cache.window is not None)
        report("x", hidden_states)
        qkv = project(self.c_attn, hidden_states)  # (B, T, C + 2*Hkv*D)
        query, key, value = qkv.split([self.split_size, self.kv_size, self.kv_size], dim=-1)  # (B, T, C), (B, T, Hkv*D) x2
        report("queries", query)
        report("keys", key)
        report("values", value)
        query = self._split_heads(query, self.num_heads, self.head_dim, "queries")  # (B, H, T, D)
        key = self._split_heads(key, self.num_kv_heads, self.head_dim, "keys")  # (B, Hkv, T, D)
        value = self._split_heads(value, self.num_kv_heads, self.head_dim, "values")  # (B, Hkv, T, D)
        p = self.attn_dropout.p if self.training else 0.0
        context = cached_attention(
            query, key, value, cache, causal=True, window=self.window, key_padding_mask=key_padding_mask, dropout_p=p, backend=self.backend
        )  # (B, H, T, D)
        out = self.resid_dropout(project(self.c_proj, self._merge_heads(context, self.num_heads, self.head_dim)))  # (B, T, C)
        report("output", out)
        return out
