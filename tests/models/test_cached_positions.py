"""Positions after a left-padded write into a model's caches: each row's next tokens sit after its real tokens,
whether the caller passes positions or not, so a padded row's logits are those of its unpadded self.

Oracle: each row run alone without padding, in one forward (float64).
"""

from __future__ import annotations

import pytest
import torch

import headwise as hw
from headwise.models import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

V = 50


def scaled(model: torch.nn.Module) -> torch.nn.Module:
    """Float64, eval, weights scaled so that a position's effect is far above rounding."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.ndim == 2 else p.uniform_(0.5, 1.5)
    return model.double().eval()


MODELS = {
    "gpt2": lambda: scaled(GPT2LMHeadModel(hw.GPT2Config(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4))),
    "llama": lambda: scaled(LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32))),
    "mistral-ring": lambda: scaled(LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, windows=(4, 4)))),
}
PADS = [3, 0, 5]  # each row's left padding
REAL = 9  # each row's real tokens, the last 3 of them taken one step at a time


def rows() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (len(PADS), max(PADS) + REAL), generator=g)  # (B, L)
    is_token = torch.ones_like(ids, dtype=torch.bool)
    for b, pad in enumerate(PADS):  # each row's real tokens right-aligned after its padding
        is_token[b, : max(PADS) - pad] = False  # the columns before this row's padding also pad it
    return ids, is_token


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("chunks", [[None, 1, 1, 1], [5, None, 1, 1]], ids=["prefill-steps", "chunked-prefill"])
def test_steps_after_a_padded_prefill_give_each_row_alone(name, chunks):
    model = MODELS[name]()
    ids, is_token = rows()
    L = ids.shape[1]
    ends = [L - 3] if chunks[0] is None else [chunks[0], L - 3]
    ends += [L - 2, L - 1, L]
    caches = model.new_caches(len(PADS), L)
    got, t0 = [], 0
    with torch.no_grad():
        for t1 in ends:  # each chunk with its own padding, then one-token steps with none (the cache remembers it)
            mask = is_token[:, t0:t1] if t1 <= L - 3 else None
            got.append(model(ids[:, t0:t1], attention_mask=mask, cache=caches))
            t0 = t1
        got = torch.cat(got, dim=1)  # (B, L, vocab)
        for b in range(len(PADS)):
            real = is_token[b]
            alone = model(ids[b : b + 1, real])[0]  # (REAL..., vocab): this row alone, unpadded
            torch.testing.assert_close(got[b, real], alone, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_positions_past_the_context_are_refused_naming_them(name):
    model = MODELS[name]()
    ids = torch.tensor([[1, 2, 3]])
    for positions in (torch.tensor([[30, 31, 32]]), torch.tensor([[-1, 0, 1]])):
        with pytest.raises(ValueError, match=r"positions must lie in \[0, (n_positions|max_position_embeddings)=32\), got values from"):
            model(ids, positions=positions)  # GPT-2's position table: an IndexError that named nothing
    assert model(ids, positions=torch.tensor([[29, 30, 31]])).shape == (1, 3, V)


def test_negative_positions_are_refused_where_every_layer_slides():
    # every layer sliding: no upper limit on positions, but a negative one is still an error, as for its full-attention sibling
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         max_position_embeddings=32, windows=(5, 3))).eval()
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"positions must not be negative, got values from -1 to 1"):
        model(ids, positions=torch.tensor([[-1, 0, 1]]))
    assert model(ids, positions=torch.tensor([[100, 101, 102]])).shape == (1, 3, V)  # past max_position_embeddings: no limit
