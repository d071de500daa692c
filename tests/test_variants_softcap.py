"""The softcap runner (backends/softcap.py): exact against the float64 reference, forward and
backward with every term it takes, and a backward that keeps no block's weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference_precise import error, precise_softcap_attention
from reference_variants import variant_attention
from test_variants import cut_fine

import headwise as hw


def _problem(B=2, H=4, Hkv=2, T=9, S=13, D=5, Dv=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype) * 2
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype) * 2
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=dtype)
    return q, k, v, g


def _grads(fn, q, k, v, sinks, g, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    out = fn(*leaves[:3], sinks=leaves[3], **kw)
    return [out, *torch.autograd.grad(out, leaves, g)]


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])
@pytest.mark.parametrize(
    "terms",
    [
        {"causal": True},
        {"causal": True, "window": 4},
        {"causal": False},
        {"causal": True, "alibi": True, "float_mask": True},
        {"causal": True, "bool_mask": True, "documents": True},
    ],
)
def test_forward_and_gradients_match_the_reference(terms, blocks):
    """Padding, GQA, sinks, T < S (cached keys) and the term's own mix; the bias takes no gradient (else autograd runs)."""
    q, k, v, g = _problem()
    B, H, T, S = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    kw = {"causal": terms["causal"], "softcap": 1.7, "attention_mask": torch.rand(B, S, generator=g) < 0.8}
    if "window" in terms:
        kw["window"] = terms["window"]
    if terms.get("alibi"):
        kw["alibi_slopes"] = torch.rand(B, H, generator=g, dtype=torch.float64)
    if terms.get("float_mask"):
        kw["mask"] = torch.randn(1, H, T, S, generator=g, dtype=torch.float64).masked_fill(torch.rand(1, H, T, S, generator=g) < 0.2, -math.inf)
    if terms.get("bool_mask"):
        kw["mask"] = torch.rand(B, 1, T, S, generator=g) < 0.7
    if terms.get("documents"):
        kw["documents"] = torch.tensor([[0] * 5 + [1] * 8, [3] * 13])
    grad_out = torch.randn(B, H, T, v.shape[-1], generator=g, dtype=torch.float64)
    with cut_fine(blocks):
        got = _grads(lambda *a, **k_: hw.attention(*a, backend="sdpa", **k_), q, k, v, sinks, grad_out, **kw)
    want = _grads(variant_attention, q, k, v, sinks, grad_out, **kw)
    for name, a, b in zip(["out", "q", "k", "v", "sinks"], got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


def test_the_backward_keeps_inputs_and_output_only():
    """Autograd over blocks would keep each block's (B, H, t, s) weights: O(H T S); this keeps O(H T D)."""
    q, k, v, _ = _problem(B=1, H=4, Hkv=4, T=256, S=256, D=8, Dv=8, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    leaves = [t.requires_grad_() for t in (q, k, v)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = hw.attention(*leaves, causal=True, softcap=30.0)
    assert type(out.grad_fn).__name__ == "CappedAttentionBackward"
    assert sum(saved) <= 4 * q.numel()  # q, k, v and the output; one head's scores alone are 256 * 256
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in leaves)


def test_dropout_and_a_trained_bias_go_to_autograd():
    q, k, v, _ = _problem()
    slopes = torch.rand(q.shape[1], dtype=torch.float64, requires_grad=True)
    assert hw.plan(q, k, v, causal=True, softcap=2.0, alibi_slopes=slopes).runner == "math blocks"
    with torch.no_grad():  # no gradient wanted: the bias is a constant
        assert hw.plan(q, k, v, causal=True, softcap=2.0, alibi_slopes=slopes).runner.startswith("capped blocks")
    assert hw.plan(q, k, v, causal=True, softcap=2.0, dropout_p=0.1).runner == "math blocks"
    assert hw.plan(q, k, v, causal=True, softcap=2.0).runner.startswith("capped blocks")


CAPS = [1e-3, 1e-1, 1.0, 30.0, 50.0, 1e3, 1e4, 1e8, 1e15, 1e30]


@pytest.fixture(scope="module")
def precise_answers():
    """A causal problem with scores of a few units and its 40-digit answer at every cap."""
    q, k, v, _ = _problem(B=1, H=2, Hkv=2, T=12, S=12, D=8, Dv=8, seed=3)
    return (q * 1.5, k * 1.5, v), {cap: precise_softcap_attention(q * 1.5, k * 1.5, v, softcap=cap, causal=True) for cap in CAPS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cap", CAPS)
def test_the_fast_path_is_as_exact_as_the_math_backend_at_every_cap(precise_answers, cap, dtype):
    """Error against 40-digit arithmetic within 2x the math backend's (a floor of 4 rounding steps of the output)."""
    (q, k, v), answers = precise_answers
    want = answers[cap]
    low = [t.to(dtype) for t in (q, k, v)]
    floor = 4 * torch.finfo(dtype).eps * float(want.abs().max())
    reference_error = max(error(hw.attention(*low, causal=True, softcap=cap, backend="math"), want), floor)
    with torch.no_grad():
        fast = hw.attention(*low, causal=True, softcap=cap, backend="sdpa")
    assert error(fast, want) <= 2 * reference_error, f"{error(fast, want):.3g} > 2 x {reference_error:.3g}"


@pytest.mark.parametrize("cap", [0.0, 9e-7, 1.1e30, 1e39, float("inf"), float("nan"), -1.0, np.float32(1e31), True, "50"])
def test_a_cap_no_runner_computes_exactly_is_refused_by_name(cap):
    q = torch.randn(1, 2, 3, 4)
    error = TypeError if isinstance(cap, (bool, str)) else ValueError  # the wrong type, or a number out of range
    with pytest.raises(error, match=r"softcap must be a number in \[1e-06, 1e\+30\] .* got"):
        hw.attention(q, q, q, softcap=cap)
    with pytest.raises(error, match=r"softcap must be a number in \[1e-06, 1e\+30\]"):
        hw.MultiHeadAttention(4, 4, 8, 0.0, num_heads=2, softcap=cap)


def test_a_numpy_cap_is_a_cap():
    q = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hw.attention(q, q, q, softcap=np.float32(30.0)), hw.attention(q, q, q, softcap=30.0), rtol=0, atol=0)


@pytest.mark.parametrize("cap", [1e-6, 1e30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_caps_at_both_ends_give_finite_numbers(cap, dtype):
    q, k, v, _ = _problem(dtype=dtype)
    for backend in ("math", "sdpa"):
        out = hw.attention(q, k, v, causal=True, softcap=cap, backend=backend)
        assert out.isfinite().all(), backend


def test_the_sinks_gradient_keeps_its_precision_where_the_share_is_small():
    """The sink's share read from the softmax, not as ``1 - sum(P)``: in float32 that sum cancels where
    the share is near 1e-6 of a row of 512 keys (the gradient was off by 0.66 relative)."""
    q, k, v, g = _problem(B=1, H=2, Hkv=2, T=512, S=512, D=8, Dv=8, dtype=torch.float32)
    sinks = torch.tensor([-8.0, -6.0])
    grad_out = torch.randn(1, 2, 512, 8, generator=g)
    got = _grads(lambda *a, **k_: hw.attention(*a, backend="sdpa", **k_), q, k, v, sinks, grad_out, causal=False, softcap=30.0)
    want = _grads(variant_attention, *(t.double() for t in (q, k, v, sinks, grad_out)), causal=False, softcap=30.0)
    relative = error(got[4], want[4]) / float(want[4].abs().max())
    assert relative < 1e-5, relative
