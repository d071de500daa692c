"""torch.compile: every module and model traces whole (no graph break), recompiles for no new
length and no decode step, and computes what eager computes.

Oracle: the same module run eagerly (whose numbers the rest of the suite checks against the
float64 reference). Break and recompile counts use Dynamo alone (``explain``, a counting
backend); equality uses ``aot_eager`` (the graphs autograd and inductor get), and inductor in a
few cases, since it costs seconds per graph on a small CPU.

A new module, model or attention variant joins by adding a ``Case`` to ``MODULES`` or ``MODELS``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter

import headwise as hw
from headwise.config import GPT2Config
from headwise.fused import GPT2MultiHeadAttention
from headwise.models.bert import BertConfig, BertModel
from headwise.models.gpt2 import GPT2LMHeadModel
from headwise.models.llama import LlamaAttention, LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
from headwise.models.llama_config import LlamaConfig
from headwise.observe import observe, observing
from headwise.rope import RotaryEmbedding

pytestmark = pytest.mark.slow  # left out by make test-fast (pyproject's markers)

B, C, CTX, VOCAB = 2, 64, 32, 97
LENGTHS = (16, 24, 31)  # three sequence lengths: one graph must serve them all under dynamic=True


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts and ends with no compiled code and no automatic-dynamic memory."""
    dynamo.reset()
    yield
    dynamo.reset()


