"""``logits_to_keep``: the last k positions' logits equal the full forward's, and generate runs the LM
head on one row per sequence (the prompt's other positions never reach it)."""

import pytest
import torch
from torch import nn

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.llama_config import LlamaConfig


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()


def llama(tied=False):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "llama": llama, "llama-tied": lambda: llama(tied=True)}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14]])  # (B, T): row 1 left-padded
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("keep", [1, 2, 6])
@pytest.mark.parametrize("mask", [None, MASK])
def test_kept_logits_equal_the_last_positions_of_all_logits(name, keep, mask):
    model = MODELS[name]()
    with torch.no_grad():
        full = model(IDS, attention_mask=mask)  # (B, T, vocab)
        kept = model(IDS, attention_mask=mask, logits_to_keep=keep)  # (B, keep, vocab)
        default = model(IDS, attention_mask=mask, logits_to_keep=0)
    assert kept.shape == (2, keep, 97)
    torch.testing.assert_close(kept, full[:, -keep:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(default, full, rtol=0, atol=0)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize(("bad", "error"), [(-1, ValueError), (7, ValueError), (True, TypeError), (1.0, TypeError), (None, TypeError)])
def test_logits_to_keep_must_be_a_count_of_positions(name, bad, error):
    with pytest.raises(error, match=rf"logits_to_keep \(0 = all positions, or a 1-D tensor of positions\) must be an int in \[0, 6\], got {bad!r}"):
        MODELS[name]()(IDS, logits_to_keep=bad)


@pytest.mark.parametrize("name", MODELS)
def test_logits_kept_at_given_positions_equal_those_of_all_logits(name):
    model = MODELS[name]()
    rows = torch.tensor([5, 0, 3])
    with torch.no_grad():
        full, kept = model(IDS, attention_mask=MASK), model(IDS, attention_mask=MASK, logits_to_keep=rows)  # (B, T, vocab), (B, 3, vocab)
    torch.testing.assert_close(kept, full[:, rows], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"logits_to_keep must hold positions in \[0, T=6\), got \[6\]"):
        model(IDS, logits_to_keep=torch.tensor([6]))
    with pytest.raises(ValueError, match=r"logits_to_keep must hold positions in \[0, T=6\), got \[-1\]"):
        model(IDS, logits_to_keep=torch.tensor([-1]))  # would wrap to the last position
    with pytest.raises(TypeError, match=r"logits_to_keep as a tensor must be 1-D integer positions \(N,\), got dtype torch.float32"):
        model(IDS, logits_to_keep=torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"logits_to_keep as a tensor must be 1-D integer positions \(N,\), got shape \(1, 1\)"):
        model(IDS, logits_to_keep=torch.tensor([[1]]))


@pytest.mark.parametrize("name", MODELS)
def test_generate_runs_the_lm_head_on_the_last_row_only(name):
    """A hooked head (same weight) records the rows it sees: one per sequence, in the prefill too."""
    model = MODELS[name]()
    expected = model.generate(IDS, attention_mask=MASK, max_new_tokens=4)
    weight = model.transformer.wte.weight if name == "gpt2" else (model.lm_head or model.model.embed_tokens).weight
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = weight  # the same parameter: the same logits
    seen = []
    head.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    model.lm_head = head
    got = model.generate(IDS, attention_mask=MASK, max_new_tokens=4)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert seen == [(2, 1, 32)] * 4  # prefill + 3 steps (the 4th token needs no more logits)
