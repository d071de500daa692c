"""generate's unchecked decode step written out flat (``models/flat_step.py``): the unchecked forward's logits bit for
bit and its caches written the same, for GPT-2 and the Llama family; the forward itself where the step does not apply."""

from __future__ import annotations

import copy
import itertools
from unittest import mock

import pytest
import torch

from headwise.backends import decode_kernel
from headwise.cache import KVCache, PagedBatch
from headwise.config import GPT2Config
from headwise.models.flat_step import FlatStep, flat_step
from headwise.models.generate import decode_step
from headwise.models.gpt2 import Block, GPT2LMHeadModel
from headwise.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
from headwise.models.llama_config import LlamaConfig
from headwise.models.native_layer import NativeLayer
from headwise.observe import observe
from headwise.quantize import int8_weights

LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
GPT2 = dict(vocab_size=97, n_positions=64, n_embd=64, n_layer=2, n_head=4)

CASES = {
    "llama gqa fp32": (LlamaForCausalLM, dict(), torch.float32),
    "llama gqa bf16": (LlamaForCausalLM, dict(), torch.bfloat16),
    "llama mha, biases, tied head": (LlamaForCausalLM, dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=True), torch.float32),
    "llama3 rope scaling, partial rotary": (LlamaForCausalLM, dict(
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, partial_rotary_factor=0.5), torch.float32),
    "llama decode-sized widths, bf16": (LlamaForCausalLM, dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2), torch.bfloat16),
    "qwen3 qk-norm": (Qwen3ForCausalLM, dict(qk_norm=True, head_dim=32), torch.float32),
    "mistral sliding window (ring caches)": (MistralForCausalLM, dict(windows=(4, 4)), torch.float32),
    "gpt2 fp32": (GPT2LMHeadModel, dict(), torch.float32),
    "gpt2 bf16, decode-sized widths": (GPT2LMHeadModel, dict(n_embd=512, n_head=8), torch.bfloat16),
    "gpt2 grouped-query": (GPT2LMHeadModel, dict(n_kv_head=2), torch.float32),
}


def model_of(cls: type, kw: dict, dtype: torch.dtype):
    torch.manual_seed(0)
    config = GPT2Config(**{**GPT2, **kw}) if cls is GPT2LMHeadModel else LlamaConfig(**{**LLAMA, **kw})
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():  # weights of every scale, so that a changed op order would show
            p.normal_(0, 0.5)
    return model


def steps_both_ways(model, batch: int, steps: int = 6, padded: bool = False, linear: bool = False, cache_dtype=None):
    """The prompt once, then the same tokens through the flat step and through the unchecked forward, each on its own
    caches (holding ``cache_dtype``: None for the model's); with ``padded``, as generate runs a left-padded batch
    (position ids every step); with ``linear``, caches made by hand, linear whatever the layers' windows (``new_caches``
    makes rings under a window)."""
    ids = torch.randint(0, model.vocab_size, (batch, 7))
    mask = torch.ones(batch, 7, dtype=torch.bool)
    if padded:
        mask[0, :3] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    with torch.no_grad():
        flat_caches = [KVCache(batch, a.num_kv_heads, 32, a.head_dim, dtype=model.cache_dtype(None)) for a in model.attention_layers()] \
            if linear else model.new_caches(batch, 32, cache_dtype)
        model(ids, mask if padded else None, positions=positions if padded else None, cache=flat_caches, logits_to_keep=1, check=False)
        plain_caches = copy.deepcopy(flat_caches)
        step = flat_step(model)
        assert isinstance(step, FlatStep)
        token, position = ids[:, -1:], positions[:, -1:] if padded else None
        for _ in range(steps):
            if position is not None:
                position = position + 1  # (B, 1)
            got = step(token, position, flat_caches)  # (B, vocab)
            want = model(token, positions=position, cache=plain_caches, logits_to_keep=1, check=False)[:, 0]  # (B, vocab)
            yield got, want, flat_caches, plain_caches
            token = want.argmax(-1, keepdim=True)  # (B, 1)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("batch", [1, 3, 20])  # 20 rows: more than a decode call's DECODE_ROWS, the layers' GEMMs one by one