@dataclass
class Case:
    """A module (or model) and its inputs for T tokens: ``inputs(T) -> (args, kwargs)``."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[tuple, dict]]
    train: bool = False  # dropout on: compared by gradients' shapes and finiteness, not by values
    extra: dict = field(default_factory=dict)

    def module(self) -> nn.Module:
        torch.manual_seed(0)
        return self.build().train(self.train)


def _x(t: int) -> tuple[tuple, dict]:
    return (torch.randn(B, t, C),), {}


def _padding(t: int, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    mask = torch.ones(B, t, dtype=dtype)
    mask[0, :3] = 0  # left padding in row 0
    return mask


def _x_masked(dtype: torch.dtype) -> Callable[[int], tuple[tuple, dict]]:
    return lambda t: ((torch.randn(B, t, C),), {"attention_mask": _padding(t, dtype)})


def _ids(t: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (B, t), generator=torch.Generator().manual_seed(t))


def _gpt2_config(dropout: float = 0.0) -> GPT2Config:
    return GPT2Config(vocab_size=VOCAB, n_positions=CTX, n_embd=C, n_layer=2, n_head=4, attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)


def _llama_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=VOCAB, hidden_size=C, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=CTX)
    return LlamaConfig(**{**base, **kw})


def _bert() -> BertModel:
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=C, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                                max_position_embeddings=CTX, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _sentence_encoder() -> nn.Module:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return hw.models.SentenceEncoder(_bert(), tokenizer)


MODULES = [
    Case("CausalAttention", lambda: hw.CausalAttention(C, 16, CTX, 0.0), _x),
    Case("MultiHeadAttentionWrapper", lambda: hw.MultiHeadAttentionWrapper(C, 16, CTX, 0.0, num_heads=2), _x),
    Case("MultiHeadAttention", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4), _x),
    Case("MultiHeadAttention-bidirectional", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, causal=False), _x),
    Case("MultiHeadAttention-padding", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4), _x_masked(torch.bool)),
    Case("MultiHeadAttention-int-padding", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4), _x_masked(torch.long)),
    Case("MultiHeadAttention-gqa", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, num_kv_heads=2), _x),
    Case("MultiHeadAttention-window", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, window=5), _x_masked(torch.bool)),
    Case("MultiHeadAttention-math", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, backend="math"), _x_masked(torch.bool)),
    Case("MultiHeadAttention-sinks", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, sinks=True), _x),
    Case("MultiHeadAttention-softcap", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, softcap=5.0), _x),
    Case("MultiHeadAttention-alibi", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, alibi=True), _x_masked(torch.bool)),
    Case("GPT2MultiHeadAttention", lambda: GPT2MultiHeadAttention(_gpt2_config()), _x),
    Case("LlamaAttention-rotary", lambda: LlamaAttention(_llama_config(qk_norm=True), RotaryEmbedding(C // 4)), _x_masked(torch.bool)),
    Case("MultiHeadAttention-train-dropout", lambda: hw.MultiHeadAttention(C, C, CTX, 0.3, num_heads=4), _x_masked(torch.bool), train=True),
    Case("CausalAttention-train-dropout", lambda: hw.CausalAttention(C, 16, CTX, 0.3), _x, train=True),
]

MODELS = [
    Case("GPT2LMHeadModel", lambda: GPT2LMHeadModel(_gpt2_config()), lambda t: ((_ids(t),), {})),
    Case("GPT2LMHeadModel-padding", lambda: GPT2LMHeadModel(_gpt2_config()), lambda t: ((_ids(t),), {"attention_mask": _padding(t, torch.long)})),
    Case("GPT2LMHeadModel-train-dropout", lambda: GPT2LMHeadModel(_gpt2_config(dropout=0.1)), lambda t: ((_ids(t),), {}), train=True),
    Case("BertModel", _bert, lambda t: ((_ids(t), _padding(t, torch.long)), {})),
    Case("SentenceEncoder", _sentence_encoder, lambda t: ((_ids(t), _padding(t, torch.long)), {})),
    Case("LlamaForCausalLM", lambda: LlamaForCausalLM(_llama_config()), lambda t: ((_ids(t),), {})),
    Case("LlamaForCausalLM-padding", lambda: LlamaForCausalLM(_llama_config()), lambda t: ((_ids(t), _padding(t, torch.long)), {})),
    Case("MistralForCausalLM", lambda: MistralForCausalLM(_llama_config(windows=(6, 6))), lambda t: ((_ids(t), _padding(t, torch.long)), {})),
    Case("Qwen3ForCausalLM", lambda: Qwen3ForCausalLM(_llama_config(head_dim=32, qk_norm=True)), lambda t: ((_ids(t),), {})),
]

CASES = MODULES + MODELS


def _ids_of(cases: list[Case]) -> list[str]:
    return [case.name for case in cases]


# ----------------------------------------------------------------------------- no graph break


@pytest.mark.parametrize("case", CASES, ids=_ids_of(CASES))
def test_traces_whole(case: Case):
    module = case.module()
    args, kwargs = case.inputs(LENGTHS[0])
    explained = dynamo.explain(module)(*args, **kwargs)
    reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert explained.graph_break_count == 0, reasons
    assert explained.graph_count == 1


@pytest.mark.parametrize("case", CASES, ids=_ids_of(CASES))
def test_fullgraph_equals_eager(case: Case):
    """``fullgraph=True`` compiles (it raises at any break); forward (and backward) match eager."""
    module = case.module()
    args, kwargs = case.inputs(LENGTHS[1])
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    if case.train:  # dropout draws differ between the two runs: gradients must reach every parameter, finite
        out = compiled(*args, **kwargs)
        out.float().square().mean().backward()
        for name, p in module.named_parameters():
            assert p.grad is not None and p.grad.shape == p.shape and bool(p.grad.isfinite().all()), name
        return
    with torch.no_grad():
        want = module(*args, **kwargs)
        got = compiled(*args, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", [c for c in MODULES if not c.train], ids=_ids_of([c for c in MODULES if not c.train]))
def test_backward_equals_eager(case: Case):
    """Training without dropout: the compiled gradients are eager's."""
    module = case.module().train()
    args, kwargs = case.inputs(LENGTHS[0])
    x = args[0].requires_grad_()
    module(x, **kwargs).square().mean().backward()
    want = [x.grad.clone(), *(p.grad.clone() for p in module.parameters())]
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.compile(module, backend="aot_eager", fullgraph=True)(x, **kwargs).square().mean().backward()
    got = [x.grad, *(p.grad for p in module.parameters())]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- recompilation


