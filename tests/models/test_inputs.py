"""``models._inputs``: generate's arguments as numpy integers, the context check on a meta model, and the checks every layer's cache passes before any layer writes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headwise as hw
from headwise.models import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, generate_many


def tiny_gpt2(device: str = "cpu") -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(hw.GPT2Config(vocab_size=50, n_positions=8, n_embd=16, n_layer=1, n_head=2)).to(device).eval()


def test_generate_takes_numpy_ints_as_it_takes_ints():
    """Ids and counts read from a numpy array (a tokenizer's output) work as the ints they hold."""
    model = tiny_gpt2()
    ids = torch.tensor([[3, 4, 5]])
    want = model.generate(ids, max_new_tokens=4, eos_token_id=7)
    torch.testing.assert_close(model.generate(ids, max_new_tokens=np.int64(4), eos_token_id=np.int64(7), top_k=np.int32(3)),
                               model.generate(ids, max_new_tokens=4, eos_token_id=7, top_k=3))
    torch.testing.assert_close(model.generate(ids, max_new_tokens=np.int64(4), eos_token_id=np.int64(7)), want)
    outs = generate_many(model, [ids[0]], max_new_tokens=np.int64(4), eos_token_id=np.int64(7), block_size=np.int64(4))
    torch.testing.assert_close(outs[0], want[0, 3:])


@pytest.mark.parametrize(("name", "value"), [("max_new_tokens", 2.5), ("eos_token_id", "7"), ("top_k", torch.tensor(3))])
def test_generate_refuses_a_count_or_id_of_the_wrong_type_with_a_type_error(name, value):
    with pytest.raises(TypeError, match=rf"{name}.* must be a"):
        tiny_gpt2().generate(torch.tensor([[3, 4, 5]]), **{"max_new_tokens": 2, name: value})


def test_the_context_check_on_a_meta_model_counts_the_padding_it_cannot_read():
    """A meta mask has no values: where the padded width would not fit, the refusal says so (no failed host read)."""
    model = tiny_gpt2("meta")
    ids = torch.zeros(2, 6, dtype=torch.long, device="meta")
    real = torch.ones(2, 6, dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match=r"prompt \(6 tokens\) \+ max_new_tokens \(4\) exceeds n_positions=8 by 1 .*"
                                         r"a meta attention_mask has no values to read the real lengths from"):
        model.generate(ids, max_new_tokens=4, attention_mask=real)
    assert model.generate(ids, max_new_tokens=3, attention_mask=real).shape == (2, 9)  # fits: nothing to read


def tiny_llama(windows: tuple | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=16, windows=windows)
    return LlamaForCausalLM(config).eval()


def test_keys_an_upper_layer_records_for_autograd_are_refused_before_any_layer_writes():
    """Lower layers frozen, the top one trained, grad on: its keys want a gradient, which a paged pool or an 8-bit cache
    refuses; the call is refused before layer 0 writes (its keys want none), so every cache stays as it was."""
    model = tiny_llama()
    for p in model.parameters():
        p.requires_grad_(False)
    for p in model.blocks[1].self_attn.parameters():
        p.requires_grad_(True)
    pools = model.new_paged_caches(8, 4)
    for pool in pools:
        pool.add(0)
    first = pools[0].batch([0], [3])
    with pytest.raises(ValueError, match=r"cache\[1\] \(layer 1\): k requires grad, but a PagedKVCache serves inference only"):
        model(torch.tensor([[1, 2, 3]]), cache=[first, pools[1].batch([0], [3], like=first)])
    assert [pool.length(0) for pool in pools] == [0, 0] and [pool.free_blocks for pool in pools] == [8, 8]
    caches = model.new_caches(1, 8, torch.int8)
    with pytest.raises(ValueError, match=r"cache\[1\] \(layer 1\): k requires grad: an 8-bit cache rounds"):
        model(torch.tensor([[1, 2, 3]]), cache=caches)
    assert [len(c) for c in caches] == [0, 0]
    for p in model.blocks[1].self_attn.parameters():  # only the top layer's MLP trained: no key wants a gradient
        p.requires_grad_(False)
    for p in model.blocks[1].mlp.parameters():
        p.requires_grad_(True)
    model(torch.tensor([[1, 2, 3]]), cache=caches).sum().backward()
    assert [len(c) for c in caches] == [3, 3] and model.blocks[1].mlp.down_proj.weight.grad is not None


def test_positions_given_do_not_let_a_layer_that_sees_every_key_overrun_after_a_sliding_one_wrote():
    """Layer 0 slides, layer 1 sees every key (bounded by max_position_embeddings=16): 10 cached + 10 new tokens are
    refused before the sliding layer writes, whatever the positions say."""
    model = tiny_llama(windows=(3, None))
    caches = model.new_caches(1, 40)
    with torch.no_grad():
        model(torch.randint(0, 97, (1, 10)), cache=caches)
        with pytest.raises(ValueError, match=r"input_ids has 10 tokens after 10 cached, more than max_position_embeddings=16"):
            model(torch.randint(0, 97, (1, 10)), cache=caches, positions=torch.arange(10)[None])
        assert [len(c) for c in caches] == [10, 10]
        model(torch.randint(0, 97, (1, 6)), cache=caches, positions=torch.arange(10, 16)[None])  # what fits still runs
    assert [len(c) for c in caches] == [16, 16]


def test_a_model_whose_every_layer_slides_generates_as_many_tokens_as_asked():
    """Every layer's cache is a ring of its window: no context limit, so any count is taken (until the end token here),
    by ``generate`` as by ``generate_many`` (its caches were asked for prompt + count slots, past a size's limit)."""
    model = tiny_llama(windows=(3, 3))
    ids = torch.tensor([[3, 4, 5]])
    eos = int(model.generate(ids, max_new_tokens=1)[0, -1])
    assert model.generate(ids, max_new_tokens=2**63 - 1, eos_token_id=eos).tolist() == [[3, 4, 5, eos]]
    assert generate_many(model, [ids[0]], 2**63 - 1, eos_token_id=eos)[0].tolist() == [eos]
