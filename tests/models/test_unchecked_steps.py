"""generate's unchecked decode steps (``step_logits``, ``AttentionLayer.decode``) give the checked
path's numbers bit for bit, and generate falls back to the checked path where it must."""

import pytest
import torch
from torch import nn

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.generate import unchecked_steps
from headwise.models.llama_config import LlamaConfig
from headwise.observe import observe
from headwise.quantize import int8_weights


def gpt2(**kw):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4, **kw)).eval()


def llama(**kw):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, **kw)
    return LlamaForCausalLM(config).eval()


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "llama-tied": lambda: llama(tie_word_embeddings=True),
    "mistral-window": lambda: llama(windows=(4, None)),  # layer 0 on a ring cache of 4 slots
    "qwen3-qk-norm": lambda: llama(qk_norm=True, head_dim=16),
    "gpt2-bf16": lambda: gpt2().to(torch.bfloat16),
    "llama-bf16": lambda: llama().to(torch.bfloat16),
    "gpt2-int8": lambda: int8_weights(gpt2()),
    "llama-int8": lambda: int8_weights(llama()),
}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])  # (B, T): row 1 left-padded
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("mask", [None, MASK], ids=["no-padding", "left-padding"])
@torch.no_grad()
def test_unchecked_steps_equal_the_checked_steps_bit_for_bit(name, mask):
    model = MODELS[name]()
    assert unchecked_steps(model)
    real = None if mask is None else mask.bool()
    positions = None if real is None else (real.long().cumsum(-1) - 1).masked_fill(~real, 0)  # (B, T)
    checked, unchecked = (model.new_caches(2, 6 + 12) for _ in range(2))
    first = model.next_logits(IDS, positions, real, checked)  # (B, vocab)
    assert torch.equal(first, model.next_logits(IDS, positions, real, unchecked))
    token, position = first.argmax(-1)[:, None], None if positions is None else positions[:, -1:]  # (B, 1)
    for _ in range(12):
        position = None if position is None else position + 1
        want = model.next_logits(token, position, None, checked)  # (B, vocab)
        got = model.step_logits(token, position, unchecked)
        assert torch.equal(got, want)
        token = want.argmax(-1)[:, None]  # (B, 1)
    for a, b in zip(checked, unchecked, strict=True):
        assert len(a) == len(b) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral-window"])
def test_generate_is_the_same_with_checked_steps(name):
    """A no-op forward hook sends every step through the checked path: the tokens do not change."""
    model = MODELS[name]()
    fast = model.generate(IDS, attention_mask=MASK, max_new_tokens=10)
    handle = model.register_forward_pre_hook(lambda module, args: None)
    assert not unchecked_steps(model)
    slow = model.generate(IDS, attention_mask=MASK, max_new_tokens=10)
    handle.remove()
    assert torch.equal(fast, slow)


def test_generate_checks_every_step_when_it_cannot_trust_them():
    model = gpt2()
    assert unchecked_steps(model)
    model.train()
    assert not unchecked_steps(model)  # dropout: decode skips it
    model.eval()
    handle = model.transformer.h[1].attn.register_forward_hook(lambda module, args, out: None)
    assert not unchecked_steps(model)  # decode does not run the hooks of __call__
    handle.remove()
    with observe(lambda name, tensor: None):
        assert not unchecked_steps(model)  # an observer reads the checked path's steps
    assert not unchecked_steps(nn.Linear(2, 2))  # no step_logits
    model.next_logits = torch.compile(model.next_logits)  # the caller's own step (not compiled until called)
    assert not unchecked_steps(model)


def test_a_hooked_attention_layer_sees_every_step():
    model = gpt2()
    calls = []
    model.transformer.h[0].attn.register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
    model.generate(IDS[:1], max_new_tokens=5)
    assert calls == [(1, 6, 32)] + [(1, 1, 32)] * 4  # the prompt, then 4 steps (the 5th token needs no step)


@pytest.mark.parametrize("terms", [
    {"softcap": 5.0}, {"sinks": True}, {"alibi": True}, {"window": 3}, {"num_kv_heads": 2, "window": 3, "sinks": True},
    {"alibi": True, "window": 3},
], ids=str)
@pytest.mark.parametrize("sliding", [False, True])
@torch.no_grad()
def test_decode_equals_forward_with_every_score_term(terms, sliding):
    """``AttentionLayer.decode`` (generate's unchecked step) and ``forward`` through twin caches, bit for bit."""
    from headwise import KVCache, MultiHeadAttention

    if sliding and "window" not in terms:
        pytest.skip("a ring cache goes with a window")
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 16, 32, 0.0, num_heads=4, **terms).eval()
    if "sinks" in terms:
        nn.init.normal_(mha.sinks)
    hkv = terms.get("num_kv_heads", 4)
    make = (lambda: KVCache.sliding(2, hkv, terms["window"], 4)) if sliding else (lambda: KVCache(2, hkv, 32, 4))
    checked, unchecked = make(), make()
    x = torch.randn(2, 5, 16)  # (B, T, C): the prompt, checked
    torch.testing.assert_close(mha(x, cache=checked), mha(x, cache=unchecked), rtol=0, atol=0)
    for _ in range(8):
        x = torch.randn(2, 1, 16)  # (B, 1, C): one step
        assert torch.equal(mha.decode(x, unchecked), mha(x, cache=checked))
    assert len(checked) == len(unchecked) == 13 and torch.equal(checked.k, unchecked.k) and torch.equal(checked.v, unchecked.v)