def test_the_flat_step_gives_the_forwards_logits_bit_for_bit(case, batch):
    cls, kw, dtype = CASES[case]
    for got, want, flat_caches, plain_caches in steps_both_ways(model_of(cls, kw, dtype), batch):
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)
        for a, b in zip(flat_caches, plain_caches, strict=True):
            assert len(a) == len(b) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


CACHE_CASES = {  # (case, what the caches hold)
    "gpt2 fp32, bf16 caches": torch.bfloat16, "gpt2 fp32, 8-bit caches": torch.int8, "llama gqa fp32, bf16 caches": torch.bfloat16,
    "llama gqa bf16, 8-bit caches": torch.int8, "gpt2 bf16, decode-sized widths, 8-bit caches": torch.int8,
}


@pytest.mark.parametrize("name", CACHE_CASES)
@pytest.mark.parametrize("batch", [1, 3])
def test_the_flat_step_over_bfloat16_or_8_bit_caches_gives_the_forwards_logits_bit_for_bit(name, batch):
    """A float32 model over bfloat16 caches (the step's attention output widened as it is written: each value rounded to
    bfloat16 first), either model over 8-bit rows: the flat step's logits and caches are the unchecked forward's."""
    cls, kw, dtype = CASES[name.rsplit(",", 1)[0]]
    held = CACHE_CASES[name]
    for got, want, flat_caches, plain_caches in steps_both_ways(model_of(cls, kw, dtype), batch, cache_dtype=held):
        assert got.dtype == dtype and torch.equal(got, want)
        for a, b in zip(flat_caches, plain_caches, strict=True):
            assert a.k.dtype == held and len(a) == len(b) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_a_padded_batch_steps_flat_at_its_position_ids(cls):
    for got, want, _, _ in steps_both_ways(model_of(cls, {}, torch.float32), 3, padded=True):
        assert torch.equal(got, want)


def test_a_window_over_linear_caches_steps_flat_as_the_forward():
    """Caches made by hand, linear under sliding-window layers: the flat step's attention, decided at its first step,
    drops the keys before the window at every step after, as the forward does (the C++ kernel reads every key from the
    first, so it is not that call's)."""
    model = model_of(MistralForCausalLM, dict(windows=(4, 4)), torch.float32)
    for got, want, _, _ in steps_both_ways(model, 2, steps=8, linear=True):  # a 7-token prompt: past the window at once
        assert torch.equal(got, want)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_an_int8_model_steps_flat_bit_for_bit(cls):
    wide = dict(hidden_size=256, intermediate_size=512) if cls is LlamaForCausalLM else dict(n_embd=256)
    model = int8_weights(model_of(cls, wide, torch.float32))
    for got, want, _, _ in steps_both_ways(model, 2):
        assert torch.equal(got, want)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_generate_takes_the_flat_step_only_unchecked_and_eager_with_the_checked_tokens(cls):
    model = model_of(cls, {}, torch.float32)
    assert isinstance(decode_step(model, False, False), FlatStep)
    assert not isinstance(decode_step(model, False, True), FlatStep)  # a checked step is the forward's
    ids = torch.randint(0, model.vocab_size, (2, 5))
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=6)
        caches = model.new_caches(2, 11)  # the same greedy loop through the checked forward
        logits = model(ids, cache=caches, logits_to_keep=1)[:, 0]
        want = [ids]
        for _ in range(6):
            want.append(logits.argmax(-1, keepdim=True))
            logits = model(want[-1], cache=caches, logits_to_keep=1)[:, 0]
    assert torch.equal(tokens, torch.cat(want, dim=1))


@pytest.mark.parametrize("case", ["llama gqa fp32", "llama gqa bf16", "gpt2 fp32", "mistral sliding window (ring caches)"])
def test_each_layers_attention_is_decided_at_its_first_step(case):
    """Where the plan of a layer's step is the C++ decode kernel over a whole cache, the flat step keeps that call for
    the steps after (a ring cache keeps the full path); the logits stay the forward's (above)."""
    from headwise.backends import decode_kernel

    cls, kw, dtype = CASES[case]
    model = model_of(cls, kw, dtype)
    *_, flat_caches, _ = list(steps_both_ways(model, 2, steps=2))[-1]
    step = flat_step(model)
    with torch.no_grad():
        step(torch.zeros(2, 1, dtype=torch.long), None, flat_caches)
    kernel = decode_kernel.available() and "sliding" not in case
    assert [cache is c and (call is not None) == kernel for (cache, _, call), c in zip(step.kernel_calls, flat_caches, strict=True)] \
        == [True] * len(flat_caches)


