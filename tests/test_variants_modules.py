"""MultiHeadAttention with softcap, sinks, ALiBi and cross-attention, against the float64 reference."""

from __future__ import annotations

import pytest
import torch
from reference import linear
from reference_variants import variant_attention

import headwise as hw
from headwise.layer import ContextCache
from headwise.scores import alibi_slopes

BACKENDS = ["math", "sdpa", "auto"]


def _heads(y: torch.Tensor, n: int) -> torch.Tensor:
    D = y.shape[-1] // n
    return torch.stack([y[..., h * D : (h + 1) * D] for h in range(n)], dim=1)  # (B, n, T, D)


def reference_module(m: hw.MultiHeadAttention, x: torch.Tensor, context: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """The module's weights in float64, head by head, through the variants' reference."""
    w = lambda layer: (layer.weight.detach(), None if layer.bias is None else layer.bias.detach())  # noqa: E731
    source = x if context is None else context
    q = _heads(linear(x, *w(m.W_query)), m.num_heads)
    k = _heads(linear(source, *w(m.W_key)), m.num_kv_heads)
    v = _heads(linear(source, *w(m.W_value)), m.num_kv_heads)
    if getattr(m, "sinks", None) is not None:
        kw["sinks"] = m.sinks.detach()
    if getattr(m, "alibi_slopes", None) is not None:
        kw["alibi_slopes"] = m.alibi_slopes
    ctx = variant_attention(q, k, v, causal=context is None and m.causal, window=m.window, softcap=m.softcap, **kw)
    merged = torch.cat([ctx[:, h] for h in range(m.num_heads)], dim=-1)
    return linear(merged, *w(m.out_proj))


def _module(seed=0, **kw):
    torch.manual_seed(seed)
    m = hw.MultiHeadAttention(12, 12, 32, 0.0, num_heads=4, qkv_bias=True, **kw).double().eval()
    with torch.no_grad():
        if getattr(m, "sinks", None) is not None:
            m.sinks.normal_()
    return m


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "kw", [{"softcap": 1.5}, {"sinks": True}, {"alibi": True}, {"softcap": 2.0, "sinks": True, "alibi": True, "num_kv_heads": 2, "window": 4}]
)
def test_module_terms_match_the_reference(backend, kw):
    m = _module(backend=backend, **kw)
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    real = torch.ones(2, 9, dtype=torch.bool)
    real[1, :3] = False  # left padding
    got = m(x, attention_mask=real)
    want = reference_module(m, x, attention_mask=real)
    torch.testing.assert_close(got[real], want[real], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoding_with_every_term_equals_the_full_forward(backend):
    m = _module(backend=backend, softcap=2.0, sinks=True, alibi=True, num_kv_heads=2)
    x = torch.randn(2, 8, 12, dtype=torch.float64)
    full = m(x)
    cache = hw.KVCache(2, 2, 8, 3, dtype=torch.float64)
    steps = [m(x[:, :5], cache=cache)] + [m(x[:, i : i + 1], cache=cache) for i in range(5, 8)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=1e-10)


def test_sinks_are_a_learned_parameter_in_the_state_dict():
    torch.manual_seed(0)
    plain = hw.MultiHeadAttention(12, 12, 32, 0.0, num_heads=4)
    torch.manual_seed(0)
    m = hw.MultiHeadAttention(12, 12, 32, 0.0, num_heads=4, sinks=True, alibi=True, softcap=30.0)
    state = m.state_dict()
    assert set(state) == {*plain.state_dict(), "sinks"}  # the book's keys and the sink; no ALiBi buffer
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key], value)  # same seed, same weights as the book's class
    assert state["sinks"].shape == (4,)
    hw.MultiHeadAttention(12, 12, 32, 0.0, num_heads=4, sinks=True).load_state_dict(state)  # strict
    m(torch.randn(1, 5, 12)).sum().backward()
    assert m.sinks.grad is not None and m.sinks.grad.abs().sum() > 0


def test_alibi_slopes_follow_the_standard_rule():
    assert alibi_slopes(8).tolist() == [2.0 ** (-i) for i in range(1, 9)]
    # BLOOM's rule for 6 heads: the 4 slopes of 4 heads, then every other slope of 8 heads
    assert torch.allclose(alibi_slopes(6), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]))
    assert torch.equal(_module(alibi=True).alibi_slopes, alibi_slopes(4).double())


