"""Random calls of ``headwise.attention`` against the float64 reference, run in a child process.

Each example draws shapes (0 included for B, T and S), a dtype, a backend and any mix of the
terms (causal, window, padding, a mask, softcap, sinks with -inf entries, ALiBi, documents,
scale), fed at once or through a cache (``KVCache``, a sliding one, a ``PagedKVCache`` batch)
in chunks. The answer must match ``reference_variants.variant_attention`` on the same (rounded)
inputs, be finite everywhere (a query that sees no key gets zeros), and so must the gradients
where autograd runs; ``attention(..., backend=plan.backend)`` must equal "auto" bit for bit. ``run(n)`` checks n examples and raises hypothesis' falsifying example;
``tests/test_fuzz_core.py`` calls it in a child process, so a crash in a kernel fails the test
and not the run. Each example is written to stderr before it runs: the last one names a crash.
"""

from __future__ import annotations

import math
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_variants import variant_attention

import headwise as hw

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
#: Largest absolute error allowed against the reference, for values of size ~1 (bfloat16: its
#: own error is judged elsewhere against plain code in the same dtype; here it must stay sane).
ATOL = {torch.float64: 1e-9, torch.float32: 5e-5, torch.bfloat16: 0.15}


@st.composite
def cases(draw) -> dict:
    """One call: its inputs in float64, the terms, a dtype, a backend and a way of feeding it."""
    feed = draw(st.sampled_from(["whole", "whole", "kv", "ring", "paged"]))
    dtype = DTYPES[draw(st.sampled_from(list(DTYPES)))]
    B = 1 if feed == "paged" else draw(st.integers(0 if feed == "whole" else 1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    S = draw(st.integers(1 if feed != "whole" else 0, 7))
    D = draw(st.integers(1, 5))
    Dv = D if feed != "whole" else draw(st.sampled_from([D, draw(st.integers(1, 4))]))
    kw: dict = {"causal": draw(st.booleans()) or feed == "ring"}
    if kw["causal"] and (feed == "ring" or draw(st.booleans())):
        kw["window"] = draw(st.integers(1, 5))
    if feed == "ring" and kw["window"] >= S:
        kw["window"] = max(1, S - 1)  # a ring that wraps
    documents = feed in ("whole", "kv") and draw(st.booleans())
    T = S if feed != "whole" or documents else draw(st.integers(0, 7))
    if documents:
        T = draw(st.integers(0, S)) if feed == "whole" else S
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(B, Hkv, S, Dv, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0, 1e-6, 1e4, 1e30]))
    if draw(st.booleans()):
        sinks = torch.randn(H, generator=g, dtype=torch.float64)
        kw["sinks"] = sinks.masked_fill(torch.rand(H, generator=g) < 0.3, -math.inf)
    alibi = draw(st.sampled_from(["none", "none", "H", "BH"]))
    if alibi != "none":
        kw["alibi_slopes"] = torch.rand((H,) if alibi == "H" or feed == "paged" else (B, H), generator=g, dtype=torch.float64)
    if documents:
        cut = draw(st.integers(0, S))
        kw["documents"] = torch.tensor([[0] * cut + [1] * (S - cut)] * B, dtype=torch.long).view(B, S)
    if feed == "whole" and draw(st.integers(0, 3)) == 0:
        shape = draw(st.sampled_from([(T, S), (B, 1, T, S), (1, H, 1, S)]))
        bias = torch.randn(shape, generator=g, dtype=torch.float64)
        kw["mask"] = bias.masked_fill(torch.rand(shape, generator=g) < 0.3, -math.inf) if draw(st.booleans()) else bias > -0.5
    if feed != "paged" and draw(st.booleans()):
        kw["attention_mask"] = torch.rand(B, S, generator=g) < 0.75
    if draw(st.integers(0, 3)) == 0:
        kw["scale"] = draw(st.floats(0.1, 2.0))
    chunks = [S]
    if feed != "whole" and kw["causal"]:  # in chunks: each query sees the keys so far, as causal says
        first = draw(st.integers(1, S))
        chunks = [first] + [1] * (S - first) if draw(st.booleans()) else [S]
    return {"q": q, "k": k, "v": v, "kw": kw, "dtype": dtype, "backend": draw(st.sampled_from(["math", "sdpa", "auto"])),
            "feed": feed, "chunks": chunks, "grad": feed == "whole" and dtype != torch.bfloat16 and draw(st.booleans())}


