"""Whatever sits at a padded position (NaN, Inf) cannot change a real token's output or gradient.

Each test runs the same computation twice, once with clean padding and once with poison at
every padded position, and compares the real rows' outputs and every gradient that reaches
real positions or parameters (float64, both backends).
"""

from __future__ import annotations

import math

import pytest
import torch

import headwise as hw

POISONS = [math.nan, math.inf, -math.inf]


def padding(B=2, T=6):
    real = torch.ones(B, T, dtype=torch.bool)
    real[0, :2] = False  # left padding
    real[1, 4:] = False  # right padding
    return real


def run_module(m, x, real, **kw):
    x = x.clone().requires_grad_(True)
    m.zero_grad()
    y = m(x, attention_mask=real, **kw)
    w = torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)
    (y[real] * w).sum().backward()  # a loss over the real rows only
    return y[real].detach(), x.grad[real], [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize(("kind", "causal"), [("mha", True), ("mha", False), ("gpt2", True), ("causal", True), ("causal", False)])
def test_module_padding_is_inert(kind, causal, backend, poison):
    torch.manual_seed(0)
    if kind == "mha":
        m = hw.MultiHeadAttention(8, 8, 16, 0.0, 2, qkv_bias=True, causal=causal, backend=backend)
    elif kind == "gpt2":
        m = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0), backend=backend)
    else:
        m = hw.CausalAttention(8, 4, 16, 0.0, qkv_bias=True, causal=causal, backend=backend)
    m = m.double()
    real = padding()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    bad = x.clone()
    bad[~real] = poison
    clean, poisoned = run_module(m, x, real), run_module(m, bad, real)
    for a, b in zip([clean[0], clean[1], *clean[2]], [poisoned[0], poisoned[1], *poisoned[2]], strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("where", ["k", "v", "both"])
def test_core_padded_keys_and_values_are_inert(where, backend, poison):
    torch.manual_seed(1)
    real = padding(2, 5)
    q = torch.randn(2, 4, 3, 6, dtype=torch.float64)  # (B, H, T, D)
    k, v = torch.randn(2, 2, 5, 6, dtype=torch.float64), torch.randn(2, 2, 5, 6, dtype=torch.float64)  # (B, Hkv, S, D)

    def run(k, v):
        q_, k_, v_ = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = hw.attention(q_, k_, v_, causal=True, attention_mask=real, backend=backend)
        out.sum().backward()
        return out.detach(), q_.grad, k_.grad, v_.grad

    bad_k, bad_v = k.clone(), v.clone()
    pad = ~real[:, None, :, None].expand_as(k)
    if where in ("k", "both"):
        bad_k[pad] = poison
    if where in ("v", "both"):
        bad_v[pad] = poison
    (o1, gq1, gk1, gv1), (o2, gq2, gk2, gv2) = run(k, v), run(bad_k, bad_v)
    for a, b in [(o1, o2), (gq1, gq2), (gk1, gk2), (gv1, gv2)]:
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)
    w1 = hw.attention_weights(q, k, causal=True, attention_mask=real)
    w2 = hw.attention_weights(q, bad_k, causal=True, attention_mask=real)
    torch.testing.assert_close(w2, w1, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("poison", POISONS)
def test_padding_in_a_cached_prefill_is_inert_in_later_steps(poison):
    torch.manual_seed(2)
    m = hw.MultiHeadAttention(8, 8, 16, 0.0, 2, qkv_bias=True).double().eval()
    real = padding(2, 4)
    prompt = torch.randn(2, 4, 8, dtype=torch.float64)
    steps = torch.randn(2, 3, 8, dtype=torch.float64)
    bad = prompt.clone()
    bad[~real] = poison
    outs = []
    for p in (prompt, bad):
        cache = hw.KVCache(2, 2, 16, 4, dtype=torch.float64)
        with torch.no_grad():
            first = m(p, attention_mask=real, cache=cache)[real]
            outs.append(torch.cat([first, *[m(steps[:, i : i + 1], cache=cache).flatten(0, 1) for i in range(3)]]))
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_a_decode_steps_padded_keys_are_inert_without_a_copy_in_the_decode_kernel(grad, dtype, poison):
    """One query a row over keys of its own (no cache) with padding: the C++ decode kernel (no autograd) reads no padded
    key's row; every other runner (here autograd's) takes the keys with their padded rows zeroed. The caller's tensors
    are not written."""
    from headwise.backends import decode_kernel, plan

    torch.manual_seed(3)
    real = torch.ones(3, 40, dtype=torch.bool)
    real[0, :9], real[1, 30:], real[2, ::3] = False, False, False  # left, right, and holes
    q = torch.randn(3, 6, 1, 64).to(dtype)  # (B, H, 1, D)
    k, v = torch.randn(3, 2, 40, 64).to(dtype), torch.randn(3, 2, 40, 64).to(dtype)  # (B, Hkv, S, D)
    bad_k, bad_v = (t.masked_fill(~real[:, None, :, None], poison) for t in (k, v))
    kept = bad_k.clone(), bad_v.clone()
    with torch.set_grad_enabled(grad):
        q_ = q.clone().requires_grad_(grad)
        runner = hw.plan(q_, k, v, causal=True, attention_mask=real).runner
        assert (runner == plan.DECODE_KERNEL) == (not grad and decode_kernel.available())
        clean, poisoned = (hw.attention(q_, a, b, causal=True, attention_mask=real) for a, b in ((k, v), (bad_k, bad_v)))
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)
    assert torch.equal(bad_k.nan_to_num(), kept[0].nan_to_num()) and torch.equal(bad_v.nan_to_num(), kept[1].nan_to_num())


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["", "softcap"])
def test_a_prompts_padded_keys_are_inert_in_every_runner_it_may_take(softcap, dtype, poison):
    """A padded prompt over keys of its own (no cache), no autograd: the C++ prompt kernel where this machine runs it
    (it reads no padded key's row), another runner elsewhere (the keys' padded rows zeroed first): either way the
    real queries' outputs are the clean ones'."""
    torch.manual_seed(4)
    real = torch.ones(3, 96, dtype=torch.bool)
    real[0, :30], real[1, 70:], real[2, 40:50] = False, False, False  # left, right, a hole
    q = torch.randn(3, 4, 96, 64).to(dtype)  # (B, H, T, D)
    k, v = torch.randn(3, 2, 96, 64).to(dtype), torch.randn(3, 2, 96, 64).to(dtype)  # (B, Hkv, S, D)
    bad_k, bad_v = (t.masked_fill(~real[:, None, :, None], poison) for t in (k, v))
    with torch.no_grad():
        clean, poisoned = (hw.attention(q, a, b, causal=True, attention_mask=real, softcap=softcap) for a, b in ((k, v), (bad_k, bad_v)))
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)