def with_score_terms(model):
    """``model`` with a softcap, a sink per head and ALiBi slopes on every attention layer (read by ``score_terms``)."""
    g = torch.Generator().manual_seed(7)
    for a in model.attention_layers():
        a.softcap = 4.0
        a.sinks = torch.nn.Parameter(torch.randn(a.num_heads, generator=g).to(next(a.parameters()).dtype), requires_grad=False)
        a.alibi_slopes = torch.rand(a.num_heads, generator=g)
    return model


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_softcap_sinks_and_alibi_step_in_the_layers_one_op_bit_for_bit(cls, dtype):
    """Layers with a softcap, sinks and ALiBi: each step's attention the decode kernel's (``decode_kernel_call``), from
    the second step on inside the whole layer's one op (``decode_layer`` passes the terms on); the forward's logits bit
    for bit, and sinks changed in place between steps are read as they stand."""
    model = with_score_terms(model_of(cls, {}, dtype))
    native = []
    call_native = NativeLayer.__call__

    def counted_native(layer, *args):
        native.append(out := call_native(layer, *args))
        return out

    torch.manual_seed(0)
    plain = [want for _, want, _, _ in steps_both_ways(model_of(cls, {}, dtype), 2, steps=4)]
    torch.manual_seed(0)
    with mock.patch.object(NativeLayer, "__call__", counted_native):
        for (got, want, caches, _), without in zip(steps_both_ways(model, 2, steps=4), plain, strict=True):
            assert torch.equal(got, want)
            assert not torch.allclose(want, without, atol=1e-2)  # the terms change every step's logits
            flat_caches = caches
    assert any(out is not None for out in native) == decode_kernel.available()
    step = flat_step(model)
    plain_caches = copy.deepcopy(flat_caches)
    ids = torch.zeros(2, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(2):  # the first call decides each layer's kernel call, the second runs the layers' ops
            got, want = step(ids, None, flat_caches), model(ids, cache=plain_caches, logits_to_keep=1, check=False)[:, 0]
            assert torch.equal(got, want)
        assert all((call is not None) == decode_kernel.available() for *_, call in step.kernel_calls)
        for a in model.attention_layers():
            a.sinks.mul_(-3.0)  # in place: the next step reads them as they stand
        native.clear()
        with mock.patch.object(NativeLayer, "__call__", counted_native):
            got = step(ids, None, flat_caches)
        want = model(ids, cache=plain_caches, logits_to_keep=1, check=False)[:, 0]
    assert torch.equal(got, want)
    assert len(native) == (len(flat_caches) if decode_kernel.available() else 0) and all(out is not None for out in native)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_weights_changed_between_steps_are_seen(cls):
    """The step's kept decisions follow a weight written in place or replaced between two steps (an ``on_token``
    callback could do either), and a step of two tokens after them: its logits are the forward's."""
    model = model_of(cls, {}, torch.float32)
    ids = torch.randint(0, model.vocab_size, (1, 5))
    with torch.no_grad():
        caches = model.new_caches(1, 16)
        model(ids, cache=caches, logits_to_keep=1, check=False)
        plain = copy.deepcopy(caches)
        step = flat_step(model)
        step(ids[:, -1:], None, caches), model(ids[:, -1:], cache=plain, logits_to_keep=1, check=False)
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.in_features == 64)
        first.weight.mul_(-1.5)  # in place
        got, want = step(ids[:, -2:-1], None, caches), model(ids[:, -2:-1], cache=plain, logits_to_keep=1, check=False)[:, 0]
        assert torch.equal(got, want)
        first.weight = torch.nn.Parameter(torch.randn_like(first.weight))  # replaced
        got, want = step(ids[:, -3:-2], None, caches), model(ids[:, -3:-2], cache=plain, logits_to_keep=1, check=False)[:, 0]
        assert torch.equal(got, want)
        got, want = step(ids[:, :2], None, caches), model(ids[:, :2], cache=plain, logits_to_keep=1, check=False)[:, 0]
        assert torch.equal(got, want), "two tokens after one-token steps: not the kernel's one-query call"


