"""The serving benchmarks on tiny shapes: the three strategies give the same tokens and the ways of
a decode step's attention the same outputs (against the float64 reference); the numbers add up."""

from __future__ import annotations

import pytest
import torch
from reference import reference_attention

from headwise.bench.models import kv_bytes
from headwise.bench.paged_attention import filled, one_call, padded, paged_attention, per_sequence
from headwise.bench.serving import (
    cache_reads,
    flops_per_token,
    gemm_floor,
    markdown,
    paged_generate,
    projections,
    request_mix,
    serving,
    static_generate,
)
from headwise.config import GPT2Config
from headwise.models import GPT2LMHeadModel
from headwise.quantize import int8_weights

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
    assert len(watch) >= max(new) - 1  # one entry a step while tokens are held
    assert all(tokens <= slots < tokens + 4 * len(prompts) for slots, tokens in watch)


def test_the_report_adds_up():
    r = serving(requests=3, prompt=(4, 20), new=(2, 6), config=TINY, block_size=4, chunk=3, decode_context=12, decode_repeats=2)
    prompts, new = request_mix(3, prompt=(4, 20), new=(2, 6), vocab=TINY.vocab_size)
    assert (r.prompt_tokens, r.new_tokens) == (sum(len(p) for p in prompts), sum(new))
    assert r.static_slots == 3 * (max(len(p) for p in prompts) + max(new))
    assert r.same_tokens == r.requests  # what the tables claim: every strategy gives the same tokens
    assert r.compiled_same_tokens == r.requests and r.compiled_s > 0
    assert r.paged_peak_tokens <= r.paged_peak_slots < r.paged_peak_tokens + 3 * 4
    assert r.paged_worst_ratio >= r.paged_peak_slots / r.paged_peak_tokens
    assert min(r.paged_s, r.chunked_s, r.one_at_a_time_s, r.static_s, r.decode_static_ms, r.decode_paged_view_ms, r.decode_paged_gather_ms) > 0
    text = markdown(r, "this machine")
    assert "| continuous batching, paged cache |" in text and "this machine" in text
    assert "Requests whose paged tokens (chunked or not) equal their one-at-a-time tokens: 3 of 3; with compile=True: 3 of 3." in text
    assert "| the same, compile=True (compiled one call where the C++ kernel is not built) |" in text
    assert (r.chunked.max_step_tokens, r.unchunked.max_step_tokens) == (3, 2048) and "| 3 |" in text
    for t in (r.chunked, r.unchunked):
        assert 0 < t.gap_median_ms <= t.gap_max_ms and t.longest_step_ms > 0
    f = r.gemm_floor
    assert f.seconds > 0 and f.rows == 2048
    tokens = r.prompt_tokens + r.new_tokens - r.requests  # through the blocks; the new ones through the head
    block_flops, head_flops = flops_per_token(GPT2LMHeadModel(TINY))
    assert f.gflops * 1e9 * f.seconds == pytest.approx(tokens * block_flops + r.new_tokens * head_flops)
    assert f"a floor under any strategy. One at a time over it: {r.one_at_a_time_s / f.seconds:.2f}x" in text
    g = r.read_floor
    assert g.gbps > 0 and g.bytes == cache_reads(prompts, new, kv_bytes(GPT2LMHeadModel(TINY))) > 0
    assert f"one at a time over it: {r.one_at_a_time_s / (f.seconds + g.seconds):.2f}x, the most batching could gain" in text


