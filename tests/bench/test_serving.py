"""The serving benchmark on a tiny model: its three strategies give the same tokens, its numbers add up."""

from __future__ import annotations

import torch

from headwise.bench.serving import markdown, paged_generate, request_mix, serving, static_generate
from headwise.config import GPT2Config
from headwise.models import GPT2LMHeadModel

TINY = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4)


def test_the_three_strategies_give_the_same_tokens():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(TINY).double().eval()
    prompts, new = request_mix(5, prompt=(2, 20), new=(1, 9), vocab=TINY.vocab_size, seed=3)
    alone = [static_generate(model, [p], [n])[0] for p, n in zip(prompts, new, strict=True)]
    assert [len(a) for a in alone] == new
    assert static_generate(model, prompts, new) == alone  # left-padded batch
    watch: list = []
    assert paged_generate(model, prompts, new, block_size=4, watch=watch) == alone
    assert all(tokens <= slots < tokens + 4 * len(prompts) for slots, tokens in watch)


def test_the_report_adds_up():
    r = serving(requests=3, prompt=(4, 20), new=(2, 6), config=TINY, block_size=4, decode_context=12, decode_repeats=2)
    prompts, new = request_mix(3, prompt=(4, 20), new=(2, 6), vocab=TINY.vocab_size)
    assert (r.prompt_tokens, r.new_tokens) == (sum(len(p) for p in prompts), sum(new))
    assert r.static_slots == 3 * (max(len(p) for p in prompts) + max(new))
    assert r.paged_peak_tokens <= r.paged_peak_slots < r.paged_peak_tokens + 3 * 4
    assert min(r.paged_s, r.one_at_a_time_s, r.static_s, r.decode_static_ms, r.decode_paged_gather_ms) > 0
    text = markdown(r, "this machine")
    assert "| continuous batching, paged cache |" in text and "this machine" in text
