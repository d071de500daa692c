"""softcap, sinks, ALiBi and packed documents in headwise.attention, against the float64 reference.

Every term alone and together, with causal, windows, padding, masks and GQA, on every backend,
forward and backward; the fast paths (blocks of queries, the sink through the log-sum-exp,
one kernel call per document) against the same reference.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from helpers import ERROR_RATIO, on, tol
from hypothesis import given
from hypothesis import strategies as st
from reference_variants import variant_attention, variant_weights
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import headwise as hw
from headwise.backends import plan
from headwise.masks import documents_from_cu_seqlens, documents_from_position_ids
from headwise.scores import alibi_slopes

BACKENDS = ["math", "sdpa", "auto"]


def _documents(draw, g: torch.Generator, B: int, S: int) -> torch.Tensor:
    """(B, S) ids in contiguous runs, or (rarely) ids that come back after another id."""
    rows = []
    for _ in range(B):
        cuts = sorted(draw(st.sets(st.integers(1, max(1, S - 1)), max_size=3))) if S > 1 else []
        lengths = [b - a for a, b in zip([0, *cuts], [*cuts, S], strict=True)]
        rows.append(torch.cat([torch.full((n,), i + 7) for i, n in enumerate(lengths)]))
    ids = torch.stack(rows)  # (B, S)
    if draw(st.integers(0, 5)) == 0:
        ids = torch.randint(0, 2, (B, S), generator=g)  # not contiguous runs: the dense document mask
    return ids


@st.composite
def cases(draw, *, dtype=torch.float64, terms: bool = True):
    """A random problem with any mix of softcap, sinks, ALiBi and documents on top of the usual terms."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    S = draw(st.integers(1, 7))
    with_docs = draw(st.booleans())
    T = draw(st.integers(1, S)) if with_docs else draw(st.integers(1, 7))
    D = draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, draw(st.integers(1, 5)), generator=g, dtype=dtype)
    kw: dict = {"causal": draw(st.booleans())}
    if kw["causal"] and draw(st.booleans()):
        kw["window"] = draw(st.integers(1, 6))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.floats(0.3, 5.0))
    if draw(st.booleans()):
        kw["sinks"] = torch.randn(H, generator=g, dtype=dtype)
    alibi = draw(st.sampled_from(["none", "H", "BH"]))
    if alibi != "none":
        kw["alibi_slopes"] = torch.rand((H,) if alibi == "H" else (B, H), generator=g, dtype=dtype)
    if with_docs:
        kw["documents"] = _documents(draw, g, B, S)
    mask_kind = draw(st.sampled_from(["none", "none", "bool", "float"]))
    if mask_kind != "none":
        shape = draw(st.sampled_from([(T, S), (B, 1, T, S), (1, H, 1, S)]))
        if mask_kind == "bool":
            kw["mask"] = torch.rand(shape, generator=g) < 0.7
        else:
            bias = torch.randn(shape, generator=g, dtype=dtype)
            kw["mask"] = bias.masked_fill(torch.rand(shape, generator=g) < 0.2, -math.inf)
    if draw(st.booleans()):
        kw["attention_mask"] = torch.rand(B, S, generator=g) < 0.75
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.1, 2.0))
    return q, k, v, kw


@contextlib.contextmanager
def cut_fine(on: bool) -> Iterator[None]:
    """With ``on``: blocks of one query row and short documents batched (every chunked path cut as finely as it goes)."""
    if not on:
        yield
        return
    with mock.patch.object(plan, "BLOCK_ELEMENTS", 1), mock.patch.object(plan, "SHORT_DOCUMENT", 4):
        yield


BLOCKS = pytest.mark.parametrize("blocks", [False, True], ids=["whole", "blocks"])


