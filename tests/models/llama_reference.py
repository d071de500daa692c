"""An independent Llama / Mistral / Qwen3 forward straight from a HuggingFace state dict.

Plain tensor operations in whatever dtype is asked (float64 = the reference, bfloat16 = "a plain
bf16 implementation" for the low-precision rule). Rotary embeddings are written as complex
multiplications of the dim pairs (i, i + R/2), not as headwise's cos/sin tables. Nothing here
imports headwise or transformers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def llama3_frequencies(inv_freq: list[float], factor: float, low: float, high: float, old: int) -> list[float]:
    """Llama 3.1's frequency scaling, as Meta's reference code writes it (one frequency at a time)."""
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(freq)
        elif wavelen > old / low:
            out.append(freq / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def frequencies(rotary_dim: int, theta: float, scaling: dict | None) -> list[float]:
    inv_freq = [theta ** (-2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    kind = None if scaling is None else scaling.get("rope_type", "default")
    if kind == "linear":
        return [f / scaling["factor"] for f in inv_freq]
    if kind == "llama3":
        return llama3_frequencies(inv_freq, scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"],
                                  scaling["original_max_position_embeddings"])
    return inv_freq


def rope_reference(x: Tensor, positions: Tensor, inv_freq: list[float], layout: str = "rotate_half") -> Tensor:
    """x (B, H, T, D) rotated in float64: each pair as a complex number times exp(i·p·freq); dims past R pass.

    positions: (B, T) ints. Returns float64.
    """
    x = x.double()
    r = 2 * len(inv_freq)
    if layout == "rotate_half":
        a, b = x[..., : r // 2], x[..., r // 2 : r]
    else:
        a, b = x[..., 0:r:2], x[..., 1:r:2]
    angle = positions.double()[:, None, :, None] * torch.tensor(inv_freq, dtype=torch.float64)  # (B, 1, T, R/2)
    z = torch.complex(a, b) * torch.polar(torch.ones_like(angle), angle)  # (B, H, T, R/2)
    rotated = torch.cat((z.real, z.imag), dim=-1) if layout == "rotate_half" else torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    return torch.cat((rotated, x[..., r:]), dim=-1)


def llama_logits(state: dict[str, Tensor], config: dict, ids: Tensor, real: Tensor, positions: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    """(B, T) ids, (B, T) bool real-token mask, (B, T) positions -> (B, T, vocab) logits in ``dtype``.

    ``config``: HuggingFace's config.json as a dict (model_type llama, mistral or qwen3).
    """
    w = {k: v.to(dtype) for k, v in state.items()}
    h, c = config["num_attention_heads"], config["hidden_size"]
    hkv = config.get("num_key_value_heads") or h
    d = config.get("head_dim") or c // h
    eps = config["rms_norm_eps"]
    rope = dict(config.get("rope_parameters") or {})
    scaling = None if rope.get("rope_type", "default") == "default" else rope
    inv_freq = frequencies(d, rope.get("rope_theta", config.get("rope_theta", 10000.0)), scaling)
    window = config.get("sliding_window") if config["model_type"] == "mistral" else None
    b, t = ids.shape
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = (j <= i) & (real[:, None, None, :])  # (B, 1, T, T)
    if window is not None:
        allowed = allowed & (j > i - window)
    x = w["model.embed_tokens.weight"][ids]  # (B, T, C)
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        y = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (y @ w[p + "self_attn.q_proj.weight"].T).view(b, t, h, d).transpose(1, 2)  # (B, H, T, D)
        k = (y @ w[p + "self_attn.k_proj.weight"].T).view(b, t, hkv, d).transpose(1, 2)  # (B, Hkv, T, D)
        v = (y @ w[p + "self_attn.v_proj.weight"].T).view(b, t, hkv, d).transpose(1, 2)
        if config["model_type"] == "qwen3":
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rope_reference(q, positions, inv_freq).to(dtype)
        k = rope_reference(k, positions, inv_freq).to(dtype)
        k, v = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)  # (B, H, T, D)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, -math.inf)
        context = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v  # (B, H, T, D); a pad query that sees nothing: 0
        x = x + context.transpose(1, 2).reshape(b, t, h * d) @ w[p + "self_attn.o_proj.weight"].T
        y = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T  # (B, T, vocab)
