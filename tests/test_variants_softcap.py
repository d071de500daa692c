"""The softcap runner (backends/softcap.py): exact against the float64 reference, forward and
backward with every term it takes, and a backward that keeps no block's weights."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ERROR_RATIO
from reference_variants import variant_attention
from test_variants import cut_fine

import headwise as hw
from headwise.backends import softcap as softcap_backend


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
    q, k, _, _ = _problem()
    spec = hw.functional._spec(
        q, k, causal=True, window=None, mask=None, attention_mask=None, documents=None, softcap=2.0, sinks=None,
        alibi_slopes=torch.rand(q.shape[1], dtype=torch.float64, requires_grad=True), dropout_p=0.0, scale=1.0,
    )
    assert not softcap_backend.takes(spec)
    with torch.no_grad():  # no gradient wanted: the bias is a constant
        assert softcap_backend.takes(spec)
    spec.alibi, spec.dropout_p = None, 0.1
    assert not softcap_backend.takes(spec)


def test_float32_error_stays_at_the_plain_error_plus_the_sigmoid_rounding():
    """tanh through a sigmoid: a logit's absolute error grows to about cap * eps, documented; nothing more."""
    cap = 50.0
    for seed, (T, D) in enumerate([(64, 16), (256, 64)]):
        q, k, v, _ = _problem(B=2, H=4, Hkv=4, T=T, S=T, D=D, Dv=D, seed=seed)
        want = variant_attention(q, k, v, causal=True, softcap=cap)
        low = [t.float() for t in (q, k, v)]
        ours = (hw.attention(*low, causal=True, softcap=cap).double() - want).abs().max()
        logits = (low[0] @ low[1].transpose(-2, -1)) / math.sqrt(D)
        logits = (cap * torch.tanh(logits / cap)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        plain = (torch.softmax(logits, -1) @ low[2]).double().sub(want).abs().max()
        sigmoid_rounding = cap * torch.finfo(torch.float32).eps * v.abs().max()
        assert ours <= ERROR_RATIO * plain + sigmoid_rounding, f"{ours:.3g} > {ERROR_RATIO} x {plain:.3g} + {sigmoid_rounding:.3g}"
