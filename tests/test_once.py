"""Runners whose backward is a kernel's own give first-order gradients: under ``create_graph=True`` the same gradients,
and a second derivative through them names the runner and the way to one (``backend="math"``), never None or zeros."""

import pytest
import torch

from headwise import functional as F

VARIANTS = {"sinks": dict(sinks=True), "softcap": dict(softcap=5.0), "softcap and sinks": dict(softcap=5.0, sinks=True)}


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    sinks = torch.randn(2, generator=g, dtype=dtype).requires_grad_()
    return q, k, v, sinks


def _attention(q, k, v, sinks, variant, backend):
    kw = dict(VARIANTS[variant])
    if kw.pop("sinks", False):
        kw["sinks"] = sinks
    return F.attention(q, k, v, causal=True, backend=backend, **kw)  # (1, 2, 5, 4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_first_derivative_under_create_graph_is_the_same(variant):
    q, k, v, sinks = _inputs(torch.float32)
    loss = _attention(q, k, v, sinks, variant, "auto").square().sum()
    plain = torch.autograd.grad(loss, (q, k, v), retain_graph=True)
    graphed = torch.autograd.grad(loss, (q, k, v), create_graph=True)
    for a, b in zip(plain, graphed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(("variant", "wrt"), [(v, w) for v in VARIANTS for w in ("k", "sinks") if w == "k" or "sinks" in VARIANTS[v]])
def test_second_derivative_is_refused_by_name(variant, wrt):
    q, k, v, sinks = _inputs(torch.float32)
    out = _attention(q, k, v, sinks, variant, "auto")
    assert type(out.grad_fn).__name__ in {"SinkAttentionBackward", "CappedAttentionBackward"}  # the kernel runners
    (gq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"second derivative through attention with .* backend='math'"):
        torch.autograd.grad(gq.sum(), {"k": k, "sinks": sinks}[wrt], allow_unused=True)


@pytest.mark.parametrize("variant", VARIANTS)
def test_math_backend_gives_second_derivatives(variant):
    q, k, v, sinks = _inputs(torch.float64)
    assert torch.autograd.gradgradcheck(lambda *t: _attention(*t, variant, "math"), (q, k, v, sinks))