@pytest.mark.parametrize("case", CASES, ids=_ids_of(CASES))
def test_one_graph_for_three_lengths(case: Case):
    """``dynamic=True``: T = 16, 24, 31 and 7 (fewer rows than the CPU prefill kernel takes, more than any window here)
    run through one graph."""
    module = case.module()
    counter = CompileCounter()
    compiled = torch.compile(module, backend=counter, dynamic=True)
    for t in (*LENGTHS, 7):
        args, kwargs = case.inputs(t)
        compiled(*args, **kwargs)
    assert counter.frame_count == 1
    assert counter.op_count > 0


def test_default_compile_marks_the_length_dynamic_once():
    """Without ``dynamic=True`` Dynamo compiles the first length as a constant, then one graph for every other."""
    module = MODULES[2].module()
    counter = CompileCounter()
    compiled = torch.compile(module, backend=counter)
    for t in (*LENGTHS, 9, 20):
        compiled(*_x(t)[0])
    assert counter.frame_count == 2


def test_a_scale_that_changes_keeps_the_graph_whole():
    """A second value makes the scale a symbolic float: its check compares (``math.isinf`` broke the graph, an error
    under ``fullgraph=True``). torch's SDPA takes the scale as a constant: a graph a value."""
    fn = torch.compile(lambda q, k, v, s: hw.attention(q, k, v, causal=True, scale=s), backend="eager", fullgraph=True)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    for scale in (0.1, 0.2, 0.3):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        torch.testing.assert_close(fn(q, k, v, scale), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- decoding through a KVCache


@dataclass
class Decode:
    name: str
    module: Callable[[], nn.Module]
    cache: Callable[[], hw.KVCache]
    prefill_mask: bool = False


DECODES = [
    Decode("linear", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4), lambda: hw.KVCache(B, 4, CTX, 16)),
    Decode("left-padded", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4), lambda: hw.KVCache(B, 4, CTX, 16), prefill_mask=True),
    Decode("gqa", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, num_kv_heads=2), lambda: hw.KVCache(B, 2, CTX, 16)),
    Decode("sliding-ring", lambda: hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, window=4), lambda: hw.KVCache.sliding(B, 4, 4, 16)),
    Decode("gpt2", lambda: GPT2MultiHeadAttention(_gpt2_config()), lambda: hw.KVCache(B, 4, CTX, 16)),
    Decode("rotary", lambda: LlamaAttention(_llama_config(), RotaryEmbedding(16)), lambda: hw.KVCache(B, 2, CTX, 16), prefill_mask=True),
]
STEPS = 10


