"""Continuous batching: every request's tokens equal that request generated alone (greedy, and
sampled with its seed), for GPT-2 and the Llama family, whatever joins or leaves around it."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

import headwise as hw
from headwise.backends.paged import attend
from headwise.cache import PagedBatch
from headwise.models import Batcher, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, generate_many
from headwise.models.native_layer import NativeLayer

V = 61


def scaled(model: torch.nn.Module) -> torch.nn.Module:
    """Float64, eval, weights scaled up so that greedy choices are clear-cut (a small init gives near-uniform logits)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.4 if ("wte" in name or "wpe" in name or "embed" in name or "lm_head" in name) else 0.15)
            else:
                p.uniform_(0.5, 1.5) if "norm" in name or "ln" in name else p.normal_(0.0, 0.1)
    return model.double().eval()


def gpt2() -> GPT2LMHeadModel:
    return scaled(GPT2LMHeadModel(hw.GPT2Config(vocab_size=V, n_positions=96, n_embd=32, n_layer=2, n_head=4)))


def llama(**kw) -> LlamaForCausalLM:
    base = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 96}
    return scaled(LlamaForCausalLM(LlamaConfig(**(base | kw))))


MAKERS = {
    "gpt2": gpt2,
    "llama-gqa": llama,
    "mistral-window": lambda: llama(windows=(4, None)),
    "qwen3-qknorm": lambda: llama(qk_norm=True, head_dim=16, tie_word_embeddings=True),
}

@functools.cache
def model_named(name: str) -> torch.nn.Module:
    return MAKERS[name]()


@functools.cache
def greedy_alone(name: str, seed: int) -> tuple[list[int], ...]:
    model = model_named(name)
    return tuple(alone(model, p, n) for p, n in zip(prompts(seed), NEW, strict=True))


LENGTHS = [3, 17, 1, 40, 9, 25, 5]
NEW = [6, 12, 3, 9, 20, 1, 15]


def prompts(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]


