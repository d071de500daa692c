"""The rotary step, read off a real forward pass of ``LlamaAttention`` on the book's six tokens.

``explain_rope()`` runs the attention layer once under ``headwise.observe`` and files what it
reports: the split queries and keys, each position's angles, the rotated queries and keys,
and the attention weights they produce. Nothing here recomputes the layer.
"""

from __future__ import annotations

import math

import torch

from . import _checks
from .explain import BOOK_INPUTS, Step, printed
from .models.llama import LlamaAttention
from .models.llama_config import LlamaConfig
from .observe import observe
from .rope import RotaryEmbedding


def explain_rope(*, num_heads: int = 2, head_dim: int = 2, theta: float = 10000.0, seed: int = 123) -> tuple[LlamaAttention, list[Step]]:
    """Build ``LlamaAttention`` (d_in = 3, the book's width) under ``seed`` and walk one forward pass.

    With the default head_dim of 2 each head holds one pair, which turns by p radians at
    position p (its frequency is theta^0 = 1); larger heads add slower pairs.

    Returns:
        The layer and its steps, each holding the tensors that step produced.
    """
    _checks.positive_int("num_heads", num_heads)
    if _checks.positive_int("head_dim", head_dim) % 2:
        raise ValueError(f"head_dim must be even (RoPE turns dimensions in pairs), got {head_dim}")
    _checks.number("theta", theta, low=1.0, high=math.inf, low_open=True, high_open=True)  # (LlamaConfig.rope_theta's range)
    _checks.integer("seed", seed, low=0, high=2**64 - 1)  # torch.manual_seed's range, as explain's
    T = len(BOOK_INPUTS)
    printed(num_heads * T * max(head_dim, T), "num_heads or a smaller head_dim")  # its largest: (H, T, D) queries or (H, T, T) weights
    config = LlamaConfig(
        vocab_size=1, hidden_size=3, intermediate_size=1, num_hidden_layers=1, num_attention_heads=num_heads,
        head_dim=head_dim, max_position_embeddings=len(BOOK_INPUTS), rope_theta=theta,
    )
    rotary = RotaryEmbedding(head_dim, theta=theta)
    torch.manual_seed(seed)
    attn = LlamaAttention(config, rotary, backend="math").eval()
    seen: dict[str, torch.Tensor] = {}
    with observe(lambda name, t: seen.setdefault(name, t)), torch.no_grad():
        attn(BOOK_INPUTS[None])  # (1, 6, 3)
    positions = torch.arange(len(BOOK_INPUTS), dtype=torch.float64)
    angles = (positions[:, None] * rotary.inv_freq).float()  # (T, R/2) radians
    return attn, [
        Step(1, "Project and split into heads (b, num_heads, num_tokens, head_dim)", "q_proj(x).view(b, T, H, D).transpose(1, 2)",
             {name: seen[name] for name in ("queries.transpose", "keys.transpose")}),
        Step(2, "Each pair's angle: position p times its frequency theta^(-2i/D)", "angle[p, i] = p * theta ** (-2 * i / head_dim)",
             {"angles": angles}),
        Step(3, "Rotate each pair of every query and key by its angle (values are not rotated)",
             "q * cos + rotate_half(q) * sin", {name: seen[name] for name in ("queries.rotated", "keys.rotated")}),
        Step(4, "Scores of rotated queries and keys depend on the distance p - p', not on p", "softmax(q_rot @ k_rot^T / sqrt(D))",
             {"weights": seen["weights"]}),
    ]
