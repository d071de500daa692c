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


#: Tiny Llama-family sizes: 8 query heads of 8 dims; the KV heads vary per config (GQA ratios 1, 2, 4).
LLAMA_SIZES = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 8, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
}

#: name -> (model_type, config overrides): the configurations the Llama-family tests run.
LLAMA_CONFIGS = {
    "llama-mha-untied": ("llama", {"num_key_value_heads": 8}),
    "llama-gqa2-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-gqa4-scaled": ("llama", {
        "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    }),
    "llama-linear-scaled": ("llama", {"num_key_value_heads": 4, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "mistral-window": ("mistral", {"num_key_value_heads": 2, "sliding_window": 5}),
    "qwen3-qknorm-tied": ("qwen3", {"num_key_value_heads": 4, "head_dim": 16, "tie_word_embeddings": True}),
    # a partial_rotary_factor transformers' llama-family models do not read under the default rope: every dim rotates
    "qwen3-partial-factor-unread": ("qwen3", {"num_key_value_heads": 4, "head_dim": 16, "partial_rotary_factor": 0.5}),
}


def make_hf_llama(name: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised transformers Llama / Mistral / Qwen3 causal LM (eval mode, eager attention),
    weights scaled up so that greedy choices are clear-cut."""
    import transformers

    model_type, overrides = LLAMA_CONFIGS[name]
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[model_type]
    kw = {**LLAMA_SIZES, "bos_token_id": 0, "eos_token_id": None, "pad_token_id": 0, **overrides}  # no EOS unless a test asks
    if model_type == "qwen3":
        kw["use_sliding_window"] = False
    torch.manual_seed(seed)
    config = config_class(**kw)
    config._attn_implementation = "eager"
    model = model_class(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.5 if "embed_tokens" in pname or "lm_head" in pname else 0.15)
            else:  # RMSNorm weights: not all ones, so that a missed norm shows
                p.uniform_(0.5, 1.5)
    return model.to(dtype)


def save_hf_llama(name: str, path, seed: int = 0, dtype: torch.dtype = torch.float32, **save_kw):
    """``make_hf_llama(name)`` written with ``save_pretrained`` into ``path``; returns the transformers model."""
    model = make_hf_llama(name, seed, dtype)
    model.save_pretrained(path, **save_kw)
    return model
