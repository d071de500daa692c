"""A decode step's attention traced by ``torch.compile`` on the CPU: the plan's "math, products summed (compiled)".

Under compile, one query per row that the C++ decode kernel does not take (a term it does not
compute, or the kernel not built: ``test_decode_kernel.py``) runs as broadcast products and sums
(``backends.math``'s ``summed``), which inductor fuses into loops: no fused-kernel call and no
matmul in the graph, and the numbers of the float64 reference with every term the math backend takes.
Here the kernel is off (as where it cannot be built), so that every call takes the loops.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference_variants import variant_attention

import headwise as hw
from headwise.backends import decode_kernel
from headwise.backends import math as math_backend

SUMMED = "math, products summed (compiled)"


@pytest.fixture(autouse=True)
def _without_the_kernel(monkeypatch):
    monkeypatch.setattr(decode_kernel, "available", lambda: False)


def _qkv(B=3, H=6, Hkv=2, S=40, D=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


PADDED = torch.arange(40).expand(3, 40) >= torch.tensor([[0], [15], [40]])  # (B, S): row 1 left-padded, row 2 sees no key

# name: (Hkv of H = 6, dtype, attention's terms)
CASES = {
    "G=1 float32": (6, torch.float32, {}),
    "G=3 bfloat16, padded, window": (2, torch.bfloat16, {"attention_mask": PADDED, "window": 12}),
    "G=3 float32, softcap, sinks, ALiBi": (2, torch.float32, {"softcap": 5.0, "sinks": torch.linspace(-1, 1, 6),
                                                              "alibi_slopes": torch.linspace(0.1, 0.6, 6)}),
    "G=1 bfloat16, float mask": (6, torch.bfloat16, {"mask": torch.linspace(-2, 0, 40).to(torch.bfloat16)}),
}


def test_the_plan_takes_products_summed_for_a_traced_decode_step_only(monkeypatch):
    q, k, v = _qkv()
    assert hw.plan(q, k, v, causal=True).runner != SUMMED  # eager
    monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)  # (as while Dynamo traces)
    assert hw.plan(q, k, v, causal=True).runner == SUMMED
    assert hw.plan(q, k, v, causal=True, backend="math").runner == SUMMED  # math's own way
    assert hw.plan(q, k, v, causal=True, backend="sdpa").runner != SUMMED
    assert hw.plan(*_qkv()[:1], k[:, :, :1].expand(3, 2, 1, 16), v[:, :, :1].expand(3, 2, 1, 16)).runner == SUMMED  # one key
    q2 = torch.randn(3, 6, 2, 16)  # two queries per row: not a decode step
    assert hw.plan(q2, k, v, causal=True).runner != SUMMED
    with torch.enable_grad():
        assert hw.plan(q.requires_grad_(), k, v, causal=True).runner != SUMMED  # autograd: a backward to keep
    assert hw.plan(q.detach(), k, v, causal=True, dropout_p=0.1).runner != SUMMED


@pytest.mark.parametrize("case", CASES)
def test_inductor_runs_the_step_as_loops_with_the_references_numbers(case):
    Hkv, dtype, terms = CASES[case]
    q, k, v = _qkv(Hkv=Hkv, dtype=dtype)
    traced = []

    def recording(gm, inputs):  # inductor, after noting what Dynamo traced
        from torch._inductor.compile_fx import compile_fx

        traced.extend(node.target for node in gm.graph.nodes)
        return compile_fx(gm, inputs)

    step = torch.compile(lambda q, k, v: hw.attention(q, k, v, causal=True, **terms), backend=recording, fullgraph=True)
    with torch.no_grad():
        out = step(q, k, v)  # (B, H, 1, D)
    assert F.scaled_dot_product_attention not in traced and torch.matmul not in traced
    want = variant_attention(q, k, v, causal=True, **terms)  # (B, H, 1, D) float64
    bound = 2**-8 if dtype == torch.bfloat16 else 2**-20  # one rounding to the output's dtype, float32 sums
    assert out.dtype == dtype
    assert float((out.double() - want).abs().max()) <= 2 * bound * float(want.abs().max())
    if "attention_mask" in terms:
        assert not out[2].any()  # a row that sees no key: zeros


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_other_backends_run_the_same_code_eagerly(backend):
    """``realized`` is inductor's prim where inductor registered it, a copy at most elsewhere: the same numbers."""
    q, k, v = _qkv(Hkv=2)
    rotated = lambda q: torch.cat([-q[..., 8:], q[..., :8]], -1) * 0.5 + q  # noqa: E731 (a pointwise query, as RoPE's)
    step = torch.compile(lambda q, k, v: hw.attention(rotated(q.transpose(2, 3).transpose(2, 3)), k, v, causal=True),
                         backend=backend, fullgraph=True)
    with torch.no_grad():
        out = step(q, k, v)
    want = variant_attention(rotated(q), k, v, causal=True)
    assert float((out.double() - want).abs().max()) <= 2**-19 * float(want.abs().max())


def test_realized_is_the_tensor_contiguous():
    x = torch.randn(2, 3, 4).transpose(1, 2)  # (2, 4, 3), not contiguous
    y = math_backend.realized(x)
    assert torch.equal(y, x) and y.is_contiguous()
    z = torch.compile(lambda x: math_backend.realized(x.sin()) * 2, fullgraph=True)(x)
    assert torch.allclose(z, x.sin() * 2) and z.is_contiguous()
