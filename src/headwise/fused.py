"""GPT-2's attention layout: one fused ``c_attn`` for Q, K and V, ``c_proj`` after the merge.

Module names copy HuggingFace's checkpoint keys (``attn.c_attn``, ``attn.c_proj``) so that
pretrained GPT-2 weights load with a key copy plus a transpose (their Conv1D stores (in,
out); see ``headwise.convert``).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from . import _checks
from .config import GPT2Config
from .functional import check_backend
from .layer import AttentionLayer
from .linear import project


class GPT2MultiHeadAttention(AttentionLayer):
    """Multi-head attention with a fused QKV projection: (B, T, C) -> (B, T, C), causal by default.

    Args:
        config: ``GPT2Config`` (n_embd = C, n_head = H, n_kv_head = Hkv, n_positions,
            attn_pdrop on the weights, resid_pdrop after c_proj).
        window: sliding-window attention, token i sees tokens i-window+1 .. i.
        backend: "auto", "math" or "sdpa".
        causal: False for bidirectional attention, and for cross-attention.

    ``c_attn`` maps C -> C + 2·Hkv·D, laid out [queries | keys | values], each head by head.
    ``forward(hidden_states, *, attention_mask=None, cache=None)`` is ``AttentionLayer``'s.
    Cross-attention (``forward(x, context=...)``, built with causal=False) uses the same
    weight: queries from x through c_attn's query rows, keys and values from the context
    (B, S, C) through its key and value rows.

    Example:
        >>> attn = GPT2MultiHeadAttention(GPT2Config())
        >>> attn(torch.randn(2, 8, 768)).shape
        torch.Size([2, 8, 768])
    """

    input_name = "hidden_states"
    def __init__(self, config: GPT2Config, *, window: int | None = None, backend: str = "auto", causal: bool = True) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
        self.config = config
        self.d_in = config.n_embd
        self.num_heads = config.n_head
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.context_length = config.n_positions
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
        self.causal = causal
        self.window = _checks.window(window, causal=causal)
        self.backend = check_backend(backend)
        self.c_attn = nn.Linear(config.n_embd, config.n_embd + 2 * self.num_kv_heads * self.head_dim)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)

    @property
    def attn_dropout_p(self) -> float:
        return self.attn_dropout.p if self.training else 0.0

    def _widths(self, total: int) -> tuple[int, int]:
        """(queries' width C, keys' width Hkv*D) of a c_attn output ``total`` wide; local widths when sharded by heads."""
        kv = total // (self.num_heads // self.num_kv_heads + 2)  # Hkv*D
        return total - 2 * kv, kv

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> c_attn(x) split into queries (B, T, C), keys and values (B, T, Hkv*D)."""
        qkv = project(self.c_attn, x)  # (B, T, C + 2*Hkv*D)
        q, kv = self._widths(qkv.shape[-1])
        query, key, value = qkv.split([q, kv, kv], dim=-1)  # (B, T, C), (B, T, Hkv*D) x2
        return query, key, value

    def _cross_unsharded(self) -> None:
        """A ValueError where ``c_attn`` is sharded (``headwise.parallel``): each rank holds its own heads' q, k and v rows,
        so the query rows and the key and value rows are not two blocks of it."""
        if _checks.sharded(self.c_attn.weight):
            raise ValueError("cross-attention through a GPT2MultiHeadAttention split by headwise.parallel is not supported (its "
                             "c_attn holds each rank's q, k and v rows together): split a MultiHeadAttention (W_query, W_key, "
                             "W_value) for cross-attention, or run this module unsplit")

    def project_q(self, x: Tensor) -> Tensor:
        """(B, T, C) -> queries (B, T, C): c_attn's query rows only, for cross-attention."""
        self._cross_unsharded()
        q, _ = self._widths(self.c_attn.weight.shape[0])
        bias = None if self.c_attn.bias is None else self.c_attn.bias[:q]
        return F.linear(x, self.c_attn.weight[:q], bias)  # (B, T, C)

    def project_kv(self, context: Tensor) -> tuple[Tensor, Tensor]:
        """(B, S, C) context -> keys and values (B, S, Hkv*D): c_attn's key and value rows, for cross-attention."""
        self._cross_unsharded()
        q, kv = self._widths(self.c_attn.weight.shape[0])
        bias = None if self.c_attn.bias is None else self.c_attn.bias[q:]
        keys, values = F.linear(context, self.c_attn.weight[q:], bias).split([kv, kv], dim=-1)  # (B, S, Hkv*D) x2
        return keys, values

    def project_out(self, context: Tensor) -> Tensor:
        """(B, T, C) -> resid_dropout(c_proj(context)) (B, T, C)."""
        return self.resid_dropout(project(self.c_proj, context))
