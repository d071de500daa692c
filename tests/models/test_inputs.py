"""``models._inputs``: generate's arguments as numpy integers, and the context check on a meta model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headwise as hw
from headwise.models import GPT2LMHeadModel, generate_many


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