def _low(kw: dict, dtype: torch.dtype) -> dict:
    return {name: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for name, t in kw.items()}


def _fed(case: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict) -> torch.Tensor:
    """The context of every query, the tokens fed chunk by chunk through the case's cache."""
    feed, B, Hkv, S, D = case["feed"], k.shape[0], k.shape[1], k.shape[2], k.shape[3]
    if feed == "kv":
        cache = hw.KVCache(B, Hkv, S, D, dtype=q.dtype)
    elif feed == "ring":
        cache = hw.KVCache.sliding(B, Hkv, kw["window"], D, dtype=q.dtype)
    else:
        cache = hw.PagedKVCache(num_blocks=8, block_size=2, num_kv_heads=Hkv, head_dim=D, dtype=q.dtype)
        cache.add(0)
    outs, at = [], 0
    for n in case["chunks"]:
        step = dict(kw)
        if "attention_mask" in kw:
            step["attention_mask"] = kw["attention_mask"][:, at : at + n]
        if "documents" in kw:
            step["documents"] = kw["documents"][:, : at + n]
        where = cache.batch([0], [n]) if feed == "paged" else cache
        outs.append(hw.attention(q[:, :, at : at + n], k[:, :, at : at + n], v[:, :, at : at + n], cache=where, backend=case["backend"], **step))
        at += n
    return torch.cat(outs, dim=2)


def check(case: dict) -> None:
    """One example: the call against the reference, finite, and finite gradients where asked."""
    dtype, kw = case["dtype"], case["kw"]
    q, k, v = (case[name].to(dtype) for name in "qkv")
    low = _low(kw, dtype)
    print(f"{case['feed']} {dtype} {case['backend']} q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} "
          f"{ {n: (tuple(t.shape) if isinstance(t, torch.Tensor) else t) for n, t in kw.items()} }", file=sys.stderr, flush=True)
    leaves = [t.requires_grad_() for t in (q, k, v)] if case["grad"] else (q, k, v)
    if case["feed"] == "whole":
        out = hw.attention(*leaves, backend=case["backend"], **low)
    else:
        with torch.no_grad():
            out = _fed(case, q, k, v, low)
    B, H, T = q.shape[:3]
    assert out.shape == (B, H, T, v.shape[3]) and out.dtype == dtype, (out.shape, out.dtype)
    assert out.isfinite().all(), "NaN or inf in the context"
    if out.numel():
        ref_kw = {name: t.to(dtype).double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for name, t in kw.items()}
        want = variant_attention(q.detach().double(), k.detach().double(), v.detach().double(), **ref_kw)
        error = float((out.detach().double() - want).abs().max())
        assert error <= ATOL[dtype], f"error {error:.3g} > {ATOL[dtype]:g}"
    if case["feed"] == "whole" and not case["grad"]:  # the plan's backend runs what "auto" runs, bit for bit
        plan = hw.plan(q, k, v, **low)
        assert torch.equal(hw.attention(q, k, v, **low), hw.attention(q, k, v, backend=plan.backend, **low)), str(plan)
    if case["grad"] and out.numel():
        out.backward(torch.ones_like(out))
        assert all(t.grad.isfinite().all() for t in leaves), "NaN or inf in a gradient"


def run(max_examples: int) -> None:
    """Check ``max_examples`` random calls; hypothesis raises with the falsifying example."""
    settings(max_examples=max_examples, deadline=None, database=None)(given(case=cases())(check))()