def alone(model, prompt, n, **kw) -> list[int]:
    return model.generate(prompt[None], max_new_tokens=n, **kw)[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("block_size,num_blocks,max_step_tokens", [(1, 90, 30), (16, 8, 2048), (128, 3, 64)])
def test_greedy_requests_equal_each_generated_alone(name, block_size, num_blocks, max_step_tokens):
    outs = generate_many(model_named(name), prompts(), NEW, block_size=block_size, num_blocks=num_blocks, max_step_tokens=max_step_tokens)
    assert [out.tolist() for out in outs] == list(greedy_alone(name, 0))


@pytest.mark.parametrize("name", MAKERS)
def test_requests_over_bfloat16_pools_with_the_next_tokens_in_one_call_equal_each_generated_alone(name, monkeypatch):
    import headwise.functional as functional

    calls = []
    monkeypatch.setattr(functional, "attend_rows", lambda *a, **kw: calls.append(a[0].shape[0]) or attend(*a, **kw))
    model = copy.deepcopy(model_named(name)).float()
    got = generate_many(model, prompts(2), NEW, block_size=4, max_step_tokens=16, cache_dtype=torch.bfloat16, compile=True)
    for out, prompt, n in zip(got, prompts(2), NEW, strict=True):
        assert out.tolist() == alone(model, prompt, n, cache_dtype=torch.bfloat16)
    assert calls and max(calls) >= 3  # the one call ran, for several requests at once


@pytest.mark.parametrize("name", MAKERS)
def test_float32_requests_over_bfloat16_pools_equal_each_generated_alone_over_a_bfloat16_cache(name):
    model = copy.deepcopy(model_named(name)).float()
    got = generate_many(model, prompts(2), NEW, block_size=4, max_step_tokens=16, cache_dtype=torch.bfloat16)
    for out, prompt, n in zip(got, prompts(2), NEW, strict=True):
        assert out.tolist() == alone(model, prompt, n, cache_dtype=torch.bfloat16)
    assert Batcher(model, num_blocks=4, cache_dtype=torch.bfloat16).caches[0].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_sampled_requests_equal_each_generated_alone_with_its_seed(name):
    model = model_named(name)
    ps = prompts(1)
    outs = generate_many(model, ps, NEW, temperature=0.8, top_k=20, seed=7, num_blocks=12)
    for i, (p, n, out) in enumerate(zip(ps, NEW, outs, strict=True)):
        assert out.tolist() == alone(model, p, n, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(7 + i))


def test_eos_ends_a_request_and_its_blocks_go_back():
    model = model_named("gpt2")
    ps = prompts(2)
    eos = greedy_alone("gpt2", 2)[4][3]  # a token request 4 emits fourth: it stops there (or earlier)
    outs = generate_many(model, ps, NEW, eos_token_id=eos, block_size=4)
    for p, n, out in zip(ps, NEW, outs, strict=True):
        assert out.tolist() == alone(model, p, n, eos_token_id=eos)
    assert len(outs[4]) <= 4 and outs[4][-1] == eos


def test_stream_takes_requests_that_arrive_later_and_frees_the_finished():
    model = model_named("llama-gqa")
    ps = prompts(3)
    batcher = Batcher(model, num_blocks=10, block_size=8)
    first = [batcher.submit(p, n) for p, n in zip(ps[:3], NEW[:3], strict=True)]
    got: dict[int, list[int]] = {}
    running_counts, held = [], []
    for step in range(200):
        if step == 2:  # two more arrive while the first ones run
            late = [batcher.submit(p, n) for p, n in zip(ps[3:5], NEW[3:5], strict=True)]
        if not batcher.pending:
            break
        emitted = batcher.step()
        if step == 1:  # the first three joined a fresh pool: each one's worst case was set aside as one run of blocks
            for table in (batcher.caches[0].blocks(i) for i in first):
                assert table == list(range(table[0], table[0] + len(table)))
        running_counts.append(len(emitted))
        held.append((batcher.blocks_held, batcher.tokens_held))
        for request, token in emitted:
            got.setdefault(request, []).append(token)
    assert first == [0, 1, 2] and late == [3, 4]
    assert [got[i] for i in range(5)] == list(greedy_alone("llama-gqa", 3)[:5])
    assert max(running_counts) < 5  # the pool (10 blocks of 8) never held all five at once: some waited
    for blocks, tokens in held:
        assert tokens <= blocks * 8 < tokens + 8 * 5  # at most one part-filled block per running request
    assert batcher.blocks_held == 0 and batcher.caches[0].free_blocks == 10


def test_generate_many_streams_the_same_tokens():
    model = model_named("gpt2")
    ps = prompts(4)
    batcher = Batcher(model, num_blocks=30, block_size=4)
    for p, n in zip(ps, NEW, strict=True):
        batcher.submit(p, n)
    streamed: dict[int, list[int]] = {}
    for request, token in batcher.stream():
        streamed.setdefault(request, []).append(token)
    outs = generate_many(model, ps, NEW, block_size=4)
    assert [streamed[i] for i in range(len(ps))] == [o.tolist() for o in outs]


def test_bad_requests():
    model = model_named("gpt2")
    batcher = Batcher(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"prompt must be a 1-D tensor of token ids \(T,\), got \(1, 3\)"):
        batcher.submit(torch.tensor([[1, 2, 3]]), 2)
    with pytest.raises(TypeError, match=r"prompt must be a 1-D tensor of token ids \(T,\), got list"):
        batcher.submit([1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"prompt must hold ids in \[0, vocab_size=61\), got ids from 1 to 99"):
        batcher.submit(torch.tensor([1, 99]), 2)
    with pytest.raises(ValueError, match=r"prompt must hold at least one token id, got an empty tensor of shape \(0,\)"):
        batcher.submit(torch.tensor([], dtype=torch.long), 2)
    with pytest.raises(ValueError, match=r"max_new_tokens must be a positive int"):
        batcher.submit(torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match=r"needs 5 blocks of 4, more than the pool's num_blocks=4"):
        batcher.submit(torch.tensor([1] * 10), 11)
    with pytest.raises(ValueError, match=r"prompt \(90 tokens\) \+ max_new_tokens \(10\) exceeds n_positions=96"):
        batcher.submit(torch.tensor([1] * 90), 10)
    with pytest.raises(ValueError, match=r"seed \(or None\) must be an int in \[0, 18446744073709551615\], got -1"):
        batcher.submit(torch.tensor([1, 2]), 2, temperature=1.0, seed=-1)
    with pytest.raises(ValueError, match=r"seed \(or None\) must be an int in \[0, 18446744073709551615\], got 18446744073709551616"):
        batcher.submit(torch.tensor([1, 2]), 2, temperature=1.0, seed=2**64)
    assert batcher.pending == 0
    with pytest.raises(ValueError, match=r"max_new_tokens must be an int or one int per prompt \(2\), got 3 values"):
        generate_many(model, [torch.tensor([1]), torch.tensor([2])], [1, 2, 3])
    with pytest.raises(ValueError, match=r"prompts must hold at least one"):
        generate_many(model, [], 3)
    with pytest.raises(ValueError, match=r"prompts must be a list of 1-D tensors .* got a tensor of shape \(3,\): pass \[prompt\] for one prompt"):
        generate_many(model, torch.tensor([1, 2, 3]), 3)  # its ids were each refused as a prompt of shape ()
    for bad in (None, 3.0, True):  # "'NoneType' object is not iterable" before
        with pytest.raises(TypeError, match=rf"max_new_tokens must be an int or a list of ints, one per prompt \(2\), got {type(bad).__name__}"):
            generate_many(model, [torch.tensor([1]), torch.tensor([2])], bad)
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt \(2 tokens\) \+ max_new_tokens \(100000000\) exceeds n_positions=96"):
        generate_many(model, [torch.tensor([1, 2])], 10**8)  # refused before a pool is allocated for it
    with pytest.raises(ValueError, match=r"prompts\[2\]: prompt must hold at least one token id, got an empty tensor of shape \(0,\)"):
        generate_many(model, [torch.tensor([1]), torch.tensor([2]), torch.tensor([], dtype=torch.long)], 2)  # the one at fault named
    with pytest.raises(TypeError, match=r"prompts\[1\]: prompt must hold integer token ids"):
        generate_many(model, [torch.tensor([1]), torch.tensor([2.0])], 2)
    with pytest.raises(ValueError, match=r"seed \(or None; request i samples with seed \+ i, 2 requests\) must be an int in \[0, 18446744073709551614\]"):
        generate_many(model, [torch.tensor([1]), torch.tensor([2])], 2, temperature=1.0, seed=2**64 - 1)
    with pytest.raises(TypeError, match=r"model must be a causal LM of headwise.models with new_paged_caches"):
        Batcher(torch.nn.Linear(2, 2), num_blocks=4)
    with pytest.raises(TypeError, match=r"model must be a causal LM of headwise.models with new_paged_caches"):
        generate_many(torch.nn.Linear(2, 2), [torch.tensor([1])], 2)  # an AttributeError on vocab_size before
    for kw, message in [({"temperature": -1}, r"^temperature \(0 = greedy\) must be"), ({"eos_token_id": 10**6}, r"^eos_token_id \(or None\) must be")]:
        with pytest.raises(ValueError, match=message):  # every request's: not blamed on prompts[0]
            generate_many(model, [torch.tensor([1]), torch.tensor([2])], 2, **kw)
    with pytest.raises(ValueError, match=r"num_blocks must be a positive int"):
        Batcher(model, num_blocks=0)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: a request of 10 \+ 11 tokens needs 5 blocks of 4, more than the pool's num_blocks=4"):
        generate_many(model, [torch.tensor([1, 2]), torch.tensor([1] * 10)], [2, 11], num_blocks=4, block_size=4)  # before a pool is made


# ----------------------------------------------------------------------------- failures: nothing is lost


def collect(pairs, got: dict[int, list[int]]) -> None:
    for request, token in pairs:
        got.setdefault(request, []).append(token)


def submitted(name: str, seed: int = 5, **kw) -> Batcher:
    batcher = Batcher(model_named(name), **({"num_blocks": 12, "block_size": 8} | kw))
    for p, n in zip(prompts(seed), NEW, strict=True):
        batcher.submit(p, n)
    return batcher


def pool_state(batcher: Batcher) -> list:
    return [(c.free_blocks, {s: (c.length(s), c.blocks(s)) for s in c.sequences}, dict(c._set_aside)) for c in batcher.caches]


def test_a_stream_stopped_mid_step_and_resumed_loses_no_token():
    batcher, got = submitted("gpt2"), {}
    for stop in (2, 1, 3, 5):  # stop the loop after a few tokens, in the middle of a step's tokens, several times
        stream = batcher.stream()
        for _ in range(stop):
            collect([next(stream)], got)
        stream.close()
    collect(batcher.stream(), got)
    assert [got[i] for i in range(len(NEW))] == list(greedy_alone("gpt2", 5))


def test_a_step_after_a_stopped_stream_hands_over_its_unread_tokens_first():
    """Tokens a stopped ``stream()`` did not yield come first from ``step()`` too: mixing the two hands every token
    over once, in order."""
    batcher, got = submitted("gpt2"), {}
    stream = batcher.stream()
    collect([next(stream), next(stream)], got)
    stream.close()
    assert batcher._unread  # the first step's tokens but two
    collect(batcher.step(), got)
    assert not batcher._unread
    collect(batcher.stream(), got)
    assert [got[i] for i in range(len(NEW))] == list(greedy_alone("gpt2", 5))


@pytest.mark.parametrize("name", ["gpt2", "mistral-window"])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("at", [0, 3])  # the first step (everyone joining), a later one (requests running and joining)
def test_a_step_that_raises_at_a_layer_changes_nothing(name, layer, at):
    batcher, got = submitted(name), {}
    model = batcher.model
    attn = model.transformer.h[layer].attn if name == "gpt2" else model.model["layers"][layer].self_attn
    for _ in range(at):
        collect(batcher.step(), got)

    def fail(module, args, out):
        raise RuntimeError("a failing hook")

    handle = attn.register_forward_hook(fail)  # raises after this layer (and those before it) wrote their keys
    before, pending, waiting = pool_state(batcher), batcher.pending, len(batcher._waiting)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="a failing hook"):
            batcher.step()
        assert pool_state(batcher) == before and batcher.pending == pending and len(batcher._waiting) == waiting
    handle.remove()
    collect(batcher.stream(), got)
    assert [got[i] for i in range(len(NEW))] == list(greedy_alone(name, 5))
    assert batcher.blocks_held == 0


def test_a_model_whose_dtype_changed_is_refused_and_its_requests_keep_no_blocks():
    batcher, got = submitted("gpt2"), {}
    batcher.model = model = copy.deepcopy(batcher.model)
    collect(batcher.step(), got)
    before, pending = pool_state(batcher), batcher.pending
    model.float()
    with pytest.raises(TypeError, match=r"the model now computes in torch.float32 on cpu, but this Batcher's caches were made for torch.float64"):
        batcher.step()
    assert pool_state(batcher) == before and batcher.pending == pending
    for request in {r.id for r in [*batcher._running, *batcher._waiting]}:
        batcher.cancel(request)
    assert batcher.pending == 0 and batcher.caches[0].free_blocks == 12


def test_a_cancelled_request_stops_and_the_others_go_on():
    batcher, got = submitted("llama-gqa", seed=6, num_blocks=10), {}
    collect(batcher.step(), got)
    running, waiting = batcher._running[0].id, batcher._waiting[-1].id
    batcher.cancel(running)
    batcher.cancel(waiting)
    with pytest.raises(ValueError, match=rf"request {running} is not pending \(finished, cancelled or never submitted\); pending: \["):
        batcher.cancel(running)
    with pytest.raises(ValueError, match=r"request 99 is not pending"):
        batcher.cancel(99)
    stream = batcher.stream()
    collect([next(stream)], got)
    unread = {request for request, _ in batcher._unread}
    for request in unread:  # cancelled with tokens computed but not yielded yet: none of them comes
        batcher.cancel(request)
    collect(stream, got)
    alone = greedy_alone_with("llama-gqa", 6)
    assert waiting not in got
    for request, tokens in got.items():
        stopped = request == running or request in unread
        assert tokens == alone[request][: len(tokens)] if stopped else tokens == alone[request]
    assert len(got[running]) == 1 and batcher.blocks_held == 0 and batcher.caches[0].free_blocks == 10


def greedy_alone_with(name: str, seed: int) -> list[list[int]]:
    return list(greedy_alone(name, seed))


# ----------------------------------------------------------------------------- cancel while a step runs


@pytest.mark.parametrize("which", ["joining", "running", "streamed"])
def test_a_cancel_made_while_a_step_runs_takes_effect_when_it_ends(which):
    """A hook (or a callback) cancels a request in the middle of a step: the step ends as it would have, the request is
    then cancelled, and every other request's tokens are those it gets alone (through ``step`` or ``stream``, none of
    that step's lost); no block is kept."""
    model = model_named("gpt2")
    ps = prompts(3)[:4]
    batcher = Batcher(model, num_blocks=12, block_size=4)
    ids = [batcher.submit(p, 5) for p in ps]
    got: dict[int, list[int]] = {}
    if which == "running":
        collect(batcher.step(), got)  # every request running from the next step on
    calls = []

    def hook(module, args, out):
        calls.append(1)
        if len(calls) == (2 if which == "streamed" else 1):  # streamed: in its second step, with every request running
            batcher.cancel(ids[1])

    handle = model.attention_layers()[0].register_forward_hook(hook)
    try:
        step = list(batcher.stream()) if which == "streamed" else batcher.step()
    finally:
        handle.remove()
    collect(step, got)
    collect(list(batcher.stream()), got)
    assert got.get(ids[1], []) == alone(model, ps[1], 5)[: 1 if which != "joining" else 0]  # the token of its step before, if one ran
    for i in (0, 2, 3):
        assert got[ids[i]] == alone(model, ps[i], 5)
    assert batcher.pending == 0 and batcher.caches[0].free_blocks == 12
    with pytest.raises(ValueError, match=r"request 1 is not pending"):
        batcher.cancel(ids[1])


def test_cancel_takes_an_id_not_a_bool():
    batcher = Batcher(model_named("gpt2"), num_blocks=4, block_size=4)
    batcher.submit(torch.tensor([1, 2]), 2)
    batcher.submit(torch.tensor([3, 4]), 2)
    with pytest.raises(TypeError, match=r"request must be a request id \(an int from submit\), got bool True"):
        batcher.cancel(True)  # request 1 was cancelled before
    assert batcher.pending == 2
    batcher.cancel(np.int64(1))  # an id read back from an array
    assert batcher.pending == 1


def test_unseeded_sampling_repeats_under_torch_manual_seed():
    model = model_named("gpt2")
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(generate_many(model, prompts(1)[:3], 6, temperature=1.0))
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_a_step_called_inside_a_step_is_refused_and_the_requests_go_on_as_alone():
    """``step`` from a hook inside a step: a RuntimeError, the outer step rolled back; the tokens are still each
    request's own (an inner step that ran used to commit under the outer one, whose roll-back then cut the caches
    under it: later tokens silently wrong)."""
    model = model_named("llama-gqa")
    batcher = Batcher(model, num_blocks=16, block_size=4)
    for p, n in zip(prompts()[:2], NEW[:2], strict=True):
        batcher.submit(p, n)
    out: dict[int, list[int]] = {}
    for request, token in batcher.step():
        out.setdefault(request, []).append(token)
    inner = []
    hook = model.attention_layers()[0].register_forward_pre_hook(lambda module, args: inner.append(batcher.step()) if not inner else None)
    try:
        with pytest.raises(RuntimeError, match="while a step is running"):
            batcher.step()
    finally:
        hook.remove()
    assert all(batcher.caches[0].length(r.id) == r.fed for r in batcher._running)
    for request, token in batcher.stream():
        out.setdefault(request, []).append(token)
    assert [out[i] for i in range(2)] == list(greedy_alone("llama-gqa", 0)[:2])


def test_blocks_and_tokens_held_are_the_fullest_layers():
    """A model whose layers slide by different windows: the pools hold different counts; the Batcher reports the
    fullest (it read layer 0's)."""
    model = llama(windows=(3, 12))
    batcher = Batcher(model, num_blocks=32, block_size=2)
    batcher.submit(torch.arange(1, 20), 10)
    batcher.step()
    blocks = [c.num_blocks - c.free_blocks for c in batcher.caches]
    tokens = [c.length(0) - c.first_held(0) for c in batcher.caches]
    assert blocks[0] < blocks[1] and (batcher.blocks_held, batcher.tokens_held) == (max(blocks), max(tokens))


def test_a_batcher_made_under_inference_mode_serves_outside_it():
    """Pools made under ``torch.inference_mode`` (a server's start-up, another thread) take the steps' writes outside it
    (torch refused an in-place write to an inference tensor there)."""
    model = model_named("gpt2")
    with torch.inference_mode():
        batcher = Batcher(model, num_blocks=16, block_size=4)
    batcher.submit(prompts()[0], NEW[0])
    assert [token for _, token in batcher.stream()] == greedy_alone("gpt2", 0)[0]
    with torch.inference_mode():  # a request taken there (17 tokens: slot maps of 32): its slot maps are written outside it
        batcher.submit(prompts()[1], NEW[1])
        batcher.step()
    assert [token for _, token in batcher.stream()] == greedy_alone("gpt2", 0)[1][1:]


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_requests_of_an_int8_weight_model_equal_each_generated_alone_where_prompts_are_fed_whole(name, activations):
    """``int8_weights``: its projections round their input rows to bfloat16 or 8 bits, so a prompt fed in chunks may
    round otherwise than fed whole (serving.md); fed whole, beside running requests, each request's tokens are its own."""
    from headwise.quantize import int8_weights

    model = int8_weights(copy.deepcopy(model_named(name)), activations=activations)
    got = generate_many(model, prompts(4), NEW, block_size=4)  # max_step_tokens 2048: every prompt in one step
    for out, prompt, n in zip(got, prompts(4), NEW, strict=True):
        assert out.tolist() == alone(model, prompt, n)


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_requests_over_8_bit_pools_equal_each_generated_alone_over_an_8_bit_cache(name, dtype, monkeypatch):
    """Pools of 8-bit rows (``cache_dtype=torch.int8``) under a float32 or a bfloat16 model: every request's tokens are
    those of ``generate`` over an 8-bit ``KVCache``, whose rows round the same keys the same way; the running requests'
    next tokens in one call."""
    import headwise.functional as functional

    calls, write_rows = [], PagedBatch.write_rows_unchecked
    monkeypatch.setattr(functional, "attend_rows", lambda *a, **kw: calls.append(a[0].shape[0]) or attend(*a, **kw))
    monkeypatch.setattr(PagedBatch, "write_rows_unchecked", lambda batch, run: calls.append(len(batch.seq_ids)) or write_rows(batch, run))
    model = copy.deepcopy(model_named(name)).to(dtype)
    got = generate_many(model, prompts(3), NEW, block_size=4, max_step_tokens=16, cache_dtype=torch.int8)
    for out, prompt, n in zip(got, prompts(3), NEW, strict=True):
        assert out.tolist() == alone(model, prompt, n, cache_dtype=torch.int8)
    batcher = Batcher(model, num_blocks=4, cache_dtype=torch.int8)
    assert batcher.caches[0].k.dtype == torch.int8 and batcher.caches[0].dtype == torch.float32
    from headwise.backends import decode_kernel

    assert not decode_kernel.available() or (calls and max(calls) >= 3)  # the one call ran, for several requests at once


@pytest.mark.parametrize("name", MAKERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_in_the_layers_c_ops_give_the_tokens_of_each_request_alone(name, dtype, monkeypatch):
    """A float32 or bfloat16 model's decode steps where the C++ kernels are built: each layer's attention (the pool's
    write, the one call over it, the merge) in one op (``paged_kernel_call``), from the second step the whole layer in
    one (``decode_layer``; not for qk-norm, which has none); every request's tokens are ``generate``'s."""
    from headwise.backends import decode_kernel

    if not decode_kernel.available():
        pytest.skip("the C++ kernels are not built here")
    by_op, native, write_rows, call_native = [], [], PagedBatch.write_rows_unchecked, NativeLayer.__call__
    monkeypatch.setattr(PagedBatch, "write_rows_unchecked", lambda batch, run: by_op.append(len(batch.seq_ids)) or write_rows(batch, run))
    monkeypatch.setattr(NativeLayer, "__call__", lambda layer, *a: native.append(out := call_native(layer, *a)) or out)
    model = copy.deepcopy(model_named(name)).to(dtype)
    got = generate_many(model, prompts(3), NEW, block_size=4, max_step_tokens=16)
    for out, prompt, n in zip(got, prompts(3), NEW, strict=True):
        assert out.tolist() == alone(model, prompt, n)
    assert by_op and max(by_op) >= 3  # several requests' steps in one op a layer
    assert (not native) if name == "qwen3-qknorm" else (native and all(out is not None for out in native))


def float32_decoding() -> tuple[GPT2LMHeadModel, Batcher, dict[int, list[int]]]:
    """A float32 GPT-2's Batcher whose requests all decode (the layers' C++ ops apply), and the tokens it gave so far."""
    from headwise.backends import decode_kernel

    if not decode_kernel.available():
        pytest.skip("the C++ kernels are not built here")
    model = gpt2().float()
    batcher, got = Batcher(model, num_blocks=12, block_size=8), {}
    for p, n in zip(prompts(5), NEW, strict=True):
        batcher.submit(p, n)
    decode_only(batcher)
    return model, batcher, got


def assert_the_rest_alone(model, got: dict[int, list[int]]) -> None:
    """The tokens ``got`` (from some step on) are the last ones each request of ``prompts(5)`` gets alone."""
    want = [alone(model, p, n) for p, n in zip(prompts(5), NEW, strict=True)]
    assert [got.get(i, []) for i in range(len(NEW))] == [w[len(w) - len(got.get(i, [])):] for i, w in enumerate(want)]


def test_a_backend_set_between_decode_steps_is_followed_from_the_next_step(monkeypatch):
    """The flat step and its layers' ops are kept across steps: a layer's ``backend`` set between steps takes that layer
    off its op (its one call is "auto"'s), and back when set back, after one checked step (the step after any change:
    no op); the tokens stay each request's alone."""
    model, batcher, got = float32_decoding()
    by_op, write_rows = [], PagedBatch.write_rows_unchecked
    monkeypatch.setattr(PagedBatch, "write_rows_unchecked", lambda batch, run: by_op.append(batch.cache) or write_rows(batch, run))
    attn = model.transformer.h[0].attn
    for backend, ops in (("auto", 2), ("auto", 2), ("math", 0), ("math", 1), ("math", 1), ("auto", 0), ("auto", 2)):
        attn.backend = backend
        by_op.clear()
        collect(batcher.step(), got)
        assert len(by_op) == ops and (ops == 2 or batcher.caches[0] not in by_op)
    collect(batcher.stream(), got)
    assert_the_rest_alone(model, got)


def test_a_decode_step_whose_layer_op_raises_after_taking_blocks_changes_nothing(monkeypatch):
    """A float32 model's decode step in the layers' C++ ops: the second layer's op raising after its pool took the
    blocks and counted the tokens (the first layer's pool written) leaves every pool and request as it was; the next
    steps give the tokens of each request alone."""
    model, batcher, got = float32_decoding()
    for _ in range(2):  # the first decode step decides each layer's op, the second runs them
        collect(batcher.step(), got)
    calls, write_rows = [], PagedBatch.write_rows_unchecked

    def failing(batch, run):
        calls.append(batch)
        if len(calls) == 2:
            batch._place()
            raise RuntimeError("a failing op")
        return write_rows(batch, run)

    monkeypatch.setattr(PagedBatch, "write_rows_unchecked", failing)
    before, pending = pool_state(batcher), batcher.pending
    with pytest.raises(RuntimeError, match="a failing op"):
        batcher.step()
    assert len(calls) == 2 and pool_state(batcher) == before and batcher.pending == pending
    monkeypatch.setattr(PagedBatch, "write_rows_unchecked", write_rows)
    collect(batcher.stream(), got)
    assert_the_rest_alone(model, got)


def decode_only(batcher: Batcher) -> None:
    """Step until every running request has its prompt in and none waits: the steps after feed one token a request."""
    while batcher._waiting or any(r.prefilling for r in batcher._running):
        batcher.step()


@pytest.mark.parametrize("name", MAKERS)
def test_decode_steps_run_flat_with_the_tokens_of_each_request_alone(name, monkeypatch):
    from headwise.models.flat_step import FlatStep

    calls, logits = [], FlatStep.logits
    monkeypatch.setattr(FlatStep, "logits", lambda self, *a: calls.append(a[0].shape) or logits(self, *a))
    outs = generate_many(model_named(name), prompts(), NEW, block_size=8, num_blocks=12)
    assert [out.tolist() for out in outs] == list(greedy_alone(name, 0))
    assert calls and all(shape[0] == 1 for shape in calls)  # the decode steps took the flat step


def test_a_flat_decode_step_that_raises_at_a_layer_changes_nothing():
    model = gpt2()  # its own: a part is patched
    batcher, got = Batcher(model, num_blocks=12, block_size=8), {}
    for p, n in zip(prompts(5), NEW, strict=True):
        batcher.submit(p, n)
    decode_only(batcher)
    collect(batcher.step(), got)
    mlp = model.transformer.h[1].mlp

    def fail(x):
        raise RuntimeError("a failing part")

    mlp.forward = fail  # no hook: the step runs flat, and the layer before has written its keys when this raises
    before, pending = pool_state(batcher), batcher.pending
    with pytest.raises(RuntimeError, match="a failing part"):
        batcher.step()
    assert pool_state(batcher) == before and batcher.pending == pending
    del mlp.forward
    assert not batcher._waiting  # (what decode_only gave: the remaining steps are decode steps, flat again)
    collect(batcher.stream(), got)
    assert_the_rest_alone(model, got)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_a_part_replaced_between_decode_steps_is_used_from_the_next_step(name, monkeypatch):
    """The flat step is made at each step: an MLP replaced mid-run gives the next steps the tokens the forward gives."""
    runs = []
    for flat in (True, False):
        model = MAKERS[name]()
        if not flat:
            monkeypatch.setattr(Batcher, "_flat", lambda self: None)
        batcher, got = Batcher(model, num_blocks=12, block_size=8), {}
        for p, n in zip(prompts(5), NEW, strict=True):
            batcher.submit(p, n)
        decode_only(batcher)
        collect(batcher.step(), got)
        block = model.transformer.h[0] if name == "gpt2" else model.model["layers"][0]
        new = copy.deepcopy(block.mlp)
        with torch.no_grad():
            for p in new.parameters():
                p.mul_(-2.0)
        block.mlp = new
        collect(batcher.stream(), got)
        runs.append(got)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("window", [2, 8])
@torch.no_grad()
def test_a_window_set_between_steps_against_sliding_pools_is_refused_as_the_checked_forward_refuses_it(window):
    """Every layer sliding (pools that give back the blocks before a window of 4): a layer's window set to another
    between two steps is refused at the next step with the checked forward's error, whether the steps run checked (a
    hook) or unchecked (they attended over the pools under the new window, blocks already given back among them); the
    step changes nothing, and with the window set back the requests go on to the tokens of a run left alone."""
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(2))

    def run(hooked: bool, change: bool) -> list[int]:
        model = llama(windows=(4, 4))
        if hooked:
            model.register_forward_hook(lambda *args: None)  # every step a checked forward
        batcher, got = Batcher(model, num_blocks=16, block_size=4), []
        batcher.submit(prompt, 10)
        while batcher.pending:
            got += [t for _, t in batcher.step()]
            if len(got) == 3 and change:
                layer = model.attention_layers()[1]
                layer.window = window
                with pytest.raises(ValueError, match=rf"cache\[1\] \(layer 1\): a sliding cache of window=4 needs attention with window=4, got window={window}"):
                    batcher.step()
                layer.window = 4
                change = False
        return got

    want = run(hooked=False, change=False)
    assert run(hooked=True, change=True) == want
    assert run(hooked=False, change=True) == want


@torch.no_grad()
def test_a_batcher_copied_or_pickled_mid_run_steps_on_alike_and_follows_a_model_set_on_it():
    """A Batcher copied (``copy.deepcopy``, ``pickle``) after some steps gives the original's next tokens; a model set
    on it (``batcher.model = ...``) is the one its steps walk and check: a window set on the new model's sliding layer
    is refused with the checked forward's error."""
    import pickle

    from headwise import native

    native.built()  # (loaded where it builds: the steps' walk is then a C call's, kept under a key)
    prompt = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(3))
    batcher = Batcher(llama(windows=(4, 4)), num_blocks=16, block_size=4)
    batcher.submit(prompt, 8)
    first = [t for _ in range(3) for _, t in batcher.step()]
    copies = [copy.deepcopy(batcher), pickle.loads(pickle.dumps(batcher))]
    rest = [t for _, t in batcher.stream()]
    assert len(first + rest) == 8
    for other in copies:
        assert [t for _, t in other.stream()] == rest
    batcher = Batcher(llama(windows=(4, 4)), num_blocks=16, block_size=4)
    batcher.submit(prompt, 8)
    batcher.step()
    batcher.model = model = copy.deepcopy(batcher.model)
    model.attention_layers()[0].window = 2
    with pytest.raises(ValueError, match=r"cache\[0\] \(layer 0\): a sliding cache of window=4 needs attention with window=4, got window=2"):
        batcher.step()