def test_a_block_that_does_not_name_its_parts_keeps_the_forward():
    """``flat_parts`` counts on the class that declares it: a subclass (which may change forward) must name its own."""
    model = model_of(GPT2LMHeadModel, {}, torch.float32)

    class Changed(Block):
        def forward(self, x, **kw):
            return super().forward(x, **kw) * 2

    changed = Changed(model.config).eval()
    changed.load_state_dict(model.blocks[1].state_dict())
    model.blocks[1] = changed
    assert flat_step(model) is None
    assert not isinstance(decode_step(model, False, False), FlatStep)


def test_an_observed_step_runs_the_forward():
    """An observer started after the step was made still sees the forward's steps."""
    model = model_of(LlamaForCausalLM, {}, torch.float32)
    step = flat_step(model)
    ids = torch.randint(0, model.vocab_size, (1, 5))
    with torch.no_grad():
        caches = model.new_caches(1, 16)
        model(ids, cache=caches, logits_to_keep=1, check=False)
        seen = []
        with observe(lambda name, tensor: seen.append(name)):
            step(ids[:, -1:], None, caches)
    assert "queries.rotated" in seen and "context" in seen, "the observer saw the layers' steps"


PAGED_CASES = {  # (case, the pools' dtype: None = the model's)
    "gpt2 fp32": None, "gpt2 fp32, bf16 pools": torch.bfloat16, "gpt2 fp32, 8-bit pools": torch.int8,
    "llama gqa fp32": None, "llama gqa bf16": None, "llama gqa fp32, 8-bit pools": torch.int8, "llama gqa bf16, 8-bit pools": torch.int8,
    "qwen3 qk-norm": None, "mistral sliding window (ring caches)": None, "gpt2 grouped-query": None,
    "gpt2 fp32, softcap, sinks, ALiBi": None, "llama gqa bf16, softcap, sinks, ALiBi": None,
}


@pytest.mark.parametrize("name", PAGED_CASES)
def test_the_flat_step_over_paged_batches_gives_the_forwards_logits_bit_for_bit(name):
    """The ``Batcher``'s decode steps: packed rows of several sequences through one paged pool a layer, one token each
    (and a step of several tokens for one of them, and one without a sequence), the logits of the rows asked for and
    the pools as the unchecked forward's; where the C++ kernels are built, every step of one token a sequence written
    and attended by one op a layer (``paged_kernel_call``), from the second on the whole layer in one (``decode_layer``)
    but where the layer has no such op (qk-norm); a softcap, sinks and ALiBi go into either op."""
    case = name.split(",")[0]
    cls, kw, dtype = CASES[case]
    model = model_of(cls, kw, dtype)
    terms = name.endswith("ALiBi")
    if terms:
        model = with_score_terms(model)
    lengths = {0: 5, 1: 9, 2: 3}
    with torch.no_grad():
        pools = model.new_paged_caches(24, 4, PAGED_CASES[name])
        for pool in pools:
            for s in range(3):
                pool.add(s)
        ids = torch.randint(0, model.vocab_size, (1, sum(lengths.values())))
        positions = torch.tensor([[p for n in lengths.values() for p in range(n)]])
        model(ids, positions=positions, cache=[p.batch([0, 1, 2], list(lengths.values())) for p in pools], logits_to_keep=1)  # the prompts
        plain = copy.deepcopy(pools)
        step = flat_step(model)
        by_op, native = [], []
        write_rows, call_native = PagedBatch.write_rows_unchecked, NativeLayer.__call__

        def counted_write(batch, run):
            by_op.append(batch)
            return write_rows(batch, run)

        def counted_native(layer, *args):
            native.append(out := call_native(layer, *args))
            return out

        steps = (([0, 1, 2], [1, 1, 1]), ([0, 1, 2], [1, 1, 1]), ([0, 1, 2], [1, 3, 1]), ([2, 0], [1, 1]), ([0, 1, 2], [1, 1, 1]))
        for i, (seq_ids, counts) in enumerate(steps):
            by_op.clear()
            native.clear()
            ids = torch.randint(0, model.vocab_size, (1, sum(counts)))
            positions = torch.tensor([[p for s, c in zip(seq_ids, counts, strict=True) for p in range(lengths[s], lengths[s] + c)]])
            rows = torch.tensor(list(itertools.accumulate(counts))) - 1  # each sequence's last row
            with (mock.patch.object(type(model), "forward", side_effect=AssertionError("the forward ran, not the flat step")),
                  mock.patch.object(PagedBatch, "write_rows_unchecked", counted_write), mock.patch.object(NativeLayer, "__call__", counted_native)):
                got = step.logits(ids, positions, [p.batch(seq_ids, counts) for p in pools], rows)  # (1, N, vocab)
            want = model(ids, positions=positions, cache=[p.batch(seq_ids, counts) for p in plain], logits_to_keep=rows, check=False)
            assert got.shape == want.shape == (1, len(seq_ids), model.vocab_size) and torch.equal(got, want)
            one_each = set(counts) == {1} and decode_kernel.available()
            assert len(by_op) == (len(pools) if one_each else 0)
            if one_each and i > 0 and case != "qwen3 qk-norm":  # the layers' own ops, from the step after the first
                assert len(native) == len(pools) and all(out is not None for out in native)
            else:
                assert not native
            for s, c in zip(seq_ids, counts, strict=True):
                lengths[s] += c
        for a, b in zip(pools, plain, strict=True):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and [a.length(s) for s in range(3)] == [b.length(s) for s in range(3)]