@BLOCKS
@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases())
def test_every_term_matches_the_reference(backend, blocks, case, device):
    q, k, v, kw = case
    with cut_fine(blocks):
        got = hw.attention(*on(device, (q, k, v)), backend=backend, **on(device, kw)).cpu()
    torch.testing.assert_close(got, variant_attention(q, k, v, **kw), **tol(device, torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases(dtype=torch.float32))
def test_every_term_matches_the_reference_in_float32(backend, case):
    q, k, v, kw = case
    got = hw.attention(q, k, v, backend=backend, **kw)
    torch.testing.assert_close(got.double(), variant_attention(q, k, v, **kw), atol=2e-5, rtol=1e-5)


@given(case=cases())
def test_attention_weights_match_the_reference(case):
    q, k, _, kw = case
    torch.testing.assert_close(hw.attention_weights(q, k, **kw), variant_weights(q, k, **kw), atol=1e-12, rtol=1e-10)


def _grads(fn, q, k, v, kw, g):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    extra = {name: kw[name].detach().clone().requires_grad_() for name in ("sinks", "alibi_slopes") if name in kw}
    if "mask" in kw and kw["mask"].is_floating_point():
        extra["mask"] = kw["mask"].detach().clone().requires_grad_()
    out = fn(*leaves, **{**kw, **extra})
    wrt = [*leaves, *extra.values()]
    return dict(zip(["q", "k", "v", *extra], torch.autograd.grad(out, wrt, g, allow_unused=True), strict=True))


@BLOCKS
@pytest.mark.parametrize("backend", BACKENDS)
@given(case=cases())
def test_gradients_match_the_reference(backend, blocks, case):
    q, k, v, kw = case
    g = torch.randn((*q.shape[:3], v.shape[-1]), dtype=torch.float64)
    with cut_fine(blocks):
        got = _grads(lambda *a, **k_: hw.attention(*a, backend=backend, **k_), q, k, v, kw, g)
    want = _grads(variant_attention, q, k, v, kw, g)
    for name, w in want.items():
        grad = got[name]
        if w is None:
            continue
        assert grad is not None, f"no gradient reached {name}"
        torch.testing.assert_close(grad, w, atol=1e-9, rtol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("strided", ["q", "k", "v"])
@pytest.mark.parametrize("alibi", [False, True])
def test_sinks_on_inputs_whose_rows_are_strided(strided, alibi):
    """The sink's runners call torch's private CPU flash op, which reads a strided last dimension wrong (q's garbage
    reached 1e33): such an input is copied first; the answer and its gradients are the reference's."""
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (2, 4, 9, 8), "k": (2, 2, 9, 8), "v": (2, 2, 9, 8)}
    qkv = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    qkv[strided] = qkv[strided].mT.contiguous().mT  # the same values, the last dimension strided
    qkv = {n: t.requires_grad_() for n, t in qkv.items()}
    sinks = torch.randn(4, generator=g, requires_grad=True)
    kw = {"causal": True, "sinks": sinks} | ({"alibi_slopes": alibi_slopes(4)} if alibi else {})
    out = hw.attention(qkv["q"], qkv["k"], qkv["v"], **kw)
    wide = {n: t.detach().double().requires_grad_() for n, t in qkv.items()}
    sinks64 = sinks.detach().double().requires_grad_()
    want = variant_attention(wide["q"], wide["k"], wide["v"], **(kw | {"sinks": sinks64}))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, [*qkv.values(), sinks], grad)
    expected = torch.autograd.grad(want, [*wide.values(), sinks64], grad.double())
    for name, a, b in zip(["q", "k", "v", "sinks"], got, expected, strict=True):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ----------------------------------------------------------------------------- packed documents