def _decode(module: nn.Module, cache: hw.KVCache, prefill_mask: bool, after_each: Callable[[], None] = lambda: None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    mask = _padding(5) if prefill_mask else None
    outs = [module(torch.randn(B, 5, C, generator=g), attention_mask=mask, cache=cache)]
    after_each()
    for _ in range(STEPS):
        outs.append(module(torch.randn(B, 1, C, generator=g), cache=cache))
        after_each()
    return outs


@pytest.mark.parametrize("case", DECODES, ids=[d.name for d in DECODES])
def test_decode_steps_do_not_recompile(case: Decode):
    """Prefill then 10 steps through one compiled module: one graph for the prefill, one for every step."""
    torch.manual_seed(0)
    module = case.module().eval()
    counter = CompileCounter()
    frames: list[int] = []
    with torch.no_grad():
        want = _decode(module, case.cache(), case.prefill_mask)
        explained = dynamo.explain(module)(torch.randn(B, 5, C), cache=case.cache())
        got = _decode(torch.compile(module, backend=counter), case.cache(), case.prefill_mask, lambda: frames.append(counter.frame_count))
    assert explained.graph_break_count == 0
    assert frames == [1] + [2] * STEPS
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_decode_only_with_dynamic_builds_one_graph():
    """Steps compiled apart from an eager prefill, ``dynamic=True``: the cache length is symbolic from the first step."""
    torch.manual_seed(0)
    module, cache = DECODES[0].module().eval(), DECODES[0].cache()
    counter = CompileCounter()
    step = torch.compile(module, backend=counter, dynamic=True)
    with torch.no_grad():
        module(torch.randn(B, 5, C), cache=cache)
        for _ in range(STEPS):
            step(torch.randn(B, 1, C), cache=cache)
    assert counter.frame_count == 1 and len(cache) == 5 + STEPS


@pytest.mark.parametrize("build", [lambda: GPT2LMHeadModel(_gpt2_config()), lambda: LlamaForCausalLM(_llama_config())], ids=["gpt2", "llama"])
def test_generate_with_compiled_steps(build):
    """``forward`` compiled: generate gives eager's tokens, with two graphs (prompt, steps) for 12 new tokens."""
    torch.manual_seed(0)
    model = build().eval()
    ids, mask = _ids(6), _padding(6, torch.long)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=12)
    counter = CompileCounter()
    model.forward = torch.compile(model.forward, backend=counter)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(got, want)
    assert counter.frame_count == 2


# ----------------------------------------------------------------------------- inductor (a few: seconds per graph here)


def test_inductor_forward_and_backward_equal_eager():
    torch.manual_seed(0)
    module = hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, num_kv_heads=2)
    x = torch.randn(B, 24, C, requires_grad=True)
    mask = _padding(24)
    module(x, attention_mask=mask).square().mean().backward()
    want = [x.grad.clone(), module.W_query.weight.grad.clone()]
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.compile(module, fullgraph=True)(x, attention_mask=mask).square().mean().backward()
    torch.testing.assert_close([x.grad, module.W_query.weight.grad], want, rtol=1e-4, atol=1e-5)


def test_inductor_compiles_a_softcap_with_its_gradient():
    """The capped blocks traced: out of place (inductor's index algebra never finished on the eager chain of in-place
    ops over views: Gemma 2 under inductor hung at its first forward)."""
    torch.manual_seed(0)
    module = hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, num_kv_heads=2, softcap=2.0, window=6)
    x = torch.randn(B, 20, C, requires_grad=True)
    module(x).square().mean().backward()
    want = [x.grad.clone(), module.W_query.weight.grad.clone()]
    module.zero_grad(set_to_none=True)
    x.grad = None
    torch.compile(module)(x).square().mean().backward()
    torch.testing.assert_close([x.grad, module.W_query.weight.grad], want, rtol=1e-4, atol=1e-5)
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    with torch.no_grad():
        got = torch.compile(lambda q, k, v: hw.attention(q, k, v, softcap=2.0))(q, k, v)
    torch.testing.assert_close(got, hw.attention(q, k, v, softcap=2.0), rtol=1e-5, atol=1e-6)


def test_inductor_model_equals_eager():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(_gpt2_config()).eval()
    ids, mask = _ids(12), _padding(12, torch.long)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(ids, attention_mask=mask), model(ids, attention_mask=mask), rtol=1e-4, atol=1e-4)