def test_a_gelu_switched_between_steps_is_the_one_the_next_step_computes():
    """GPT-2's layer op takes the MLP's GELU by name: ``act.approximate`` set to "none" between steps (an exact GELU
    from then on) reaches the next step, as it reaches the checked forward (the op kept the name it was made with)."""
    def model() -> GPT2LMHeadModel:
        torch.manual_seed(0)
        m = GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
        with torch.no_grad():  # pre-activations near -3, where the two GELUs differ by some 10%, amplified
            for block in m.transformer.h:
                block.mlp.c_fc.weight.mul_(0.1), block.mlp.c_fc.bias.fill_(-3.0), block.mlp.c_proj.weight.mul_(200.0)
        return m

    ours, theirs = model(), model()
    prompt, ids = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 4))
    with torch.no_grad():
        caches, checked = ours.new_caches(1, 16), theirs.new_caches(1, 16)
        ours(prompt, cache=caches, logits_to_keep=1), theirs(prompt, cache=checked, logits_to_keep=1)
        step = ours.flat_step()
        for s in range(4):
            if s == 2:
                for m in (ours, theirs):
                    for block in m.transformer.h:
                        block.mlp.act.approximate = "none"
            got, want = step(ids[:, s : s + 1], None, caches), theirs(ids[:, s : s + 1], cache=checked)[:, -1]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
@pytest.mark.parametrize("term", ["window", "softcap", "causal", "backend"])
def test_an_attention_term_set_between_steps_is_the_one_the_next_step_computes(cls, term):
    """A layer's window, softcap, causal flag or backend set between two steps reaches the next step, as it reaches the
    forward (the step kept each layer's kernel call, and its one op, decided at its first step under the old terms)."""
    new = {"window": 3, "softcap": 0.5, "causal": False, "backend": "math"}[term]
    ours, theirs = model_of(cls, {}, torch.float32), model_of(cls, {}, torch.float32)
    prompt, ids = torch.randint(0, 97, (2, 6)), torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        caches, checked = ours.new_caches(2, 16), theirs.new_caches(2, 16)
        ours(prompt, cache=caches, logits_to_keep=1), theirs(prompt, cache=checked, logits_to_keep=1)
        step, changed = ours.flat_step(), []
        for s in range(5):
            if s == 2:
                for m in (ours, theirs):
                    for attn in m.attention_layers():
                        setattr(attn, term, new)
            got, want = step(ids[:, s : s + 1], None, caches), theirs(ids[:, s : s + 1], cache=checked)[:, -1]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            changed.append(want)
    if term in ("window", "softcap"):  # (a query's own row: a causal flag changes nothing at one token; math is exact too)
        with torch.no_grad():
            plain, cache = model_of(cls, {}, torch.float32), None
            cache = plain.new_caches(2, 16)
            plain(prompt, cache=cache, logits_to_keep=1)
            before = [plain(ids[:, s : s + 1], cache=cache)[:, -1] for s in range(5)]
        assert not torch.allclose(before[-1], changed[-1], atol=1e-3)  # the new term changes the logits
