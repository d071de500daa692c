"""``headwise.models.generate.greedy``: the index ``argmax`` gives, found a chunk at a time on the CPU."""

import math

import pytest
import torch

from headwise.models.generate import GREEDY_CHUNK, _chunk, greedy


def cases(vocab: int, batch: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(vocab + batch)
    x = torch.randn(batch, vocab, generator=g)  # (B, vocab)
    ties = torch.zeros(batch, vocab)
    ties[:, [vocab // 3, vocab // 2, vocab - 1]] = 1.0  # the maximum in several chunks: the first one wins
    nan = x.clone()
    nan[:, [vocab - 5, 7]] = math.nan  # argmax counts NaN as largest: the first NaN
    inf = x.clone()
    inf[:, vocab // 2] = math.inf
    inf[-1:, vocab - 2] = math.nan
    wide = torch.randn(batch, 3, vocab, generator=g)[:, 1]  # a slice: rows not contiguous with each other
    return [x, ties, nan, inf, torch.full((batch, vocab), -math.inf), x.bfloat16(), wide, x.round()]  # round: many ties


@pytest.mark.parametrize("vocab", [50257, 32000, 151936, 4 * GREEDY_CHUNK, 7919, 100])  # 7919 is prime, 100 under 4 chunks
@pytest.mark.parametrize("batch", [0, 1, 5])
def test_greedy_gives_argmax_index_for_every_row(vocab, batch):
    for logits in cases(vocab, batch):
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_the_chunk_divides_the_vocab_or_there_is_none():
    assert (_chunk(50257), _chunk(32000), _chunk(151936)) == (1733, 256, 1187)  # GPT-2's 29 x 1733, Qwen's 2**7 x 1187
    assert _chunk(7919) is None and _chunk(4 * GREEDY_CHUNK - 1) is None  # a prime; under four chunks


def test_a_sampled_row_of_inf_nan_or_nothing_but_minus_inf_takes_greedys_token():
    # the softmax's limit (torch's sampler refused such a row: "probability tensor contains inf, nan"); other rows sample
    from headwise.models.generate import next_token

    logits = torch.randn(4, 10, dtype=torch.float32)
    logits[0, 5] = math.inf
    logits[1, 2] = math.nan
    logits[2] = -math.inf
    logits[3] = torch.tensor([-1e30] * 9 + [0.0])  # finite: sampled, and all its mass on token 9
    for top_k in (None, 3):
        got = next_token(logits, 1.0, top_k, torch.Generator().manual_seed(0))
        assert got.tolist() == [5, 2, 0, 9] == greedy(logits).tolist()


def test_sampling_keeps_its_distribution_for_finite_rows():
    from headwise.models.generate import next_token

    logits = torch.tensor([[0.0, math.log(3.0), -math.inf]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(logits, 1.0, None, g) for _ in range(4000)])
    assert (draws == 2).sum() == 0 and abs((draws == 1).float().mean().item() - 0.75) < 0.03
