"""``generate`` over random batches: rows of random lengths left-padded together, some with an eos they
emit, through every cache dtype a float32 model takes, for every model family: each row's tokens are
that row generated alone (a row that emitted eos padded with it). Each case is one seed."""

from __future__ import annotations

import random

import pytest
import torch
from test_batching import V
from test_batching_fuzz import NAMES, model

PRECISIONS = [(torch.float64, None), (torch.float32, None), (torch.float32, torch.bfloat16), (torch.float32, torch.int8)]


def run(seed: int) -> None:
    rng = random.Random(seed)
    name, (dtype, cache_dtype) = rng.choice(NAMES), rng.choice(PRECISIONS)
    m = model(name, dtype)
    prompts = [[rng.randrange(V) for _ in range(rng.randint(1, 24))] for _ in range(rng.randint(1, 5))]
    n = rng.randint(1, 12)
    alone = [m.generate(torch.tensor([p]), max_new_tokens=n, cache_dtype=cache_dtype)[0, len(p):].tolist() for p in prompts]
    eos = rng.choice(rng.choice(alone)) if rng.random() < 0.5 else None  # a token some row emits
    if eos is not None:
        alone = [m.generate(torch.tensor([p]), max_new_tokens=n, cache_dtype=cache_dtype, eos_token_id=eos)[0, len(p):].tolist() for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # (B, width), padded on the left
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # (B, width)
    out = m.generate(ids, attention_mask=mask, max_new_tokens=n, cache_dtype=cache_dtype, eos_token_id=eos)[:, width:]  # (B, <= n)
    where = f"{name} {dtype} cache {cache_dtype} lengths {list(map(len, prompts))} new {n} eos {eos}"
    for row, want in zip(out.tolist(), alone, strict=True):
        # alone, a row stops at its eos (or pads with it); in a batch it pads with eos until every row is done
        got = row[: len(want)]
        assert got == want, where
        assert all(t == eos for t in row[len(want):]), where


@pytest.mark.parametrize("seed", range(60))
def test_a_random_padded_batch_gives_each_row_its_tokens_alone(seed):
    run(seed)