@pytest.mark.parametrize("assign", [False, True])
def test_alibi_slopes_of_a_module_built_on_meta_are_refilled(assign):
    """The slopes stay out of the state dict, so a load never reaches them: ``to_empty`` refills them."""
    m = _module(alibi=True)
    with torch.device("meta"):
        skeleton = hw.MultiHeadAttention(12, 12, 32, 0.0, num_heads=4, qkv_bias=True, alibi=True).double()
    assert skeleton.alibi_slopes.is_meta
    skeleton.to_empty(device="cpu").load_state_dict(m.state_dict(), assign=assign)
    assert torch.equal(skeleton.alibi_slopes, m.alibi_slopes)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    assert torch.equal(skeleton.eval()(x), m(x))


def test_alibi_slopes_a_move_carries_are_kept():
    """Slopes set by hand survive a cast or a copy (the move carried them); only uninitialised ones are made again."""
    m = _module(alibi=True)
    with torch.no_grad():
        m.alibi_slopes.mul_(0.5)
    assert torch.equal(m.to("cpu").float().alibi_slopes, alibi_slopes(4) * 0.5)


# ----------------------------------------------------------------------------- cross-attention


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [{}, {"sinks": True, "softcap": 3.0, "num_kv_heads": 2}])
def test_cross_attention_matches_the_reference(backend, kw):
    m = _module(backend=backend, causal=False, kv_dim=7, **kw)
    x, memory = torch.randn(2, 5, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    real = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    memory[1, 4:] = float("nan")  # padding is inert
    got = m(x, context=memory, context_mask=real)
    want = reference_module(m, x, torch.where(real[..., None], memory, 0.0), attention_mask=real)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_a_context_cache_projects_the_context_once(monkeypatch):
    m = _module(causal=False, kv_dim=7)
    x, memory = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    full = m(x, context=memory)
    calls = []
    real = m.project_kv
    monkeypatch.setattr(m, "project_kv", lambda c: calls.append(c.shape) or real(c))
    cache = ContextCache()
    steps = [m(x[:, :2], context=memory, cache=cache)] + [m(x[:, i : i + 1], context=memory if i == 2 else None, cache=cache) for i in (2, 3)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-12, rtol=1e-12)
    assert calls == [(2, 6, 7)] and len(cache) == 6
    cache.reset()
    assert len(cache) == 0


def test_a_context_cache_refuses_to_project_a_kept_context_that_changed_or_whose_graph_is_gone():
    """The kept context projected again (the weights changed; autograd wants keys of its own) must be what the stored
    keys came from: written in place since (a reused encoder buffer), or carrying a graph a backward freed (an encoder's
    output), it is refused by name before anything runs; an empty context fills the cache (it holds S = 0 keys)."""
    m = _module(causal=False, kv_dim=7)
    x, memory = torch.randn(2, 4, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    cache = ContextCache()
    with torch.no_grad():
        m(x, context=memory, cache=cache)
        memory.mul_(2)  # the encoder's buffer reused
        m(x, cache=cache)  # the stored keys still serve: no projection
        m.W_query.weight.add_(0.0)  # the weights' version moves: the kept context would be projected again
        with pytest.raises(ValueError, match=r"the context this ContextCache was filled from was written in place since: pass context= again"):
            m(x, cache=cache)
    encoder = torch.nn.Linear(7, 7, dtype=torch.float64)
    cache = ContextCache()
    m(x, context=encoder(memory), cache=cache).pow(2).sum().backward()
    with pytest.raises(ValueError, match=r"a backward has gone through this ContextCache's keys and values, and through the graph of the context"):
        m(x, cache=cache)
    m(x, context=encoder(memory), cache=cache).pow(2).sum().backward()  # passed again: projected again, trains on
    empty = ContextCache()
    with torch.no_grad():
        first = m(x, context=torch.randn(2, 0, 7, dtype=torch.float64), cache=empty)
        assert len(empty) == 0 and torch.equal(m(x, cache=empty), first)


def _grads(m, out):
    m.zero_grad()
    out.pow(2).sum().backward()
    return {name: p.grad.clone() for name, p in m.named_parameters()}


@pytest.mark.parametrize("first", ["backward", "no_grad"])
def test_a_context_cache_serves_every_backward(first):
    """Keys a backward has gone through (autograd freed their graph), or kept without autograd, are projected again
    for a forward that records: each backward reaches the key and value projections, as without the cache."""
    m = _module(causal=False, kv_dim=7)
    x, memory = torch.randn(2, 3, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    cache = ContextCache()
    if first == "backward":
        _grads(m, m(x, context=memory, cache=cache))
    else:
        with torch.no_grad():
            m(x, context=memory, cache=cache)
    for _ in range(2):
        got = _grads(m, m(x, cache=cache))
        want = _grads(m, m(x, context=memory))
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


def test_a_context_cache_keeps_its_keys_for_one_backward_over_many_steps(monkeypatch):
    """Steps that reuse the keys before any backward share them (one projection), and one backward through all of them
    gives the gradients of the steps each given the context."""
    m = _module(causal=False, kv_dim=7)
    x, memory = torch.randn(2, 3, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    calls = []
    project_kv = m.project_kv
    monkeypatch.setattr(m, "project_kv", lambda c: calls.append(c.shape) or project_kv(c))
    cache = ContextCache()
    got = _grads(m, torch.cat([m(x[:, i : i + 1], context=memory if i == 0 else None, cache=cache) for i in range(3)], 1))
    assert len(calls) == 1
    want = _grads(m, torch.cat([m(x[:, i : i + 1], context=memory) for i in range(3)], 1))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("write", ["no_grad", "data", "load_state_dict"])
@pytest.mark.parametrize("again", [True, False], ids=["context-again", "cache-only"])
def test_a_context_cache_projects_the_kept_context_again_once_the_weights_changed(write, again):
    m = _module(causal=False, kv_dim=7)
    x, memory = torch.randn(2, 1, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    cache = ContextCache()
    m(x, context=memory, cache=cache)
    changed = {k: v * 2 for k, v in m.state_dict().items()}
    if write == "no_grad":  # an optimizer step
        with torch.no_grad():
            m.W_key.weight.mul_(2)
            m.W_value.weight.mul_(2)
    elif write == "data":  # a write autograd does not count
        m.W_key.weight.data.mul_(2)
        m.W_value.weight.data.mul_(2)
    else:
        m.load_state_dict(changed)
    got = m(x, context=memory if again else None, cache=cache)
    torch.testing.assert_close(got, m(x, context=memory), atol=1e-12, rtol=1e-12)  # the new weights' keys, not the kept ones


@pytest.mark.parametrize("write", ["load_state_dict", "scales in place"])
@pytest.mark.parametrize("again", [True, False], ids=["context-again", "cache-only"])
def test_an_int8_layers_context_cache_follows_its_weights_held_as_buffers(write, again):
    """``int8_weights`` holds the projections' int8 weights, scales and biases as buffers: a change to them projects the
    kept context again, as a float layer's parameters do."""
    from headwise.quantize import int8_weights

    torch.manual_seed(0)
    m, other = (int8_weights(hw.MultiHeadAttention(16, 16, 32, 0.0, num_heads=4, causal=False, kv_dim=8).eval()) for _ in range(2))
    x, memory, cache = torch.randn(2, 1, 16), torch.randn(2, 5, 8), ContextCache()
    with torch.no_grad():
        m(x, context=memory, cache=cache)
        if write == "load_state_dict":
            m.load_state_dict(other.state_dict())
        else:
            m.W_key.scales.mul_(3)
        want = m(x, context=memory)  # no cache: the new weights' keys
        assert torch.equal(m(x, context=memory if again else None, cache=cache), want)


def test_a_context_cache_filled_in_another_dtype_is_refused_by_name():
    m = _module(causal=False, kv_dim=7)
    x, memory, cache = torch.randn(2, 1, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64), ContextCache()
    m(x, context=memory, cache=cache)
    m.float()
    with pytest.raises(TypeError, match=r"this ContextCache was filled with a torch.float64 context on cpu; MultiHeadAttention's "
                                        r"parameters are now torch.float32 on cpu: pass context= again \(it is projected again\), or cache.reset\(\)"):
        m(x.float(), cache=cache)
    assert len(cache) == 6 and cache.context is not None  # refused: the cache as it was
    torch.testing.assert_close(m(x.float(), context=memory.float(), cache=cache), m(x.float(), context=memory.float()))


def test_a_context_cache_belongs_to_one_layer():
    first, second = _module(causal=False, kv_dim=7), _module(seed=1, causal=False, kv_dim=7)
    x, memory = torch.randn(2, 1, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    cache = ContextCache()
    first(x, context=memory, cache=cache)
    keys = cache.k
    with pytest.raises(ValueError, match=r"this ContextCache belongs to MultiHeadAttention at 0x[0-9a-f]+, not to MultiHeadAttention"):
        second(x, cache=cache)  # would have attended over the first layer's keys
    with pytest.raises(ValueError, match=r"this ContextCache belongs to"):
        second(x, context=memory, cache=cache)
    assert cache.k is keys
    cache.reset()  # forgets the context, keeps the owner
    with pytest.raises(ValueError, match=r"this ContextCache belongs to"):
        second(x, context=memory, cache=cache)


def test_a_context_cache_given_another_context_attends_over_that_one(monkeypatch):
    m = _module(causal=False, kv_dim=7)
    x = torch.randn(2, 1, 12, dtype=torch.float64)
    one, other = torch.randn(2, 6, 7, dtype=torch.float64), torch.randn(2, 4, 7, dtype=torch.float64)
    real = torch.tensor([[True] * 4, [True] * 3 + [False]])
    calls = []
    project_kv = m.project_kv
    monkeypatch.setattr(m, "project_kv", lambda c: calls.append(c.shape[1]) or project_kv(c))
    cache = ContextCache()
    m(x, context=one, cache=cache)
    torch.testing.assert_close(m(x, context=other, cache=cache), m(x, context=other), rtol=0, atol=0)  # not the stored one
    torch.testing.assert_close(m(x, cache=cache), m(x, context=other), rtol=0, atol=0)  # and it is stored now
    calls.clear()
    m(x, context=other.clone(), cache=cache)  # equal values: the stored keys serve
    assert calls == []
    torch.testing.assert_close(m(x, context=other, context_mask=real, cache=cache), m(x, context=other, context_mask=real), rtol=0, atol=0)
    calls.clear()
    with torch.no_grad():
        other[0, 0] += 1.0  # the stored context changed in place: projected again
    torch.testing.assert_close(m(x, context=other, context_mask=real, cache=cache), m(x, context=other, context_mask=real), rtol=0, atol=0)
    assert calls == [4, 4]
    with pytest.raises(ValueError, match=r"context_mask differs from the padding this ContextCache was filled with"):
        m(x, context_mask=torch.ones(2, 4, dtype=torch.bool), cache=cache)
    m(x, context_mask=real, cache=cache)  # the same padding is fine


@pytest.mark.parametrize("write", ["data", "numpy", "no_grad"])
def test_a_context_written_in_place_behind_autograds_back_is_projected_again(write):
    """A write through ``.data`` or a numpy array sharing the context's memory leaves its version counter as it was: the
    cache still sees it (a sample of its bytes) and attends over the context as it is now, with it passed or without."""
    m = _module(causal=False, kv_dim=7)
    x, memory = torch.randn(2, 3, 12, dtype=torch.float64), torch.randn(2, 6, 7, dtype=torch.float64)
    cache = ContextCache()
    m(x, context=memory, cache=cache)
    {"data": lambda: memory.data.mul_(3.0), "numpy": lambda: memory.numpy().__setitem__(slice(None), 0.5),
     "no_grad": lambda: torch.no_grad()(memory.mul_)(3.0)}[write]()
    want = m(x, context=memory)
    torch.testing.assert_close(m(x, context=memory, cache=cache), want, rtol=0, atol=0)
    torch.testing.assert_close(m(x, cache=cache), want, rtol=0, atol=0)  # the keys kept are the new context's


def test_a_refused_cross_attention_call_leaves_the_context_cache_empty():
    m = _module(causal=False, kv_dim=7, sinks=True)
    m.sinks = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))  # refused by attention, after the projection
    cache = ContextCache()
    with pytest.raises(ValueError, match=r"sinks must have shape"):
        m(torch.randn(2, 1, 12, dtype=torch.float64), context=torch.randn(2, 6, 7, dtype=torch.float64), cache=cache)
    assert len(cache) == 0 and cache._owner is None


@pytest.mark.parametrize(
    ("make", "call", "error", "match"),
    [
        ({"kv_dim": 7}, {"context": torch.randn(2, 6, 7)}, ValueError, r"cross-attention .* is not causal.*causal=False, got causal=True"),
        ({"kv_dim": 7, "causal": False}, {}, ValueError, r"keys come from a context of width kv_dim=7 .*: pass context="),
        ({"kv_dim": 7, "causal": False}, {"context": torch.randn(2, 6, 5)}, ValueError, r"context must have shape \(batch, tokens, kv_dim=7\), got \(2, 6, 5\)"),
        ({"kv_dim": 7, "causal": False}, {"context": torch.randn(3, 6, 7)}, ValueError, r"context must have the batch size of x \(2\)"),
        ({"causal": False, "alibi": True}, {"context": torch.randn(2, 6, 12)}, ValueError, r"ALiBi .* cannot take a context"),
        ({"causal": False}, {"context": torch.randn(2, 6, 12), "cache": hw.KVCache(2, 4, 8, 3)}, TypeError, r"takes a headwise.ContextCache"),
        ({"causal": False}, {"cache": ContextCache()}, ValueError, r"needs context= .* the first time \(an empty ContextCache holds nothing yet\)"),
        ({"causal": False}, {"context_mask": torch.ones(2, 6, dtype=torch.bool)}, ValueError, r"needs context= .* the first time \(no cache given\)"),
        ({}, {"cache": ContextCache()}, ValueError, r"cross-attention \(a ContextCache given\) is not causal.*; for self-attention pass a KVCache, or no cache"),
        ({"causal": False}, {"context": torch.randn(2, 6, 12), "context_mask": torch.ones(2, 5)}, ValueError, r"context_mask must have shape \(B, S\) = \(2, 6\)"),
    ],
)
def test_cross_attention_errors(make, call, error, match):
    m = hw.MultiHeadAttention(12, 12, 32, 0.0, num_heads=4, **make)
    with pytest.raises(error, match=match):
        m(torch.randn(2, 5, 12), **call)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"softcap": 0}, ValueError, r"softcap must be a number in \[1e-06, 1e\+30\]"),
        ({"sinks": 1}, TypeError, r"sinks must be True or False, got 1"),
        ({"alibi": "yes"}, TypeError, r"alibi must be True or False, got 'yes'"),
        ({"kv_dim": 0}, ValueError, r"kv_dim must be a positive int, got 0"),
    ],
)
def test_module_argument_errors(kw, error, match):
    with pytest.raises(error, match=match):
        hw.MultiHeadAttention(12, 12, 32, 0.0, num_heads=4, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_packed_module_row_equals_each_document_alone(backend):
    m = _module(backend=backend, sinks=True, num_kv_heads=2)
    x = torch.randn(1, 9, 12, dtype=torch.float64)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2]])
    packed = m(x, documents=docs)
    alone = torch.cat([m(x[:, a:b]) for a, b in ((0, 4), (4, 6), (6, 9))], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=r"documents \(packed rows\) apply to self-attention"):
        _module(causal=False)(x, context=x, documents=docs)