def _packed_problem(lengths, *, H=4, Hkv=2, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    S = sum(lengths)
    q = torch.randn(1, H, S, D, generator=g, dtype=dtype)
    k = torch.randn(1, Hkv, S, D, generator=g, dtype=dtype)
    v = torch.randn(1, Hkv, S, D, generator=g, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return q, k, v, cu


@BLOCKS
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("terms", [{}, {"softcap": 2.0}, {"sinks": "H"}, {"alibi_slopes": "H"}, {"window": 3}])
def test_a_packed_row_equals_each_document_alone(backend, terms, blocks):
    lengths = [5, 1, 7, 3, 3]  # two of equal length, a one-token document
    q, k, v, cu = _packed_problem(lengths)
    kw = {"sinks": torch.randn(4, dtype=torch.float64)} if "sinks" in terms else {}
    kw |= {"alibi_slopes": alibi_slopes(4).double()} if "alibi_slopes" in terms else {}
    kw |= {key: value for key, value in terms.items() if key in ("softcap", "window")}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with cut_fine(blocks):
        packed_out = hw.attention(*leaves, causal=True, documents=documents_from_cu_seqlens(cu), backend=backend, **kw)
        g = torch.randn_like(packed_out)
        packed_grads = torch.autograd.grad(packed_out, leaves, g)
    alone_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        sl = [t[:, :, a:b] for t in alone_leaves]
        outs.append(hw.attention(*sl, causal=True, backend="math", **kw))
    alone = torch.cat(outs, dim=2)
    alone_grads = torch.autograd.grad(alone, alone_leaves, g)
    torch.testing.assert_close(packed_out, alone, atol=1e-12, rtol=1e-10)
    for got, want in zip(packed_grads, alone_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


class Kernels(TorchDispatchMode):
    """Inside the block: ``calls``, the aten ops of fused attention run (any SDPA kernel), and ``largest``,
    the most elements any op returned (a view counts: no tensor of that size needs to be built)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, ...]] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "scaled_dot_product" in func.__name__ and "backward" not in func.__name__:
            self.calls.append(tuple(args[0].shape))
        self.largest = max([self.largest] + [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)])
        return out


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_a_packed_row_makes_the_kernel_calls_of_its_documents_alone(grad):
    """No (T, S) mask and no (H, T, S) scores: each document runs as it would alone (a long causal one in blocks)."""
    q, k, v, cu = _packed_problem([200, 300, 150], dtype=torch.float32)
    leaves = [t.requires_grad_(grad) for t in (q, k, v)]
    with torch.set_grad_enabled(grad), Kernels() as packed_row:
        hw.attention(*leaves, causal=True, documents=documents_from_cu_seqlens(cu), backend="sdpa")
    alone = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        with torch.set_grad_enabled(grad), Kernels() as one:
            hw.attention(*(t[:, :, a:b] for t in leaves), causal=True, backend="sdpa")
        alone += one.calls
    assert packed_row.calls == alone
    blocked = not grad and not plan.mkl_avx512()  # a causal prompt runs as a few blocks of queries (not on Intel's MKL)
    blocks = [min(r, t - r0) for t in (200, 300, 150) for r in [plan.causal_rows(t)] for r0 in range(0, t, r)]
    assert [shape[2] for shape in alone] == (blocks if blocked else [200, 300, 150])
    assert blocks == [64] * 3 + [8] + [75] * 4 + [64] * 2 + [22]


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_documents_never_build_scores_of_the_whole_row(backend):
    """Every backend, math too: the largest tensor is one document's scores (or the inputs), not (H, T, S)."""
    lengths = [150] * 5  # each above SHORT_DOCUMENT: run alone
    q, k, v, cu = _packed_problem(lengths, H=2, Hkv=2, D=8, dtype=torch.float32)
    with torch.no_grad(), Kernels() as seen:
        hw.attention(q, k, v, causal=True, documents=documents_from_cu_seqlens(cu), backend=backend)
    one_document = 2 * 150 * 150  # H * T_i * S_i
    assert seen.largest <= max(2 * one_document, q.numel()), f"{seen.largest} elements; the whole row's scores are {2 * 750 * 750}"


def test_short_documents_of_one_length_share_a_call():
    q, k, v, cu = _packed_problem([4, 4, 4, 9, 4], dtype=torch.float32)
    with Kernels() as seen:
        hw.attention(q, k, v, causal=True, documents=documents_from_cu_seqlens(cu), backend="sdpa")
    assert sorted(seen.calls) == [(1, 4, 9, 8), (4, 4, 4, 8)]  # four documents of 4 tokens in one batched call, the 9 alone


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_step_on_a_packed_row_equals_the_full_forward(backend):
    q, k, v, cu = _packed_problem([4, 3, 5])
    docs = documents_from_cu_seqlens(cu)  # (1, 12)
    kw = {"softcap": 3.0, "sinks": torch.randn(4, dtype=torch.float64), "alibi_slopes": torch.rand(4, dtype=torch.float64)}
    full = hw.attention(q, k, v, causal=True, documents=docs, backend=backend, **kw)
    cache = hw.KVCache(1, 2, 16, 8, dtype=torch.float64)
    hw.attention(q[:, :, :11], k[:, :, :11], v[:, :, :11], causal=True, documents=docs[:, :11], cache=cache, backend=backend, **kw)
    step = hw.attention(q[:, :, 11:], k[:, :, 11:], v[:, :, 11:], causal=True, documents=docs, cache=cache, backend=backend, **kw)
    torch.testing.assert_close(step, full[:, :, 11:], atol=1e-12, rtol=1e-10)


def test_document_helpers():
    ids = documents_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]]))
    assert ids.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 1, 1]]
    assert documents_from_cu_seqlens(torch.tensor([0, 2, 2, 5])).tolist() == [[0, 0, 2, 2, 2]]


