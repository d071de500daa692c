"""The Llama decode step written out flat (``models/llama_step.py``): the unchecked forward's logits bit for bit,
its caches written the same, and the forward itself wherever the flat step does not apply."""

from __future__ import annotations

import copy

import pytest
import torch

from headwise.models.generate import decode_step
from headwise.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
from headwise.models.llama_config import LlamaConfig
from headwise.models.llama_step import LlamaStep, flat_step
from headwise.quantize import int8_weights

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)

CASES = {
    "gqa fp32": (dict(), torch.float32),
    "gqa bf16": (dict(), torch.bfloat16),
    "mha, biases, tied head": (dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=True), torch.float32),
    "llama3 rope scaling, partial rotary": (
        dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 16}, partial_rotary_factor=0.5), torch.float32),
    "decode-sized widths, bf16": (dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2), torch.bfloat16),
}


def model_of(kw: dict, dtype: torch.dtype, cls: type = LlamaForCausalLM) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = cls(LlamaConfig(**{**BASE, **kw})).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():  # weights of every scale, so that a changed op order would show
            p.normal_(0, 0.5)
    return model


def steps_both_ways(model, batch: int, steps: int = 4):
    """The prompt once, then the same tokens through the flat step and through the unchecked forward, each on its own caches."""
    ids = torch.randint(0, model.vocab_size, (batch, 7))
    with torch.no_grad():
        flat_caches = model.new_caches(batch, 32)
        model(ids, cache=flat_caches, logits_to_keep=1, check=False)
        plain_caches = copy.deepcopy(flat_caches)
        step = flat_step(model)
        assert isinstance(step, LlamaStep)
        token = ids[:, -1:]
        for _ in range(steps):
            got = step(token, None, flat_caches)  # (B, vocab)
            want = model(token, cache=plain_caches, logits_to_keep=1, check=False)[:, 0]  # (B, vocab)
            yield got, want, flat_caches, plain_caches
            token = want.argmax(-1, keepdim=True)  # (B, 1)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("batch", [1, 3, 20])  # 20 rows: more than a decode call's DECODE_ROWS, the layers' GEMMs one by one
def test_the_flat_step_gives_the_forwards_logits_bit_for_bit(case, batch):
    kw, dtype = CASES[case]
    for got, want, flat_caches, plain_caches in steps_both_ways(model_of(kw, dtype), batch):
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)
        for a, b in zip(flat_caches, plain_caches, strict=True):
            assert len(a) == len(b) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_an_int8_model_steps_flat_bit_for_bit():
    model = int8_weights(model_of(dict(hidden_size=256, intermediate_size=512), torch.float32))
    for got, want, _, _ in steps_both_ways(model, 2):
        assert torch.equal(got, want)


def test_generate_takes_the_flat_step_only_unchecked_and_eager():
    model = model_of({}, torch.float32)
    assert isinstance(decode_step(model, False, False), LlamaStep)
    assert not isinstance(decode_step(model, False, True), LlamaStep)  # a checked step is the forward's
    ids = torch.randint(0, model.vocab_size, (2, 5))
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=6)
        caches = model.new_caches(2, 11)  # the same greedy loop through the checked forward
        logits = model(ids, cache=caches, logits_to_keep=1)[:, 0]
        want = [ids]
        for _ in range(6):
            want.append(logits.argmax(-1, keepdim=True))
            logits = model(want[-1], cache=caches, logits_to_keep=1)[:, 0]
    assert torch.equal(tokens, torch.cat(want, dim=1))


@pytest.mark.parametrize(
    "cls, kw",
    [(Qwen3ForCausalLM, dict(qk_norm=True)), (MistralForCausalLM, dict(windows=(8, 8)))],
    ids=["QK-norm", "sliding window"],
)
def test_layers_it_does_not_write_out_keep_the_forward(cls, kw):
    model = model_of(kw, torch.float32, cls)
    assert flat_step(model) is None
    assert not isinstance(decode_step(model, False, False), LlamaStep)


def test_calls_it_does_not_write_out_run_the_forward():
    """Position ids (a padded batch), a sliding ring cache: the step hands them to the forward, the same logits."""
    model = model_of({}, torch.float32)
    step = flat_step(model)
    ids = torch.randint(0, model.vocab_size, (2, 5))
    with torch.no_grad():
        for make in (lambda: model.new_caches(2, 16), lambda: [c.sliding(2, c.k.shape[1], 4, c.k.shape[3]) for c in model.new_caches(2, 16)]):
            caches = make()
            model(ids, cache=caches, logits_to_keep=1, check=False)
            twin = copy.deepcopy(caches)
            positions = torch.tensor([[5], [3]])
            got = step(ids[:, -1:], positions, caches)
            want = model(ids[:, -1:], positions=positions, cache=twin, logits_to_keep=1, check=False)[:, 0]
            assert torch.equal(got, want)