def test_explain_shows_each_term():
    from headwise.explain import explain

    _, steps = explain(num_tokens=5, softcap=2.0, sinks=True, alibi=True, documents=[2, 3])
    step = steps[7]
    assert list(step.tensors) == ["capped_scores", "masked_scores", "alibi_bias", "weights", "sink_share"]
    assert "tanh" in step.code and "sink" in step.code and "other documents" in step.title
    torch.testing.assert_close(step.tensors["sink_share"], 1 - step.tensors["weights"].sum(-1))
    assert step.tensors["masked_scores"][0, :, 2:, :2].eq(float("-inf")).all()  # document 2 never sees document 1
    assert step.tensors["capped_scores"].abs().max() < 2.0
    with pytest.raises(ValueError, match=r"documents must be positive lengths adding up to num_tokens=5, got \[2, 2\]"):
        explain(num_tokens=5, documents=[2, 2])


def test_a_context_cache_under_inference_mode_weights_projects_every_call():
    # inference tensors keep no version: the cache cannot tell an in-place write, so it projects again each call
    torch.manual_seed(0)
    with torch.inference_mode():
        cross = hw.MultiHeadAttention(32, 32, 64, 0.0, 4, True, causal=False, kv_dim=16).eval()
        x, ctx = torch.randn(1, 3, 32), torch.randn(1, 5, 16)
        cache = ContextCache()
        torch.testing.assert_close(cross(x, context=ctx, cache=cache), cross(x, context=ctx), rtol=0, atol=0)
        cross.W_key.weight.mul_(2.0)  # unseen by any version counter
        torch.testing.assert_close(cross(x, cache=cache), cross(x, context=ctx), rtol=0, atol=0)