# ----------------------------------------------------------------------------- rows that see nothing


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("term", ["softcap", "sinks", "alibi_slopes", "documents"])
def test_a_query_that_sees_no_key_gets_zero_without_nan(backend, dtype, term):
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    real = torch.tensor([[False, True, True, True]])  # query 0 sees only key 0, which is padding
    kw = {"softcap": 2.0, "sinks": torch.zeros(2, dtype=dtype, requires_grad=True), "alibi_slopes": torch.ones(2, dtype=dtype),
          "documents": torch.tensor([[0, 0, 1, 1]])}
    out = hw.attention(q, k, v, causal=True, attention_mask=real, backend=backend, **{term: kw[term]})
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.isfinite().all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_sink_of_minus_inf_is_no_sink_even_where_a_query_sees_no_key(backend, softcap, dtype):
    """A head with sink -inf attends as without sinks: a query that sees no key gets zeros, not NaN."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([-math.inf, 0.5], dtype=torch.float64)
    kw = {"causal": True, "attention_mask": torch.tensor([[False, True, True, True]]), "softcap": softcap}
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = hw.attention(*leaves, sinks=sinks.to(dtype).requires_grad_(), backend=backend, **kw)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))  # query 0 sees only the padded key 0
    if dtype != torch.bfloat16:  # (bfloat16: its error is judged against plain code elsewhere; here, no NaN)
        torch.testing.assert_close(out.double(), variant_attention(q, k, v, sinks=sinks, **kw), **tol("cpu", dtype))
        torch.testing.assert_close(out[:, 0].double(), variant_attention(q, k, v, **kw)[:, 0], **tol("cpu", dtype))  # head 0: no sink
    out.sum().backward()
    assert all(t.grad.isfinite().all() for t in leaves)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alibi_of_float32_slopes_on_float64_inputs_is_float64_exact(backend):
    """The bias -slope * distance in the scores' dtype: float32 slopes (``alibi_slopes``) must not round a float64 call."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 4, 96, 8, generator=g, dtype=torch.float64) for _ in range(3))
    slopes = alibi_slopes(4) * 3.3  # float32, not exact in binary: its products with distances round in float32
    got = hw.attention(q, k, v, causal=True, alibi_slopes=slopes, backend=backend)
    torch.testing.assert_close(got, variant_attention(q, k, v, causal=True, alibi_slopes=slopes), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["padding", "bool mask", "float mask"])
@pytest.mark.parametrize("sinks", [None, -52.0], ids=["no-sink", "sink"])  # a sink level with the kept keys
def test_alibi_over_far_keys_in_half_precision_keeps_the_precision_of_math(dtype, mask, sinks):
    """Where the keys that carry the weight lie far from the query (the near ones padded or masked away), their ALiBi
    bias is large: narrowed to a 16-bit dtype as it stands it rounds by 0.5-1 (bfloat16 at 64-256), so the fused
    blocks take each row's largest bias off first (with a sink, its share then of the row's logits as given). Every
    backend within twice math's error of float64 here, the sink's gradient too."""
    g = torch.Generator().manual_seed(0)
    S, T, D = 200, 2, 8  # D = 8 and two queries: not the prompt kernel's, the fused blocks'
    q, k, v = (torch.randn(1, 1, n, D, generator=g).to(dtype) for n in (T, S, S))
    slopes = torch.tensor([0.37])
    near = torch.zeros(1, S, dtype=torch.bool)
    near[0, :60] = True  # the keys kept lie 140 or more positions before the queries
    kw = {"padding": {"attention_mask": near}, "bool mask": {"mask": near[:, None, None, :].expand(1, 1, T, S)},
          "float mask": {"mask": torch.zeros(1, 1, T, S).masked_fill(~near[:, None, None, :], -math.inf)}}[mask]
    if sinks is not None:
        sink = torch.tensor([sinks], requires_grad=True)
        kw["sinks"] = sink
    want = variant_attention(q.double(), k.double(), v.double(), alibi_slopes=slopes, **kw)
    errors, grads = {}, {}
    for backend in ("math", "sdpa", "auto"):
        out = hw.attention(q, k, v, alibi_slopes=slopes, backend=backend, **kw)
        errors[backend] = float((out.double() - want).abs().max())
        if sinks is not None:
            grads[backend] = torch.autograd.grad(out.float().sum(), sink)[0]
    assert errors["sdpa"] <= 2 * errors["math"] + 1e-3 and errors["auto"] <= 2 * errors["math"] + 1e-3, errors
    if sinks is not None:
        exact = torch.autograd.grad(want.sum(), sink)[0].double()
        off = {backend: float((grad.double() - exact).abs().max()) for backend, grad in grads.items()}
        assert off["sdpa"] <= 2 * off["math"] + 1e-2 * float(exact.abs().max()) and off["auto"] <= 2 * off["math"] + 1e-2 * float(exact.abs().max()), off


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("B", "T", "S", "terms"),
    [
        (1, 0, 0, {"documents": torch.zeros(1, 0, dtype=torch.long)}),  # no keys, no documents
        (1, 0, 5, {"alibi_slopes": torch.ones(2)}),  # no queries
        (0, 4, 4, {"softcap": 2.0}),  # no rows
        (0, 4, 4, {"alibi_slopes": torch.ones(0, 2)}),
        (1, 3, 0, {"softcap": 2.0, "alibi_slopes": torch.ones(2)}),  # queries that see no key: zeros
    ],
)
def test_empty_calls_give_empty_or_zero_answers(backend, B, T, S, terms):
    q, k, v = torch.randn(B, 2, T, 4), torch.randn(B, 2, S, 4), torch.randn(B, 2, S, 3)
    out = hw.attention(q, k, v, causal=True, backend=backend, **terms)
    assert out.shape == (B, 2, T, 3) and torch.equal(out, torch.zeros_like(out)) == (S == 0 or out.numel() == 0)


