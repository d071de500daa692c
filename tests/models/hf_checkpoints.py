"""Small randomly initialised transformers checkpoints for the model tests (made here, no hub)."""

from __future__ import annotations

import torch

GPT2_SIZES = {"vocab_size": 211, "n_positions": 48, "n_embd": 64, "n_layer": 2, "n_head": 4}


def make_hf_gpt2(seed: int = 0):
    """A randomly initialised transformers GPT2LMHeadModel (eval mode), weights scaled up so
    that greedy choices are clear-cut (a std-0.02 init gives nearly uniform logits)."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(**GPT2_SIZES, bos_token_id=0, eos_token_id=1)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3 if "wte" in name or "wpe" in name else 0.1)
    return model