def test_inductor_steps_over_a_ring_cache_keep_one_graph_as_it_wraps():
    """Decode steps over ``KVCache.sliding``, compiled by inductor with ``dynamic=True`` (prompts eager): one graph for
    every slot of the ring and for a second sequence, the same numbers as eager (the slot is a tensor index: a slice at
    a symbolic offset made inductor guard on ``len % window``)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    counters.clear()
    module = hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4, window=4).eval()
    step = torch.compile(module, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for prompt in (6, 9):
            compiled, eager = hw.KVCache.sliding(B, 4, 4, 16), hw.KVCache.sliding(B, 4, 4, 16)
            x = torch.randn(B, prompt, C, generator=g)
            module(x, cache=compiled), module(x, cache=eager)
            for _ in range(6):
                x = torch.randn(B, 1, C, generator=g)
                assert torch.equal(step(x, cache=compiled), module(x, cache=eager))
    assert counters["stats"]["unique_graphs"] == 1


# ----------------------------------------------------------------------------- observers and checks under compile


def test_observers_off_under_compile_and_on_in_eager():
    torch.manual_seed(0)
    module = hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4).eval()
    x = torch.randn(B, 8, C)
    compiled = torch.compile(module, backend="eager", fullgraph=True)
    seen: list[str] = []
    with torch.no_grad(), observe(lambda name, t: seen.append(name)):
        got = compiled(x)
        assert seen == []  # a compiled forward reports nothing
        want = module(x)  # the same module, eager: every step
    assert seen[0] == "x" and "weights" in seen and seen[-1] == "output"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flag = torch.compile(lambda t: t + 1 if observing() else t - 1, backend="eager", fullgraph=True)
    with observe(lambda name, t: None):
        assert observing() and torch.equal(flag(torch.zeros(1)), -torch.ones(1))


def test_value_checks_run_inside_the_graph():
    """Under compile a 0/1 mask's values and the ids' range are asserted in the graph (RuntimeError, same words)."""
    module = torch.compile(hw.MultiHeadAttention(C, C, CTX, 0.0, num_heads=4), backend="aot_eager", fullgraph=True)
    bad = _padding(6, torch.long)
    bad[1, 2] = 2
    with pytest.raises(RuntimeError, match=r"attention_mask must hold only 0 \(padding\) and 1 \(real token\)"):
        module(torch.randn(B, 6, C), attention_mask=bad)
    model = torch.compile(GPT2LMHeadModel(_gpt2_config()), backend="aot_eager", fullgraph=True)
    ids = _ids(6)
    ids[0, 1] = VOCAB
    with pytest.raises(RuntimeError, match=rf"input_ids must hold ids in \[0, vocab_size={VOCAB}\)"):
        model(ids)


def test_an_additive_float_mask_compiles_whole_and_its_values_are_asserted_in_the_graph():
    """The float mask's NaN/+inf check is an assert inside the graph (no host read, no graph break)."""
    q = k = v = torch.randn(B, 4, 6, 8)
    fn = torch.compile(lambda q, k, v, m: hw.attention(q, k, v, mask=m), backend="aot_eager", fullgraph=True)
    bias = torch.randn(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -math.inf)
    torch.testing.assert_close(fn(q, k, v, bias), hw.attention(q, k, v, mask=bias))
    with pytest.raises(RuntimeError, match=r"mask \(additive float\) must hold finite numbers or -inf"):
        fn(q, k, v, bias.clone().fill_(math.nan))


def test_a_full_cache_under_compile_is_refused_with_its_message():
    """The cache's lengths are traced (SymInts with dynamic shapes): its message is made from ints (Dynamo could not
    format a SymInt into it, and under fullgraph=True reported a BUILD_STRING error without the message)."""
    mha = hw.MultiHeadAttention(64, 64, 64, 0.0, num_heads=4, num_kv_heads=2).eval()
    for fullgraph in (True, False):
        torch._dynamo.reset()
        fast = torch.compile(mha, dynamic=True, backend="aot_eager", fullgraph=fullgraph)
        cache = hw.KVCache(2, 2, 7, 16)
        refused = (ValueError, torch._dynamo.exc.Unsupported) if fullgraph else ValueError  # (Dynamo's, the message in it)
        with torch.no_grad():
            fast(torch.randn(2, 6, 64), cache=cache)
            fast(torch.randn(2, 1, 64), cache=cache)
            with pytest.raises(refused, match=r"cache is full: it holds 7 of max_len=7 tokens and cannot take 1 more"):
                fast(torch.randn(2, 1, 64), cache=cache)
        assert len(cache) == 7




