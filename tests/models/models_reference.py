"""Independent float64 references for GPT-2 and BERT, computed straight from HuggingFace state dicts.

Written from the architectures' definitions with plain tensor operations: nothing here imports
headwise, transformers, torch.nn.MultiheadAttention or the book's package. Weights keep
HuggingFace's layout (GPT-2's Conv1D weights are (in, out), so ``x @ W``; BERT's Linear
weights are (out, in), so ``x @ W.T``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu_tanh(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def gelu_erf(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor]:
    """q, k, v (B, H, T, D); allowed (B, 1, T, T) bool. Rows that may see nothing get zeros."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill(~allowed, -math.inf)
    peak = scores.amax(-1, keepdim=True)
    peak = peak.masked_fill(peak == -math.inf, 0.0)  # finite even for an all -inf row
    e = torch.exp(scores - peak)  # exp(-inf) = 0
    total = e.sum(-1, keepdim=True)
    weights = torch.where(total > 0, e / total.clamp(min=1e-300), torch.zeros_like(e))
    return weights @ v, weights


def heads(x: Tensor, h: int) -> Tensor:
    b, t, c = x.shape
    return x.reshape(b, t, h, c // h).permute(0, 2, 1, 3)  # (B, H, T, D)


def merge(x: Tensor) -> Tensor:
    b, h, t, d = x.shape
    return x.permute(0, 2, 1, 3).reshape(b, t, h * d)


def gpt2_logits(
    state: dict[str, Tensor], input_ids: Tensor, real: Tensor, position_ids: Tensor, *, n_head: int, eps: float, dtype=torch.float64
) -> Tensor:
    """(B, T, vocab) logits of a HuggingFace GPT-2 state dict; real (B, T) bool = real token."""
    s = {k.removeprefix("transformer."): v.to(dtype) for k, v in state.items() if v.is_floating_point()}
    n_layer = 1 + max(int(k.split(".")[1]) for k in s if k.startswith("h."))
    t = input_ids.shape[1]
    x = s["wte.weight"][input_ids] + s["wpe.weight"][position_ids]  # (B, T, C)
    allowed = (torch.ones(t, t, dtype=torch.bool).tril()[None] & real[:, None, :])[:, None]  # (B, 1, T, T)
    for i in range(n_layer):
        p = f"h.{i}."
        a = layer_norm(x, s[p + "ln_1.weight"], s[p + "ln_1.bias"], eps)
        q, k, v = (a @ s[p + "attn.c_attn.weight"] + s[p + "attn.c_attn.bias"]).chunk(3, dim=-1)
        ctx, _ = softmax_attention(heads(q, n_head), heads(k, n_head), heads(v, n_head), allowed)
        x = x + merge(ctx) @ s[p + "attn.c_proj.weight"] + s[p + "attn.c_proj.bias"]
        m = layer_norm(x, s[p + "ln_2.weight"], s[p + "ln_2.bias"], eps)
        x = x + gelu_tanh(m @ s[p + "mlp.c_fc.weight"] + s[p + "mlp.c_fc.bias"]) @ s[p + "mlp.c_proj.weight"] + s[p + "mlp.c_proj.bias"]
    x = layer_norm(x, s["ln_f.weight"], s["ln_f.bias"], eps)
    return x @ s["wte.weight"].T


def bert_layers(
    state: dict[str, Tensor], input_ids: Tensor, real: Tensor, *, n_head: int, eps: float, dtype=torch.float64
) -> list[dict[str, Tensor]]:
    """Per layer of a HuggingFace BERT state dict: {"attention": (B, T, C) before the residual,
    "weights": (B, H, T, T), "hidden": (B, T, C) the layer's output}."""
    s = {k.removeprefix("bert."): v.to(dtype) for k, v in state.items() if v.is_floating_point()}
    n_layer = 1 + max(int(k.split(".")[2]) for k in s if k.startswith("encoder.layer."))
    t = input_ids.shape[1]
    x = s["embeddings.word_embeddings.weight"][input_ids] + s["embeddings.position_embeddings.weight"][:t] + s["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, s["embeddings.LayerNorm.weight"], s["embeddings.LayerNorm.bias"], eps)
    allowed = real[:, None, None, :].expand(-1, 1, t, t)  # (B, 1, T, T): every query sees every real key
    out = []
    for i in range(n_layer):
        p = f"encoder.layer.{i}."

        def lin(z: Tensor, name: str, p: str = p) -> Tensor:
            return z @ s[p + name + ".weight"].T + s[p + name + ".bias"]

        q, k, v = (heads(lin(x, f"attention.self.{n}"), n_head) for n in ("query", "key", "value"))
        ctx, weights = softmax_attention(q, k, v, allowed)
        attn = lin(merge(ctx), "attention.output.dense")
        x = layer_norm(x + attn, s[p + "attention.output.LayerNorm.weight"], s[p + "attention.output.LayerNorm.bias"], eps)
        x = layer_norm(x + lin(gelu_erf(lin(x, "intermediate.dense")), "output.dense"), s[p + "output.LayerNorm.weight"], s[p + "output.LayerNorm.bias"], eps)
        out.append({"attention": attn, "weights": weights, "hidden": x})
    return out