# ----------------------------------------------------------------------------- low precision


def _plain(q, k, v, *, causal, softcap=None, sinks=None, alibi_slopes=None):
    """The naive way in q's own dtype (no float32 anywhere): the yardstick for low precision."""
    T, S = q.shape[2], k.shape[2]
    logits = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if alibi_slopes is not None:
        logits = logits - alibi_slopes.to(q.dtype)[:, None, None] * (torch.arange(T)[:, None] + S - T - torch.arange(S)).abs().to(q.dtype)
    if causal:
        logits = logits.masked_fill(torch.ones(T, S, dtype=torch.bool).tril(S - T).logical_not(), -math.inf)
    if sinks is not None:
        logits = torch.cat([logits, sinks.to(q.dtype)[None, :, None, None].expand(*logits.shape[:3], 1)], -1)
        return torch.softmax(logits, -1)[..., :-1] @ v
    return torch.softmax(logits, -1) @ v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("term", ["softcap", "sinks", "alibi_slopes"])
def test_low_precision_within_k_times_plain_error(dtype, backend, term):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g, dtype=torch.float64) for _ in range(3))
    kw = {"softcap": 1.5, "sinks": torch.randn(4, generator=g, dtype=torch.float64), "alibi_slopes": alibi_slopes(4).double()}
    kw = {term: kw[term]}
    want = variant_attention(q, k, v, causal=True, **kw)
    low = [t.to(dtype) for t in (q, k, v)]
    low_kw = {key: value.to(dtype) if isinstance(value, torch.Tensor) else value for key, value in kw.items()}
    ours = (hw.attention(*low, causal=True, backend=backend, **low_kw).double() - want).abs().max()
    plain = (_plain(*low, causal=True, **low_kw).double() - want).abs().max()
    assert ours <= ERROR_RATIO * plain, f"{ours:.3g} > {ERROR_RATIO} x {plain:.3g}"


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_bfloat16_alibi_over_far_keys_is_as_exact_as_the_dtype(grad, sinks):
    """Peaked heads with small slopes put their weight on keys far back, where the bias is -16 .. -64 (a bfloat16 step
    there is 0.125 .. 0.25): every runner, the C++ kernel without autograd and the fused blocks with it, adds the bias
    in float32, so the output is within twice its own rounding to bfloat16."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 512, 64, generator=g) * 12
    k, v = (torch.randn(1, 4, 512, 64, generator=g) for _ in range(2))
    q, k, v = (t.bfloat16() for t in (q, k, v))
    kw = {"alibi_slopes": torch.tensor([2.0**-4, 2.0**-5, 2.0**-6, 2.0**-7])} | ({"sinks": torch.zeros(4)} if sinks else {})
    want = variant_attention(q.double(), k.double(), v.double(), causal=True, **{key: t.double() for key, t in kw.items()})
    rounding = (want.bfloat16().double() - want).abs().max()
    got = hw.attention(q.clone().requires_grad_(grad), k, v, causal=True, **kw).double()
    assert (got - want).abs().max() <= 2 * rounding, hw.plan(q.clone().requires_grad_(grad), k, v, causal=True, **kw).runner


# ----------------------------------------------------------------------------- clear errors


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"softcap": 0.0}, ValueError, r"softcap must be a number in \[1e-06, 1e\+30\] .*, got 0.0"),
        ({"softcap": -1.0}, ValueError, r"softcap must be a number"),
        ({"softcap": float("nan")}, ValueError, r"softcap must be a number.*nan"),
        ({"softcap": True}, TypeError, r"softcap must be a number.*True"),
        ({"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(H=4,\), one per query head, got \(3,\)"),
        ({"sinks": torch.zeros(4, dtype=torch.long)}, TypeError, r"sinks must be a float tensor .* got dtype torch.int64"),
        ({"sinks": [0.0] * 4}, TypeError, r"sinks must be a float tensor .* got list"),
        ({"alibi_slopes": torch.zeros(2, 3)}, ValueError, r"alibi_slopes must have shape \(H=4,\) or \(B=2, H=4\), .* got \(2, 3\)"),
        ({"sinks": torch.tensor([0.0, math.nan, 0.0, 0.0])}, ValueError,
         r"sinks must hold finite numbers or -inf \(no sink on that head\), got \[0.0, nan, 0.0, 0.0\]"),
        ({"sinks": torch.tensor([0.0, math.inf, 0.0, 0.0])}, ValueError, r"sinks must hold finite numbers or -inf .*, got \[0.0, inf"),
        ({"alibi_slopes": torch.tensor([0.5, math.nan, 0.5, 0.5])}, ValueError, r"alibi_slopes must hold finite numbers whose bias -slope \* distance stays finite in torch.float32 at distances "
         r"up to 5 \(\|slope\| at most 6.806e\+37\), got \[0.5, nan"),
        ({"alibi_slopes": torch.tensor([0.5, -math.inf, 0.5, 0.5])}, ValueError, r"alibi_slopes must hold finite numbers whose bias .*, got \[0.5, -inf"),
        ({"alibi_slopes": torch.full((2, 4), math.inf)}, ValueError, r"alibi_slopes must hold finite numbers whose bias .*, got \[\[inf"),
        ({"alibi_slopes": torch.full((4,), 1e300, dtype=torch.float64)}, ValueError,  # float32's scores would take it as inf
         r"alibi_slopes must hold finite numbers in torch.float32 \(the scores' dtype\) whose bias .*, got \[1e\+300"),
        ({"sinks": torch.tensor([0.0, 1e39, 0.0, 0.0], dtype=torch.float64)}, ValueError,
         r"sinks must hold finite numbers in torch.float32 \(the scores' dtype\) or -inf \(no sink on that head\), got \[0.0, 1e\+39"),
        ({"alibi_slopes": torch.tensor([0.5, -2e38, 0.5, 0.5])}, ValueError,  # finite, but -slope * 2 is +inf in float32
         r"alibi_slopes must hold finite numbers whose bias .* \(\|slope\| at most 6.806e\+37\), got \[0.5, -1.99"),
        ({"documents": torch.zeros(2, 6)}, TypeError, r"documents must be an integer tensor .* got dtype torch.float32"),
        ({"documents": torch.zeros(2, 5, dtype=torch.long)}, ValueError, r"documents must have shape \(B, S\) = \(2, 6\).* got \(2, 5\)"),
        ({"documents": torch.zeros(2, 6, dtype=torch.bool)}, TypeError, r"documents must be an integer tensor"),
    ],
)
def test_bad_variant_arguments(kw, error, match):
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    with pytest.raises(error, match=match):
        hw.attention(q, k, v, causal=True, **kw)
    with pytest.raises(error, match=match):
        hw.attention_weights(q, k, causal=True, **kw)


def test_float64_terms_past_float32s_range_are_exact_where_the_scores_are_float64():
    """Sinks and slopes are checked in the dtype the scores are computed in: float64 queries (and keys) take float64
    values float32 cannot hold, and a float32 call takes a float64 -inf-bound sink as no sink."""
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=torch.float64) for _ in range(3))
    sinks, slopes = torch.full((2,), 1e300, dtype=torch.float64), torch.full((2,), 1e300, dtype=torch.float64)
    assert hw.attention(q, k, v, causal=True, sinks=sinks).abs().max() == 0  # the sink takes every weight
    torch.testing.assert_close(hw.attention(q, k, v, causal=True, alibi_slopes=slopes), v.expand(1, 2, 5, 8))  # each query its own key
    q32, k32, v32 = q.float(), k.float(), v.float()
    no_sink = hw.attention(q32, k32, v32, causal=True, sinks=-sinks)  # -1e300: -inf in float32's scores
    assert torch.equal(no_sink, hw.attention(q32, k32, v32, causal=True))


def test_documents_need_no_more_queries_than_keys():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"documents need T <= S .* got T=5 queries over S=3 keys"):
        hw.attention(q, k, k, documents=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunks", [[1] * 12, [5, 1, 1, 3, 1, 1], [3, 4, 5]])
def test_a_sliding_cache_with_alibi_and_documents_equals_the_reference(backend, chunks):
    """The ring hands a single new token its slots in ring order; ALiBi and documents read key positions, so they get time order."""
    torch.manual_seed(5)
    W, S = 4, 12
    q, k, v = torch.randn(1, 4, S, 8, dtype=torch.float64), torch.randn(1, 2, S, 8, dtype=torch.float64), torch.randn(1, 2, S, 8, dtype=torch.float64)
    docs = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3])  # (1, S)
    kw = {"alibi_slopes": torch.rand(4, dtype=torch.float64), "softcap": 3.0, "sinks": torch.randn(4, dtype=torch.float64)}
    everything = ({"documents": docs, **kw}, variant_attention(q, k, v, causal=True, window=W, documents=docs, **kw))  # (1, 4, S, 8)
    alibi = ({"alibi_slopes": kw["alibi_slopes"]}, variant_attention(q, k, v, causal=True, window=W, alibi_slopes=kw["alibi_slopes"]))
    for terms, want in (everything, alibi):
        cache, got, at = hw.KVCache.sliding(1, 2, W, 8, dtype=torch.float64), [], 0
        for n in chunks:
            step = terms | ({"documents": docs[:, : at + n]} if "documents" in terms else {})  # ids of every token so far
            got.append(hw.attention(q[:, :, at : at + n], k[:, :, at : at + n], v[:, :, at : at + n], causal=True, window=W,
                                    cache=cache, backend=backend, **step))
            at += n
        torch.testing.assert_close(torch.cat(got, dim=2), want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_paged_batch_with_alibi_equals_each_sequence_alone(backend):
    torch.manual_seed(6)
    slopes, lengths = torch.rand(4, dtype=torch.float64), [7, 3, 10]
    seqs = [tuple(torch.randn(1, h, n, 8, dtype=torch.float64) for h in (4, 2, 2)) for n in lengths]  # (q, k, v) each
    paged = hw.PagedKVCache(num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64)
    for i in range(3):
        paged.add(i)
    packed = [torch.cat([s[j] for s in seqs], dim=2) for j in range(3)]  # (1, H or Hkv, 20, 8)
    got = hw.attention(*packed, causal=True, alibi_slopes=slopes, cache=paged.batch([0, 1, 2], lengths), backend=backend)
    want = torch.cat([variant_attention(*s, causal=True, alibi_slopes=slopes) for s in seqs], dim=2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def _alibi_call(where, slopes, backend="auto"):
    """One float32 call whose farthest query-key distance is 9: over 10 keys, past 7 cached ones, or in a paged batch's
    longest sequence (7 cached + 3 new, beside a shorter one)."""
    g = torch.Generator().manual_seed(7)
    qkv = [torch.randn(1, 2, n, 8, generator=g) for n in (3, 10, 10)]
    if where == "keys":
        return hw.attention(*qkv, causal=True, alibi_slopes=slopes, backend=backend)
    if where == "cache":
        cache = hw.KVCache(1, 2, 16, 8)
        hw.attention(qkv[1][:, :, :7], qkv[1][:, :, :7], qkv[2][:, :, :7], causal=True, cache=cache)
        return hw.attention(qkv[0], qkv[1][:, :, 7:], qkv[2][:, :, 7:], causal=True, alibi_slopes=slopes, cache=cache, backend=backend)
    paged = hw.PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    paged.add(0), paged.add(1)
    hw.attention(qkv[1][:, :, :7], qkv[1][:, :, :7], qkv[2][:, :, :7], causal=True, cache=paged.batch([0], [7]))
    q, k, v = (torch.cat([t[:, :, :2], t[:, :, -3:]], dim=2) for t in (qkv[1], qkv[1], qkv[2]))  # sequence 1: 2 new tokens
    return hw.attention(q, k, v, causal=True, alibi_slopes=slopes, cache=paged.batch([1, 0], [2, 3]), backend=backend)[:, :, 2:]


@pytest.mark.parametrize("where", ["keys", "cache", "paged"])
def test_alibi_slopes_are_taken_while_the_bias_is_finite_over_the_farthest_distance(where):
    """-slope * distance in float32: a slope whose product with the farthest distance (9) is finite gives finite weights
    (each query's own key takes them all, the nearest in the reference too); one a float32 step larger is refused,
    where before the bias was +inf and the rows NaN."""
    limit = torch.tensor(torch.finfo(torch.float32).max / 9, dtype=torch.float32)
    while limit * 9 == math.inf:  # the largest float32 whose product with 9 is finite
        limit = limit.nextafter(torch.tensor(0.0))
    g = torch.Generator().manual_seed(7)
    _, _, v = (torch.randn(1, 2, n, 8, generator=g) for n in (3, 10, 10))
    for backend in BACKENDS:
        got = _alibi_call(where, torch.stack([limit, limit]), backend)  # the largest bias each query sees is 0, at itself
        torch.testing.assert_close(got, v[:, :, 7:], atol=0, rtol=0)
    beyond = limit.nextafter(torch.tensor(math.inf))
    with pytest.raises(ValueError, match=r"alibi_slopes must hold finite numbers whose bias -slope \* distance stays finite in "
                                         r"torch.float32 at distances up to 9 \(\|slope\| at most 3.781e\+37\), got \[-3.78"):
        _alibi_call(where, torch.stack([-beyond, limit]))


def test_documents_refuse_a_paged_batch():
    paged = hw.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    paged.add(0)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"a paged batch packs several sequences, each its own document already: pass documents=None"):
        hw.attention(q, q, q, causal=True, cache=paged.batch([0], [3]), documents=torch.zeros(1, 3, dtype=torch.long))


def test_cu_seqlens_errors():
    with pytest.raises(TypeError, match=r"cu_seqlens must be a 1-D integer tensor .* got dtype torch.float32"):
        documents_from_cu_seqlens(torch.tensor([0.0, 2.0]))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and never decrease, got \[0, 3, 2\]"):
        documents_from_cu_seqlens(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match=r"position_ids must be a \(B, T\) integer tensor, got shape \(3,\)"):
        documents_from_position_ids(torch.tensor([0, 1, 0]))  # (a wrong number of dims: a ValueError, as elsewhere)
    with pytest.raises(TypeError, match=r"position_ids must be a \(B, T\) integer tensor, got dtype torch.float32"):
        documents_from_position_ids(torch.tensor([[0.0, 1.0]]))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_cu_seqlens_of_any_integer_dtype(dtype):
    """Narrow integers too: their lengths taken in int64 (a uint8 difference wraps, and would hide a decrease)."""
    assert torch.equal(documents_from_cu_seqlens(torch.tensor([0, 3, 5], dtype=dtype)), torch.tensor([[0, 0, 0, 1, 1]]))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and never decrease, got \[0, 5, 3\]"):
        documents_from_cu_seqlens(torch.tensor([0, 5, 3], dtype=dtype))


def test_documents_on_meta_tensors_give_shapes():
    """Meta tensors have no ids to read: the call is planned and run as one (shapes only), as every other term is."""
    q = torch.empty(1, 2, 3, 64, device="meta")
    documents = torch.zeros(1, 3, dtype=torch.long, device="meta")
    assert hw.attention(q, q, q, causal=True, documents=documents).shape == (1, 2, 3, 64)
    assert hw.plan(q, q, q, causal=True, documents=documents).backend in ("math", "sdpa")


@pytest.mark.parametrize(("T", "S"), [(2, 1), (3, 5), (5, 5)])
def test_sinks_on_the_fused_kernel_with_a_two_dim_causal_mask(T, S):
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, T, 4, generator=g), torch.randn(1, 1, S, 4, generator=g), torch.randn(1, 1, S, 4, generator=g)
    sinks = torch.randn(2, generator=g)
    got = hw.attention(q, k, v, causal=True, sinks=sinks, backend="sdpa")
    torch.testing.assert_close(got.double(), variant_attention(q, k, v, causal=True, sinks=sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("terms", [
    {"alibi_slopes": torch.ones(2)},
    {"mask": torch.zeros(1, 1, 3, 1), "attention_mask": torch.ones(1, 0, dtype=torch.bool)},  # a float mask of one key column
])
def test_half_precision_bias_over_no_keys_is_zeros(backend, dtype, terms):
    """No key at all (S = 0): the narrowed bias has no row maximum to take off, even where the bias itself broadcasts
    one key column; every query's context is zeros."""
    q, k = torch.randn(1, 2, 3, 8, dtype=dtype), torch.randn(1, 2, 0, 8, dtype=dtype)
    out = hw.attention(q, k, k, backend=backend, **terms)
    assert out.shape == (1, 2, 3, 8) and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_alibi_with_sinks_is_not_shifted_apart_from_the_sink(dtype):
    """A sink's logit sits beside the keys' in the softmax: taking a row's largest bias off the keys alone would move
    weight to the sink. The fused blocks leave such a bias as it is; every backend close to float64."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 8, generator=g).to(dtype) for n in (4, 1, 1))
    sinks, slopes = torch.tensor([0.5, -1.0]), torch.tensor([3.0, 0.7])
    want = variant_attention(q.double(), k.double(), v.double(), sinks=sinks, alibi_slopes=slopes)
    for backend in ("math", "sdpa", "auto"):
        got = hw.attention(q, k, v, sinks=sinks, alibi_slopes=slopes, backend=backend).double()
        assert float((got - want).abs().max()) < 0.05, backend
