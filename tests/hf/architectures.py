"""The architectures tested through ``attn_implementation="headwise"``, each as a tiny random model.

One row per architecture: how to build it (``from_config``, float32, a fixed seed) and what it
exercises. Decoders are compared on a left-padded batch, encoders on a right-padded one, and
every one on a batch with nothing padded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import transformers as tf

VOCAB = 100
#: 2 layers, width 32, 4 query heads over 2 key/value heads: the size of every decoder below.
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=None)  # fmt: skip
#: The same size for BERT-like encoders (no key/value heads of their own).
ENCODER = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
MOE = dict(num_experts_per_tok=2)


@dataclass(frozen=True)
class Arch:
    name: str
    exercises: str
    kind: str  # "decoder", "encoder" or "seq2seq"
    config: object  # a callable returning the transformers config
    packs: bool = True  # transformers detects packed rows (position_ids restarting at 0) for it
    model: object = None  # the transformers class to build, when not the kind's Auto class (compared on last_hidden_state)
    weights: bool = True  # its layers pass output_attentions down to the attention function (Falcon's keep it: None, as under sdpa)


ARCHS = [
    Arch("llama", "GQA, rotary positions, left padding, DynamicCache and StaticCache generation", "decoder",
         lambda: tf.LlamaConfig(**SMALL)),
    Arch("mistral", "a sliding window (4) shorter than the prompt, with padding", "decoder",
         lambda: tf.MistralConfig(**SMALL, sliding_window=4)),
    Arch("qwen3", "QK-norm, GQA, explicit head size", "decoder",
         lambda: tf.Qwen3Config(**SMALL, head_dim=8)),
    Arch("gemma2", "logit softcap, alternating sliding (4) / full layers, query_pre_attn_scalar", "decoder",
         lambda: tf.Gemma2Config(**SMALL, head_dim=8, sliding_window=4, query_pre_attn_scalar=16)),
    Arch("gpt_oss", "learned sinks (s_aux), sliding (4) / full layers, mixture of experts", "decoder",
         lambda: tf.GptOssConfig(**SMALL, head_dim=8, sliding_window=4, num_local_experts=4, **MOE),
         packs=False),  # transformers' own eager gives a packed row 0.14 away from its sequences run alone (so does headwise, to 1e-8)
    Arch("phi3", "fused qkv projection, a sliding window passed to every layer", "decoder",
         lambda: tf.Phi3Config(**SMALL, sliding_window=4)),
    Arch("deepseek_v3", "multi-head latent attention: value head 12 != query/key head 16", "decoder",
         lambda: tf.DeepseekV3Config(**{**SMALL, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                     qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4, first_k_dense_replace=1,
                                     moe_intermediate_size=16, n_group=1, topk_group=1, **MOE)),
    Arch("paligemma", "a causal mask built for layers that say is_causal=False (the text model's use_bidirectional_attention)", "decoder",
         lambda: tf.PaliGemmaConfig(text_config=dict(model_type="gemma", **SMALL, head_dim=8), image_token_id=VOCAB - 1,
                                    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                       image_size=32, patch_size=8, projection_dim=32)),
         model=lambda: tf.PaliGemmaModel),
    Arch("falcon", "multi-query attention (one key/value head), rotary positions, attention and MLP in parallel", "decoder",
         lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=None),
         weights=False),
    Arch("gpt2", "full multi-head attention, learned positions, attention weights recorded by hooks", "decoder",
         lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1, eos_token_id=None)),
    Arch("bert", "a bidirectional encoder with right padding", "encoder",
         lambda: tf.BertConfig(**ENCODER)),
    Arch("splinter", "a bidirectional encoder whose attention layers do not say is_causal", "encoder",
         lambda: tf.SplinterConfig(**ENCODER, question_token_id=VOCAB - 1), model=lambda: tf.SplinterModel),
    Arch("align_text", "ALIGN's text tower: bidirectional, no is_causal on its layers", "encoder",
         lambda: tf.AlignTextConfig(**ENCODER), model=lambda: tf.AlignTextModel),
    Arch("clap_text", "CLAP's text tower (RoBERTa-like): bidirectional, no is_causal on its layers", "encoder",
         lambda: tf.ClapTextConfig(**ENCODER), model=lambda: tf.ClapTextModel),
    Arch("bart", "encoder-decoder: padded encoder, causal decoder, cross-attention", "seq2seq",
         lambda: tf.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                               encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, max_position_embeddings=64,
                               pad_token_id=0, bos_token_id=1, eos_token_id=None, decoder_start_token_id=1, forced_eos_token_id=None,
                               forced_bos_token_id=None, init_std=0.5)),
    Arch("whisper", "audio encoder, cross-attention, queries scaled before attention (scaling=1)", "seq2seq",
         lambda: tf.WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, num_mel_bins=8, max_source_positions=16,
                                  max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=None, decoder_start_token_id=1,
                                  begin_suppress_tokens=None, suppress_tokens=None, init_std=0.5)),
    Arch("t5", "an additive relative position bias (position_bias) in every layer, encoder-decoder", "seq2seq",
         lambda: tf.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
                             relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=None, decoder_start_token_id=1,
                             initializer_factor=2.0)),
]  # fmt: skip
BY_NAME = {a.name: a for a in ARCHS}


@functools.cache
def build(arch: Arch, implementation: str):
    """The architecture's tiny model in eval mode, float32, weights from seed 0 (built once, shared by the tests)."""
    torch.manual_seed(0)
    config = arch.config()
    if arch.model is not None:
        model = arch.model()(config).to(torch.float32)
        model.set_attn_implementation(implementation)
        return model.eval()
    auto = {"decoder": tf.AutoModelForCausalLM, "encoder": tf.AutoModelForMaskedLM, "seq2seq": tf.AutoModelForSeq2SeqLM}[arch.kind]
    if arch.name == "whisper":
        auto = tf.AutoModelForSpeechSeq2Seq
    return auto.from_config(config, attn_implementation=implementation, dtype=torch.float32).eval()


def output(out) -> torch.Tensor:
    """(B, T, vocab) logits, or (B, T, C) hidden states for a model without a language-model head."""
    return out.logits if "logits" in out else out.last_hidden_state


def batch(arch: Arch, padded: bool = True) -> dict[str, torch.Tensor]:
    """Inputs with padding: decoders left-padded (row 1: 3 pads), encoders right-padded (row 1: 2 pads);
    ``padded=False``: the same tokens, all real, and no ``attention_mask``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    if arch.kind == "decoder":
        mask[1, :3] = 0
    else:
        mask[1, -2:] = 0
    if padded:
        ids[mask == 0] = 0
    if arch.name == "whisper":
        return {"input_features": torch.randn(2, 8, 32, generator=g), "decoder_input_ids": ids[:, :6]}
    inputs = {"input_ids": ids, "attention_mask": mask} if padded else {"input_ids": ids}
    if arch.kind == "seq2seq":
        inputs["decoder_input_ids"] = ids[:, :6].clamp(min=2)
    return inputs


def real_rows(arch: Arch, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, T_out) bool: the output positions that belong to real tokens (padded ones are not compared)."""
    if arch.kind == "seq2seq":
        return torch.ones(inputs["decoder_input_ids"].shape, dtype=torch.bool)
    if "attention_mask" not in inputs:
        return torch.ones(inputs["input_ids"].shape, dtype=torch.bool)
    return inputs["attention_mask"].bool()
