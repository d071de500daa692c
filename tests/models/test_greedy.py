"""``headwise.models.generate.greedy``: the index ``argmax`` gives, by headwise's op (``models/greedy.cpp``) where its
library is loaded, else found a chunk at a time on the CPU."""

import math

import pytest
import torch

from headwise import native
from headwise.models import generate
from headwise.models.generate import GREEDY_CHUNK, _chunk, greedy


@pytest.fixture(params=["op", "chunks"])
def path(request, monkeypatch):
    """Each way greedy finds its index: the op (``greedy_by_chunks`` made to fail, so that nothing falls back to it), or
    the chunks (the library taken for not loaded)."""
    if request.param == "op":
        if not native.built():
            pytest.skip("headwise's C++ library could not be built here")

        def no_chunks(logits):
            raise AssertionError("greedy fell back to its chunks")

        monkeypatch.setattr(generate, "greedy_by_chunks", no_chunks)
    else:
        monkeypatch.setattr(native, "loaded", lambda: False)
    return request.param


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
    zeros = torch.zeros(batch, vocab)
    zeros[:, ::3] = -0.0  # -0.0 and 0.0 are equal: the first of them
    last = x.clone()
    last[:, -1] = 100.0  # the largest after the last full vector of 16 (or 64)
    later_tie = x.clone()
    later_tie[:, [1, vocab - 1]] = 100.0  # the same largest in another lane and another pass: the first
    return [x, ties, nan, inf, torch.full((batch, vocab), -math.inf), x.bfloat16(), wide, x.round(), zeros, last, later_tie]


@pytest.mark.parametrize("vocab", [50257, 32000, 151936, 4 * GREEDY_CHUNK, 7919, 100, 17, 63, 65])  # 7919 is prime, 100 under 4 chunks
@pytest.mark.parametrize("batch", [0, 1, 5, 9])
def test_greedy_gives_argmax_index_for_every_row(vocab, batch, path):
    for logits in cases(vocab, batch):
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 2, 15])
def test_greedy_of_fewer_logits_than_a_vector(vocab, path):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g)
    nan = x.clone()
    nan[1:, -1] = math.nan
    for logits in (x, x.round(), torch.zeros(4, vocab), nan, torch.full((4, vocab), -math.inf), x.bfloat16()):
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))


def test_rows_the_op_does_not_read_take_the_chunks_or_argmax(monkeypatch):
    """float16 or float64 logits, rows not contiguous within, logits that require grad: the chunks (or torch's argmax)."""
    calls = []
    monkeypatch.setattr(torch.ops.headwise, "greedy", lambda logits: calls.append(logits), raising=False)
    x = torch.randn(3, 50257)
    for logits in (x.half(), x.double(), torch.randn(3, 2 * 50257)[:, ::2], x.clone().requires_grad_()):
        assert torch.equal(greedy(logits), logits.argmax(dim=-1))
    assert calls == []


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