def test_the_reads_floor_counts_every_decode_tokens_keys_and_values():
    model = GPT2LMHeadModel(TINY).eval()
    C, L = TINY.n_embd, TINY.n_layer
    assert kv_bytes(model) == L * 2 * C * 4  # keys and values, every layer, float32
    assert kv_bytes(model, torch.bfloat16) == L * 2 * C * 2
    H = TINY.n_head
    assert kv_bytes(model, torch.int8) == L * 2 * H * (C // H + 4)  # 8-bit rows and their float32 scales
    # a prompt of 5 and 3 new tokens: the 2 fed back sit at positions 5 and 6 and read 6 and 7 positions; 1 new token reads none
    prompts = [torch.zeros(5, dtype=torch.long), torch.zeros(9, dtype=torch.long)]
    assert cache_reads(prompts, [3, 1], 10) == 10 * (6 + 7)


def test_the_floor_counts_every_projection_and_the_head():
    model = GPT2LMHeadModel(TINY).eval()
    C, V, L = TINY.n_embd, TINY.vocab_size, TINY.n_layer
    per_block = C * 3 * C + C * C + C * 4 * C + 4 * C * C  # c_attn, attention's c_proj, c_fc, the MLP's c_proj
    assert len(projections(model)) == 4 * L
    assert flops_per_token(model) == (2 * L * per_block, 2 * V * C)
    int8_weights(model, activations="bf16")
    assert len(projections(model)) == 4 * L and flops_per_token(model) == (2 * L * per_block, 2 * V * C)  # Int8Linear layers, the head's own
    one, two = gemm_floor(model, 0, 1, rows=8, repeats=1), gemm_floor(model, 1, 0, rows=8, repeats=1)
    assert one.seconds > 0 and two.seconds > 0


def test_a_bf16_model_serves_with_bf16_caches():
    r = serving(requests=2, prompt=(4, 12), new=(2, 4), config=TINY, block_size=4, chunk=3, decode_context=8, decode_repeats=1,
                dtype=torch.bfloat16)
    assert r.dtype == "bfloat16" and 0 <= r.same_tokens <= 2 and min(r.paged_s, r.one_at_a_time_s) > 0
    assert "new tokens, greedy), bfloat16, block_size=4" in markdown(r)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.int8])
def test_a_float32_model_serves_with_bf16_or_8_bit_caches_when_asked(cache_dtype):
    r = serving(requests=2, prompt=(4, 12), new=(2, 4), config=TINY, block_size=4, chunk=3, decode_context=8, decode_repeats=1,
                cache_dtype=cache_dtype)
    name = str(cache_dtype).removeprefix("torch.")
    assert (r.dtype, r.cache_dtype) == ("float32", name) and 0 <= r.same_tokens <= 2 and min(r.paged_s, r.one_at_a_time_s) > 0
    assert f"new tokens, greedy), float32 with {name} caches, block_size=4" in markdown(r)


@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_a_model_with_int8_weights_serves_through_its_int8_head(activations):
    r = serving(requests=2, prompt=(4, 12), new=(2, 4), config=TINY, block_size=4, chunk=3, decode_context=8, decode_repeats=1,
                int8=activations)
    assert r.int8 == activations and 0 <= r.same_tokens <= 2 and min(r.paged_s, r.one_at_a_time_s, r.static_s) > 0
    assert f"new tokens, greedy), float32, int8 weights with {activations} activations, block_size=4" in markdown(r)


def test_the_static_baselines_logits_come_from_the_models_own_head():
    """With int8 weights the model's head is an ``Int8Linear`` (``lm_head``), not the tied float embedding: the static
    batch and the one-at-a-time baseline take their logits from it, as the batcher does."""
    from headwise.quantize import int8_weights

    torch.manual_seed(1)
    model = int8_weights(GPT2LMHeadModel(TINY).eval(), activations="int8")
    prompts, new = request_mix(3, prompt=(2, 12), new=(1, 6), vocab=TINY.vocab_size, seed=4)
    alone = [static_generate(model, [p], [n])[0] for p, n in zip(prompts, new, strict=True)]
    assert alone == [model.generate(p[None], max_new_tokens=n)[0, len(p):].tolist() for p, n in zip(prompts, new, strict=True)]


def consecutive(blocks: list[int]) -> bool:
    return blocks == list(range(blocks[0], blocks[0] + len(blocks)))


def test_the_ways_of_a_decode_steps_attention_give_the_same_outputs():
    lengths = [5, 17, 33, 2, 9]
    pools = [filled(lengths, reserve=r, heads=2, head_dim=8, block_size=4, dtype=torch.float64, seed=1) for r in (True, False, True, False)]
    assert all(consecutive(pools[i].blocks(s)) for s in range(5) for i in (0, 2))  # reserved runs: read as views
    assert not consecutive(pools[1].blocks(1))  # written together without a reserve: interleaved, gathered
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))  # (1, H, N, D)
    views, gathers, padded_call = per_sequence(pools[0], q, k, v), per_sequence(pools[1], q, k, v), padded(pools[2], q, k, v)
    blocks = one_call(pools[3], q, k, v)
    for s, n in enumerate(lengths):
        slots = pools[1]._slots[s][: n + 1]
        want = reference_attention(q[:, :, s : s + 1], pools[1].k[None, :, slots], pools[1].v[None, :, slots], causal=True)
        for out in (views, gathers, padded_call, blocks):
            torch.testing.assert_close(out[:, :, s : s + 1], want, rtol=0, atol=1e-12)
    assert set(paged_attention(2, (3, 6), repeats=1)) == {"views", "gathers", "padded", "one call, views", "one call, gathers", "one call, loops"}
