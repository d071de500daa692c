"""Continuous batching of long prompts and long generations: a prompt fed in chunks of at most
max_step_tokens gives the tokens it gives alone while the running requests get a token every step;
a model whose every layer slides gives back the blocks before each window, and one that does not keeps them."""

from __future__ import annotations

import functools

import pytest
import torch
from test_batching import V, alone, collect, llama, pool_state
from test_batching import model_named as named

from headwise.models import Batcher, generate_many

M = 8  # max_step_tokens


@functools.cache
def model_named(name: str) -> torch.nn.Module:
    """The models of test_batching, and "mistral-all": every layer slides, each with a window of its own."""
    return llama(windows=(6, 4)) if name == "mistral-all" else named(name)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


SHORT = [ids(3, 1), ids(2, 2), ids(2, 3)]  # 7 prompt tokens: they join in one step and run from then on
LONG = ids(3 * M, 4)


def running(name: str, **kw) -> tuple[Batcher, dict[int, list[int]]]:
    """Three short requests running (each emitted its first token), then the long prompt submitted."""
    batcher = Batcher(model_named(name), **({"num_blocks": 40, "block_size": 4, "max_step_tokens": M} | kw))
    for p in SHORT:
        batcher.submit(p, 30)
    got: dict[int, list[int]] = {}
    collect(batcher.step(), got)
    assert sorted(got) == [0, 1, 2]
    batcher.submit(LONG, 10)
    return batcher, got


def expected(name: str) -> list[list[int]]:
    model = model_named(name)
    return [alone(model, p, 30) for p in SHORT] + [alone(model, LONG, 10)]


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa", "mistral-all"])
def test_a_prompt_of_three_steps_beside_running_requests_gives_its_tokens_alone(name):
    batcher, got = running(name)
    collect(batcher.stream(), got)
    assert [got[i] for i in range(4)] == expected(name)


def test_sampled_requests_with_a_chunked_prompt_equal_each_alone_with_its_seed():
    model = model_named("llama-gqa")
    ps = [*SHORT, LONG]
    outs = generate_many(model, ps, 12, temperature=0.8, top_k=20, seed=3, max_step_tokens=5, block_size=4)
    for i, (p, out) in enumerate(zip(ps, outs, strict=True)):
        assert out.tolist() == alone(model, p, 12, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(3 + i))


def test_no_step_feeds_more_than_max_step_tokens_prompt_tokens_and_the_running_get_a_token_each_step():
    batcher, got = running("gpt2")
    fed = []
    hook = batcher.model.register_forward_pre_hook(lambda module, args: fed.append(args[0].shape[1]))  # T of each step's row
    steps = 0
    while batcher.pending:
        decoding = [r.id for r in batcher._running if not r.prefilling]
        emitted = batcher.step()
        assert fed[-1] - len(decoding) <= M  # prompt tokens this step
        assert [i for i, _ in emitted][: len(decoding)] == decoding  # every running request got its token
        steps += 1
        if 3 in dict(emitted) and 3 not in got:
            assert steps == 3  # the long prompt took three steps of M tokens; its first token came with the last chunk
        collect(emitted, got)
    hook.remove()
    assert max(fed) == M + 3 and [got[i] for i in range(4)] == expected("gpt2")


def test_a_prompt_longer_than_the_step_alone_is_admitted_and_chunked():
    model = model_named("llama-gqa")
    (out,) = generate_many(model, [LONG], 5, max_step_tokens=5, block_size=2)
    assert out.tolist() == alone(model, LONG, 5)


@pytest.mark.parametrize("name", ["llama-gqa", "mistral-all"])
@pytest.mark.parametrize("layer", [0, 1])
def test_a_step_that_raises_mid_prefill_changes_nothing(name, layer):
    batcher, got = running(name)
    collect(batcher.step(), got)  # the long prompt's first chunk
    long = batcher._running[-1]
    assert long.id == 3 and long.fed == M

    def fail(module, args, out):
        raise RuntimeError("a failing hook")

    hook = batcher.model.model["layers"][layer].self_attn.register_forward_hook(fail)  # after this layer (and those before) wrote
    before = pool_state(batcher)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="a failing hook"):
            batcher.step()
        assert pool_state(batcher) == before and long.fed == M and batcher.pending == 4
    hook.remove()
    collect(batcher.stream(), got)
    assert [got[i] for i in range(4)] == expected(name) and batcher.blocks_held == 0


def test_a_request_cancelled_mid_prefill_gives_its_blocks_back_and_the_others_go_on():
    batcher, got = running("llama-gqa")
    held = batcher.blocks_held
    collect(batcher.step(), got)
    assert batcher._running[-1].fed == M and batcher.blocks_held > held + 1  # its first chunk holds blocks
    batcher.cancel(3)
    assert 3 not in batcher.caches[0] and batcher.blocks_held == held  # the short ones' tokens still fit their one block each
    collect(batcher.stream(), got)
    assert 3 not in got and [got[i] for i in range(3)] == expected("llama-gqa")[:3]
    assert batcher.caches[0].free_blocks == 40


# ----------------------------------------------------------------------------- sliding windows


@pytest.mark.parametrize("block_size", [1, 4])
def test_an_all_sliding_model_holds_about_its_window_and_its_tokens_equal_each_alone(block_size):
    model = model_named("mistral-all")
    ps = [ids(3, 5), ids(20, 6), ids(9, 7)]
    batcher = Batcher(model, num_blocks=40, block_size=block_size, max_step_tokens=M)
    for p in ps:
        batcher.submit(p, 60)
    got: dict[int, list[int]] = {}
    while batcher.pending:
        collect(batcher.step(), got)
        for cache in batcher.caches:
            for r in batcher._running:
                assert len(cache.blocks(r.id)) <= -(-(cache.window + block_size - 2) // block_size)  # its window and a part block
                assert cache.length(r.id) == r.fed  # positions keep counting
        assert batcher.blocks_held <= sum(r.blocks for r in batcher._running)
    assert [got[i] for i in range(3)] == [alone(model, p, 60) for p in ps]
    assert batcher.caches[0].free_blocks == 40


def test_a_model_with_one_layer_not_sliding_keeps_every_block():
    batcher = Batcher(model_named("mistral-window"), num_blocks=40, block_size=2)
    batcher.submit(ids(5, 8), 30)
    for _ in range(20):
        batcher.step()
        for cache in batcher.caches:
            assert cache.first_held(0) == 0 and len(cache.blocks(0)) == -(-cache.length(0) // 2)
    assert batcher.caches[0].length(0) == 24 and batcher._running[0].blocks == 17


def test_an_all_sliding_request_is_sized_by_its_window_not_its_length():
    model = model_named("mistral-all")
    batcher = Batcher(model, num_blocks=6, block_size=4)
    batcher.submit(ids(5, 9), 10**8)  # 10**8 tokens would need 25 million blocks of 4
    for _ in range(30):
        batcher.step()
    assert batcher.caches[0].length(0) == 34 and batcher.blocks_held <= 4
    batcher.cancel(0)
    eos = alone(model, ids(5, 9), 3)[-1]  # its third token (or an earlier one): generate_many sizes its own pool, and stops there
    (out,) = generate_many(model, [ids(5, 9)], 10**8, eos_token_id=eos)
    assert out.tolist() == alone(model, ids(5, 9), 3, eos_token_id=eos)
