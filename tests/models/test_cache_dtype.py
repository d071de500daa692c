"""A float32 model over bfloat16 caches (``generate(..., cache_dtype=torch.bfloat16)``, ``new_caches``): half the bytes
a token keeps, the keys and values rounded to bfloat16, everything else in float32.

Oracle: the float64 copy's logits over the whole sequence. The bfloat16 cache costs accuracy against a float32 cache,
and keeps far more of it than the whole model in bfloat16.
"""

from __future__ import annotations

import copy

import pytest
import torch

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4)).eval()


def llama(**kw) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, **kw)
    return LlamaForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "llama-gqa": llama, "mistral-window": lambda: llama(windows=(4, None))}
IDS = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))  # (B, T)


@torch.no_grad()
def decoded_logits(model, cache_dtype: torch.dtype | None, prompt: int = 6) -> torch.Tensor:
    """(B, T - prompt + 1, vocab) float64 logits: a prompt pass, then one token a step, through ``new_caches``."""
    b, t = IDS.shape
    caches = model.new_caches(b, t, cache_dtype)
    out = [model(IDS[:, :prompt], cache=caches)[:, -1:]]
    out += [model(IDS[:, i : i + 1], cache=caches) for i in range(prompt, t)]
    return torch.cat(out, dim=1).double()


@pytest.mark.parametrize("name", MODELS)
def test_a_bfloat16_cache_costs_a_float32_model_far_less_than_bfloat16_weights(name):
    model = MODELS[name]()
    want = decoded_logits(copy.deepcopy(model).double(), None)  # float64 throughout
    error = {
        "float32": decoded_logits(model, None),
        "bfloat16 cache": decoded_logits(model, torch.bfloat16),
        "int8 cache": decoded_logits(model, torch.int8),
        "bfloat16 model": decoded_logits(copy.deepcopy(model).bfloat16(), None),
    }
    error = {k: ((v - want).norm() / want.norm()).item() for k, v in error.items()}
    assert error["float32"] < error["bfloat16 cache"] < error["bfloat16 model"] / 2, error  # the cache does hold bfloat16
    # 8-bit rows, each with its own scale: about twice the bfloat16 cache's error, still far below a bfloat16 model's
    assert error["bfloat16 cache"] < error["int8 cache"] < error["bfloat16 model"] / 2, error
    assert all(c.dtype == torch.bfloat16 for c in model.new_caches(1, 8, torch.bfloat16))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("held", [torch.bfloat16, torch.int8])
def test_generate_decodes_through_bfloat16_or_8_bit_caches_when_asked(name, held, monkeypatch):
    model = MODELS[name]()
    made, new_caches = [], model.new_caches
    monkeypatch.setattr(model, "new_caches", lambda *a: made.extend(new_caches(*a)) or made)
    got = model.generate(IDS, max_new_tokens=8, cache_dtype=held)  # (B, T + 8)
    assert made and all(c.k.dtype == held and len(c) == IDS.shape[1] + 7 for c in made)
    caches, ids = new_caches(2, 28, held), IDS  # the same greedy loop through the checked forward
    with torch.no_grad():
        logits = model(ids, cache=caches)[:, -1]
        for _ in range(8):
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
            logits = model(ids[:, -1:], cache=caches)[:, -1]
    assert torch.equal(got, ids)


def test_8_bit_rows_for_a_head_dim_they_cannot_take_are_refused_naming_cache_dtype():
    """Each way to ask a model for 8-bit caches names the argument the caller gave (the caches named their own ``dtype``)."""
    from headwise.models import Batcher, generate_many

    model = llama(head_dim=6)  # each row's float32 scale follows its values, 4-byte aligned: head_dim a multiple of 4
    for make in (lambda: model.generate(IDS, max_new_tokens=2, cache_dtype=torch.int8), lambda: model.new_paged_caches(4, 4, torch.int8),
                 lambda: Batcher(model, num_blocks=4, cache_dtype=torch.int8), lambda: generate_many(model, [IDS[0]], 2, cache_dtype=torch.int8)):
        with pytest.raises(ValueError, match=r"^cache_dtype=torch.int8 needs a head_dim that is a multiple of 4 .*got head_dim=6"):
            make()


def test_a_cache_dtype_the_model_cannot_hold_is_refused():
    model = gpt2()
    with pytest.raises(TypeError, match=r"cache_dtype is torch.float16, but the keys and values are torch.float32: a cache holds their dtype, or torch.bfloat16 for float32 ones"):
        model.generate(IDS, max_new_tokens=2, cache_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"cache_dtype must be None, a floating-point torch.dtype \(e.g. torch.bfloat16\) or torch.int8 \(8-bit rows\), got 'bf16'"):
        model.generate(IDS, max_new_tokens=2, cache_dtype="bf16")
    with pytest.raises(TypeError, match=r"cache_dtype must be None, a floating-point .* or torch.int8 .*got torch.uint8"):
        model.generate(IDS, max_new_tokens=2, cache_dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"cache_dtype is torch.float32, but the keys and values are torch.bfloat16"):
        model.bfloat16().new_paged_caches(4, 4, torch.float32)