def test_training_through_a_cache_traces_whole_and_gives_eager_gradients():
    """A forward that records its keys in a cache hooks their autograd nodes to mark the cache spent after a backward
    (eager); Dynamo cannot trace such a hook: under compile it is left out, so fullgraph holds (it raised at the prefill)
    and the steps recompile once, at the second (three graphs for a prefill and four steps)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    eager = hw.MultiHeadAttention(16, 16, 32, 0.0, num_heads=2).train()  # dropout 0: training without randomness
    twin = copy.deepcopy(eager)
    xs = [torch.randn(1, n, 16, generator=torch.Generator().manual_seed(n + i)) for i, n in enumerate((5, 1, 1, 1, 1))]
    counters.clear()
    for module in (eager, torch.compile(twin, backend="aot_eager", fullgraph=True)):
        cache = hw.KVCache(1, 2, 32, 8)
        sum(module(x, cache=cache).square().mean() for x in xs).backward()
    assert counters["stats"]["unique_graphs"] == 3
    for (name, want), got in zip(eager.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, msg=name)


def test_a_module_compiled_again_with_dynamic_shapes_hands_sdpa_a_bool():
    """Compiled twice over a cache (dynamic shapes, the second fullgraph): the heads' counts are traced, and SDPA's
    enable_gqa takes a bool only (it was handed a SymBool: Dynamo refused the prompt's call)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mha = hw.MultiHeadAttention(16, 16, 64, 0.0, num_heads=2).eval()
    prompt, step = torch.randn(1, 6, 16), torch.randn(1, 1, 16)
    for fullgraph in (False, True):
        fast = torch.compile(mha, dynamic=True, backend="aot_eager", fullgraph=fullgraph)
        cache, eager = hw.KVCache(1, 2, 7, 8), hw.KVCache(1, 2, 7, 8)
        with torch.no_grad():
            torch.testing.assert_close(fast(prompt, cache=cache), mha(prompt, cache=eager))
            torch.testing.assert_close(fast(step, cache=cache), mha(step, cache=eager))
            with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match=r"cache is full"):
                fast(step, cache=cache)


def test_an_eager_call_while_another_thread_compiles_runs_as_at_any_other_time(monkeypatch):
    """``torch.compiler.is_compiling()`` reads one flag for the whole process, which Dynamo holds True in every thread
    while any thread compiles: headwise asks whether Dynamo traces this very call, so an eager call made meanwhile runs
    its eager path (a projection took the traced branch, and its op, which runs the eager path, called itself until
    Python's recursion limit)."""
    torch.manual_seed(0)
    mha = hw.MultiHeadAttention(64, 64, 32, 0.0, 4).eval()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    x, ids = torch.randn(1, 1, 64), torch.tensor([[3, 1, 4]])
    with torch.no_grad():
        want, tokens = mha(x), model.generate(ids, max_new_tokens=4)
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)  # as Dynamo sets it while another thread compiles
    assert torch.compiler.is_compiling()
    with torch.no_grad():
        assert torch.equal(mha(x), want)
        assert torch.equal(model.generate(ids, max_new_tokens=4), tokens)
        assert torch.equal(hw.models.generate_many(model, [ids[0]], 4)[0], tokens[0, 3:])


def test_a_model_exports_by_non_strict_tracing_too():
    """``torch.export``'s non-strict tracing runs the Python on fake tensors, without Dynamo: headwise takes the traced
    branches there too (no host read of a value the graph computes), and the exported program computes the model."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=2, n_head=4)).eval()
    ids = torch.randint(0, 61, (2, 8))
    with torch.no_grad():
        program = torch.export.export(model, (ids,), strict=False)
        torch.testing.assert_close(program.module()(ids), model(ids), rtol=0, atol=1e-5)
