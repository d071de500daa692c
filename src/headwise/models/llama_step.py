"""A Llama decode step as one flat function: the model's own ops in order, without the layers around them.

``generate`` runs its steps unchecked (``check=False``) when nothing outside the model can see or
change a layer (``trusts``: no hooks, eval mode, no observer). A step then does the same tensor
work as ``forward``, but its time is mostly Python: five module calls a layer, the attention
layer's glue, a rotary-table look-up per layer. ``LlamaStep`` writes the step out once for the
Llama family: the same functions on the same tensors in the same order (RMSNorm's ``forward``,
``project`` / ``project_many``, ``rotate`` on q and k at once, ``attention_unchecked``, SwiGLU), so
the logits are ``forward``'s bit for bit (tests/models/test_llama_step.py), with the rotary
tables looked up once a step instead of once a layer.

It takes what ``generate`` hands a step: (B, 1) ids, no position ids (no padding), plain
``KVCache``s of one length. Anything else (padding, a sliding ring, QK-norm, a subclassed layer)
runs ``forward`` itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import KVCache
from ..functional import attention_unchecked
from ..linear import linear, project
from ..rope import rotate
from .llama import MLP, DecoderLayer, LlamaAttention, LlamaForCausalLM, RMSNorm, projections


def flat_step(model: LlamaForCausalLM) -> LlamaStep | None:
    """A ``LlamaStep`` for a Llama-family model whose every layer it can write out, else None."""
    for block in model.blocks:
        attn = block.self_attn
        if type(block) is not DecoderLayer or type(attn) is not LlamaAttention or type(block.mlp) is not MLP:
            return None
        if type(block.input_layernorm) is not RMSNorm or type(block.post_attention_layernorm) is not RMSNorm:
            return None
        if attn.q_norm is not None or attn.window is not None or attn.attn_dropout_p != 0.0 or attn.rotary is not model.rotary:
            return None
    if type(model.final_norm) is not RMSNorm:
        return None
    return LlamaStep(model)


class LlamaStep:
    """``model(ids, cache=caches, logits_to_keep=1, check=False)[:, 0]`` for a decode step, written out flat.

    Called as ``generate``'s step: (ids (B, 1), position_ids or None, caches) -> (B, vocab) logits.
    """

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.layers = [
            (
                block.input_layernorm.forward, (attn.q_proj, attn.k_proj, attn.v_proj), attn, attn.o_proj,
                block.post_attention_layernorm.forward, (block.mlp.gate_proj, block.mlp.up_proj), block.mlp.down_proj,
            )
            for block in model.blocks
            for attn in (block.self_attn,)
        ]

    def __call__(self, ids: Tensor, position_ids: Tensor | None, caches: Sequence[KVCache]) -> Tensor:
        model = self.model
        if position_ids is not None or ids.shape[1] != 1 or not _plain(caches, len(self.layers)):
            return model(ids, positions=position_ids, cache=caches, logits_to_keep=1, check=False)[:, 0]  # (B, vocab)
        B = ids.shape[0]
        cos, sin = model.rotary.at(caches[0].start(1), 1, ids.device)  # (1, R) each: one look-up for every layer
        layout = model.rotary.layout
        x = model.embed_tokens.forward(ids)  # (B, 1, C)
        for (norm1, qkv, attn, o_proj, norm2, gate_up, down), cache in zip(self.layers, caches, strict=True):
            D = attn.head_dim
            q, k, v = projections(qkv, norm1(x))  # (B, 1, H*D), (B, 1, Hkv*D) x2
            q = q.view(B, 1, -1, D).transpose(1, 2)  # (B, H, 1, D)
            k = k.view(B, 1, -1, D).transpose(1, 2)  # (B, Hkv, 1, D)
            v = v.view(B, 1, -1, D).transpose(1, 2)  # (B, Hkv, 1, D)
            qk = rotate(torch.cat((q, k), dim=1), cos, sin, layout)  # (B, H + Hkv, 1, D): as LlamaAttention.position
            q, k = qk.split((q.shape[1], k.shape[1]), dim=1)  # (B, H, 1, D), (B, Hkv, 1, D)
            context = attention_unchecked(q, k, v, cache, causal=True, window=None, backend=attn.backend, **attn.score_terms())  # (B, H, 1, D)
            x = x + project(o_proj, context.transpose(1, 2).reshape(B, 1, -1))  # (B, 1, C)
            gate, up = projections(gate_up, norm2(x))  # (B, 1, I) each
            x = x + project(down, F.silu(gate) * up)  # (B, 1, C)
        x = model.final_norm.forward(x)  # (B, 1, C)
        head = model.lm_head
        logits = linear(x, model.embed_tokens.weight) if head is None else project(head, x)  # (B, 1, vocab)
        return logits[:, 0]  # (B, vocab)


def _plain(caches: Sequence[object], layers: int) -> bool:
    """One plain (not sliding) ``KVCache`` per layer, all of one length: what ``generate`` makes."""
    if len(caches) != layers or any(type(c) is not KVCache or c.window is not None for c in caches):
        return False
    return len({len(c) for c in caches}) == 1
