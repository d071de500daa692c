"""headwise.attention / attention_weights against the float64 reference, every backend."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ERROR_RATIO, on, tol
from hypothesis import given
from hypothesis import strategies as st
from reference import allowed_matrix, plain_attention, reference_attention, reference_weights

import headwise as hw
from headwise.arguments import BACKENDS

BACKEND_NAMES = ["math", "sdpa", "auto"]


# ----------------------------------------------------------------------------- random cases


@st.composite
def cases(draw, *, dtype=torch.float64):
    """A random attention problem: shapes, GQA, causal/window, masks of every kind, scale."""
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    T = draw(st.integers(1, 6))
    S = draw(st.integers(1, 6))
    D = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hkv, S, draw(st.integers(1, 8)), generator=g, dtype=dtype)
    kw: dict = {"causal": draw(st.booleans())}
    if kw["causal"] and draw(st.booleans()):
        kw["window"] = draw(st.integers(1, 6))
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    if mask_kind != "none":
        shape = draw(st.sampled_from([(T, S), (B, 1, T, S), (B, H, T, S), (1, H, 1, S), (S,)]))
        if mask_kind == "bool":
            kw["mask"] = torch.rand(shape, generator=g) < 0.7
        else:  # additive: finite biases, some -inf
            bias = torch.randn(shape, generator=g, dtype=dtype)
            kw["mask"] = bias.masked_fill(torch.rand(shape, generator=g) < 0.2, -math.inf)
    if draw(st.booleans()):
        kw["attention_mask"] = torch.rand(B, S, generator=g) < 0.75
    if draw(st.booleans()):
        kw["scale"] = draw(st.floats(0.05, 3.0))
    return q, k, v, kw


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@given(case=cases())
def test_attention_matches_reference(backend, case, device):
    q, k, v, kw = case
    got = hw.attention(*on(device, (q, k, v)), backend=backend, **on(device, kw)).cpu()
    want = reference_attention(q, k, v, **kw)
    assert got.shape == want.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **tol(device, torch.float64))


@given(case=cases())
def test_attention_weights_match_reference(case):
    q, k, _, kw = case
    got = hw.attention_weights(q, k, **kw)
    want = reference_weights(q, k, **kw)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    rows = got.sum(-1)  # every row sums to 1 or is all zeros
    assert torch.all((rows - 1).abs().lt(1e-12) | rows.eq(0))


def test_every_backend_in_the_table_matches_the_reference():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    want = reference_attention(q, k, v, causal=True)
    for name in BACKENDS:
        torch.testing.assert_close(hw.attention(q, k, v, causal=True, backend=name), want, rtol=1e-10, atol=1e-10, msg=name)


# ----------------------------------------------------------------------------- causal alignment


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize(("T", "S"), [(1, 5), (2, 5), (5, 5), (5, 2), (3, 7)])
def test_causal_is_bottom_right(backend, T, S, device):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, T, 4).double(), torch.randn(1, 2, S, 4).double(), torch.randn(1, 2, S, 3).double()
    got = hw.attention_weights(*on(device, (q, k)), causal=True).cpu()
    for i in range(T):
        for j in range(S):
            assert (got[0, :, i, j] > 0).all() == (j <= i + S - T), (i, j)
    got = hw.attention(*on(device, (q, k, v)), causal=True, backend=backend).cpu()
    torch.testing.assert_close(got, reference_attention(q, k, v, causal=True), **tol(device, torch.float64))


def test_decoding_one_query_equals_the_last_row_of_the_full_pass():
    """The reason for bottom-right alignment: the last token's query over all keys."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64) for _ in range(3))
    full = hw.attention(q, k, v, causal=True)
    for backend in BACKEND_NAMES:
        step = hw.attention(q[:, :, -1:], k, v, causal=True, backend=backend)
        torch.testing.assert_close(step, full[:, :, -1:])


# ----------------------------------------------------------------------------- fully masked rows


def _fully_masked_problem(dtype=torch.float64, device="cpu"):
    """Three ways to leave a query nothing to see, in one batch."""
    torch.manual_seed(2)
    B, H, T, S, D = 2, 2, 4, 5, 3
    q = torch.randn(B, H, T, D, dtype=dtype).to(device).requires_grad_()
    k = torch.randn(B, H, S, D, dtype=dtype).to(device).requires_grad_()
    v = torch.randn(B, H, S, D, dtype=dtype).to(device).requires_grad_()
    mask = torch.ones(B, H, T, S, dtype=torch.bool, device=device)
    mask[0, 0, 1] = False  # one row by a bool mask
    mask[1, :, 0] = False
    return q, k, v, mask


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("kind", ["bool", "float", "padding+causal"])
def test_fully_masked_rows_are_zero_forward_and_backward(backend, kind, device):
    q, k, v, mask = _fully_masked_problem(device=device)
    if kind == "bool":
        kw = {"mask": mask}
    elif kind == "float":
        kw = {"mask": torch.zeros(mask.shape, dtype=q.dtype, device=device).masked_fill(~mask, -math.inf)}
    else:
        # left padding, T < S: queries 0-2 of row 1 see only padding keys
        kw = {"causal": True, "attention_mask": torch.tensor([[True] * 5, [False] * 4 + [True]], device=device)}
    want = reference_attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(), **on("cpu", kw)).to(device)
    dead = reference_weights(q.detach().cpu(), k.detach().cpu(), **on("cpu", kw)).sum(-1).to(device) == 0  # (B, H, T)
    assert dead.any(), "the problem must contain a fully masked row"
    out = hw.attention(q, k, v, backend=backend, **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, **tol(device, torch.float64))
    assert (out[dead] == 0).all()
    weights = hw.attention_weights(q, k, **kw)
    assert not weights.isnan().any() and (weights[dead] == 0).all()
    (out.square().sum() + weights.sum()).backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert (q.grad[dead] == 0).all()  # a dead query has no influence


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_fully_masked_rows_are_zero_in_low_precision(backend, dtype):
    q, k, v, mask = _fully_masked_problem(dtype)
    out = hw.attention(q, k, v, mask=mask, backend=backend)
    assert out.dtype == dtype and not out.isnan().any()
    assert (out[0, 0, 1] == 0).all() and (out[1, :, 0] == 0).all()
    out.float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_stay_zero_under_dropout(backend, kind):
    q, k, v, mask = _fully_masked_problem()
    m = mask if kind == "bool" else torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, -math.inf)
    out = hw.attention(q, k, v, mask=m, dropout_p=0.5, backend=backend)
    assert not out.isnan().any() and (out[0, 0, 1] == 0).all() and (out[1, :, 0] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"causal": True},
        {"causal": True, "window": 2, "scale": 0.7},
        {"attention_mask": torch.tensor([[True, True, False, True], [False, False, True, True]])},
        {"mask": torch.tensor([[True, False, True, True], [False, False, False, False], [True, True, True, False]])},  # row 1 dead
    ],
    ids=["plain", "causal", "window+scale", "padding", "bool-with-dead-row"],
)
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_gradcheck(backend, kw, gqa):
    torch.manual_seed(3)
    q = torch.randn(2, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 1 if gqa else 2, 4, 2, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 1 if gqa else 2, 4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v: hw.attention(q, k, v, backend=backend, **kw), (q, k, v))


def test_gradcheck_attention_weights():
    torch.manual_seed(4)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    kpm = torch.tensor([[False, True, True, True, True]])
    assert torch.autograd.gradcheck(lambda q, k: hw.attention_weights(q, k, causal=True, attention_mask=kpm), (q, k))


def test_additive_mask_gets_gradients():
    """A learned bias (ALiBi-style) added through ``mask`` receives its gradient."""
    torch.manual_seed(5)
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True)
    for backend in ("math", "sdpa"):
        assert torch.autograd.gradcheck(lambda b, backend=backend: hw.attention(q, k, v, mask=b, backend=backend), (bias,))


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_dropout_zero_is_exact(backend):
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    torch.manual_seed(7)
    a = hw.attention(q, k, v, causal=True, dropout_p=0.0, backend=backend)
    b = hw.attention(q, k, v, causal=True, dropout_p=0.0, backend=backend)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), reference_attention(q, k, v, causal=True), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("p", [0.2, 0.5])
def test_dropout_drops_weights_and_rescales(backend, p):
    """With v = identity the context IS the dropped weights: each is 0 or w / (1 - p), and
    the zeroed fraction is p within 5 binomial standard deviations."""
    torch.manual_seed(8)
    B, H, T, S = 4, 4, 32, 32
    q, k = torch.randn(B, H, T, 8, dtype=torch.float64), torch.randn(B, H, S, 8, dtype=torch.float64)
    v = torch.eye(S, dtype=torch.float64).expand(B, H, S, S)
    w = reference_weights(q, k, causal=True)
    out = hw.attention(q, k, v, causal=True, dropout_p=p, backend=backend)
    live = w > 0
    kept = out[live] != 0
    torch.testing.assert_close(out[live][kept], w[live][kept] / (1 - p))
    assert (out[~live] == 0).all()
    n = live.sum().item()
    dropped = 1 - kept.double().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n), (dropped, p, n)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "terms",
    [{}, {"causal": True}, {"attention_mask": torch.tensor([[1, 1, 0, 1, 1], [0, 0, 0, 0, 0]])}, {"softcap": 5.0},
     {"alibi_slopes": torch.tensor([0.5, 0.25])}, {"sinks": torch.tensor([0.0, 1.0])}],
    ids=["plain", "causal", "padding", "softcap", "alibi", "sinks"],
)
def test_dropout_one_drops_every_weight(backend, dtype, terms):
    """dropout_p=1 (nn.Dropout(1.0) in training): every weight dropped, so the context is zeros and
    q, k and v get zero gradients, never the NaN of a 1 / (1 - p) rescale."""
    torch.manual_seed(10)
    q, k, v = (torch.randn(2, 2, 5, 4, dtype=dtype, requires_grad=True) for _ in range(3))
    out = hw.attention(q, k, v, dropout_p=1.0, backend=backend, **terms)
    assert out.shape == (2, 2, 5, 4) and out.dtype == dtype
    assert torch.equal(out, torch.zeros_like(out))
    out.backward(torch.randn_like(out))
    for name, t in zip("qkv", (q, k, v), strict=True):
        assert torch.equal(t.grad, torch.zeros_like(t)), name
    assert "every weight dropped" in hw.plan(q, k, v, dropout_p=1.0, backend=backend, **terms).runner


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_dropout_is_unbiased_on_average(backend):
    """The mean over many draws tends to the undropped output (expectation preserved)."""
    torch.manual_seed(9)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    want = reference_attention(q, k, v, causal=True)
    draws = torch.stack([hw.attention(q, k, v, causal=True, dropout_p=0.3, backend=backend) for _ in range(2000)])
    assert not torch.equal(draws[0], draws[1])  # train mode changes the output
    # standard error of a mean of 2000 draws: well under 0.05 for these magnitudes
    err = (draws.mean(0) - want).abs().max().item()
    spread = draws.std(0).max().item() / math.sqrt(len(draws))
    assert err < 6 * spread, (err, spread)


# ----------------------------------------------------------------------------- low precision


def _low_precision_problem(causal: bool, gqa: bool):  # on the CPU: the float64 reference runs there
    torch.manual_seed(10)
    B, H, T, D = 2, 4, 96, 32
    Hkv = 2 if gqa else H
    q = torch.randn(B, H, T, D) * 2  # scaled up so softmax is peaky: rounding matters
    k = torch.randn(B, Hkv, T, D) * 2
    v = torch.randn(B, Hkv, T, D)
    return q, k, v




@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_low_precision_within_k_times_plain_error(dtype, backend, causal, gqa, device):
    q, k, v = _low_precision_problem(causal, gqa)
    want = reference_attention(q, k, v, causal=causal)  # float64 on the same (float32) inputs
    ql, kl, vl = q.to(dtype), k.to(dtype), v.to(dtype)
    group = q.shape[1] // k.shape[1]
    plain = plain_attention(ql, kl.repeat_interleave(group, 1), vl.repeat_interleave(group, 1), causal=causal)
    ours = hw.attention(*on(device, (ql, kl, vl)), causal=causal, backend=backend).cpu()  # the plain yardstick stays on the CPU
    assert ours.dtype == dtype
    plain_err = (plain.double() - want).abs().max().item()
    our_err = (ours.double() - want).abs().max().item()
    # the error of merely rounding the exact answer to dtype: no implementation beats it
    rounding = (want.to(dtype).double() - want).abs().max().item()
    assert our_err <= ERROR_RATIO * plain_err + rounding, (our_err, plain_err, rounding)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_weights_within_k_times_plain_error(dtype):
    q, k, _ = _low_precision_problem(True, False)
    want = reference_weights(q, k, causal=True)
    ql, kl = q.to(dtype), k.to(dtype)
    scores = (ql @ kl.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    plain = torch.softmax(scores.masked_fill(~allowed_matrix(96, 96, causal=True, window=None), -math.inf), -1)
    ours = hw.attention_weights(ql, kl, causal=True)
    assert ours.dtype == dtype
    rounding = (want.to(dtype).double() - want).abs().max().item()
    our_err, plain_err = (ours.double() - want).abs().max().item(), (plain.double() - want).abs().max().item()
    assert our_err <= ERROR_RATIO * plain_err + rounding, (our_err, plain_err, rounding)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [10.0, 100.0])
def test_bfloat16_scores_are_not_rounded_before_the_scale(backend, causal, scale):
    """A bfloat16 score rounded before a large scale moves its logit by up to scale * |score| * 2**-9: every backend
    keeps the scores in float32 and lands within twice the rounding of the exact answer to bfloat16."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 96, 16, generator=g).bfloat16() for h in (4, 2, 2))
    want = reference_attention(q.double(), k.double(), v.double(), causal=causal, scale=scale)  # float64 of the same values
    rounding = (want.bfloat16().double() - want).abs().max().item()
    ours = hw.attention(q, k, v, causal=causal, scale=scale, backend=backend)
    assert (ours.double() - want).abs().max().item() <= 2 * rounding


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_no_query_heads_with_alibi_gives_an_empty_answer(backend):
    """H = 0 is accepted (an empty answer); with its (0,) ALiBi slopes too."""
    q, k, v = torch.randn(2, 0, 3, 8), torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 8)
    out = hw.attention(q, k, v, causal=True, alibi_slopes=torch.zeros(0), backend=backend)
    assert out.shape == (2, 0, 3, 8)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_the_least_scale_float32_holds_gives_each_row_the_mean_of_its_values(backend):
    """2**-149, float32's least subnormal: every scaled score is 0 or nearly, so each causal row weighs its keys alike
    (float64's mean of the values it sees); half of it is 0 in float32 and refused (0 * -inf at a masked key: NaN)."""
    q, k, v = (torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    got = hw.attention(q, k, v, causal=True, scale=2.0**-149, backend=backend)
    want = v.double().cumsum(2) / torch.arange(1, 6, dtype=torch.float64)[:, None]  # (1, 2, 5, 8): row i, the mean of v[:i+1]
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"scale must be nonzero in float32"):
        hw.attention(q, k, v, causal=True, scale=2.0**-150, backend=backend)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("paged", [False, True], ids=["KVCache", "paged"])
def test_no_query_heads_over_a_cache_writes_its_keys_and_gives_an_empty_answer(stored, paged):
    """H = 0 over a cache: the keys are written as any call's (the cache then holds what a call with query heads would
    have left) and the answer is empty, on the paths a decode step takes too (the C++ kernels, one call for a paged
    batch's one-token rows), where the empty queries' views failed after the write."""
    taken = torch.float32 if stored == torch.int8 else stored
    g = torch.Generator().manual_seed(0)
    steps = [torch.randn(1, 2, n, 8, generator=g).to(taken) for n in (3, 1, 1)]  # keys (and values) of each call
    caches = []
    for heads in (0, 2):
        if paged:
            cache = hw.PagedKVCache(8, 4, 2, 8, dtype=stored)
            cache.add(0)
        else:
            cache = hw.KVCache(1, 2, 8, 8, dtype=stored)
        for kv in steps:
            q = torch.randn(1, heads, kv.shape[2], 8).to(taken)
            out = hw.attention(q, kv, kv, causal=True, cache=cache.batch([0], [kv.shape[2]]) if paged else cache)
            assert out.shape == (1, heads, kv.shape[2], 8)
        caches.append(cache)
    empty, full = caches
    assert (empty.length(0) if paged else len(empty)) == 5
    assert torch.equal(empty.k, full.k) and torch.equal(empty.v, full.v)


# ----------------------------------------------------------------------------- bad input


def _qkv(B=1, H=2, T=3, S=3, D=4, Hkv=None):
    return torch.randn(B, H, T, D), torch.randn(B, Hkv or H, S, D), torch.randn(B, Hkv or H, S, D)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda q, k, v: (q[0], k, v), ValueError, r"q must have shape \(B, H, T, D\) \(4 dims\), got shape \(2, 3, 4\)"),
        (lambda q, k, v: (q.tolist(), k, v), TypeError, r"q must be a torch.Tensor.*got list"),
        (lambda q, k, v: (q.long(), k.long(), v.long()), TypeError, r"q must be a floating-point tensor, got dtype torch.int64"),
        (lambda q, k, v: (q, k.double(), v), TypeError, r"q, k and v must share one dtype"),
        (lambda q, k, v: (q, k[..., :3], v), ValueError, r"k must have shape \(B=1, Hkv, S, D=4\)"),
        (lambda q, k, v: (q, k, v[:, :, :2]), ValueError, r"v must have shape \(B, Hkv, S, Dv\)"),
        (lambda q, k, v: (torch.randn(1, 3, 3, 4), k, v), ValueError, r"q's heads H=3 must be a multiple of k/v's heads Hkv=2"),
        (lambda q, k, v: (q, k[:, :0], v[:, :0]), ValueError, r"k and v must have at least one head \(Hkv >= 1\), got k of shape \(1, 0, 3, 4\)"),
    ],
)
def test_bad_tensors(change, error, match):
    with pytest.raises(error, match=match):
        hw.attention(*change(*_qkv()))


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"backend": "flash"}, ValueError, r"backend must be one of \['auto', 'math', 'sdpa'\], got 'flash'"),
        ({"dropout_p": 1.5}, ValueError, r"dropout_p must be a number in \[0, 1\], got 1.5"),
        ({"dropout_p": -0.1}, ValueError, r"dropout_p must be a number in \[0, 1\], got -0.1"),
        ({"scale": 0.0}, ValueError, r"scale must be a positive finite number or None"),
        ({"scale": math.inf}, ValueError, r"scale must be a positive finite number"),
        ({"window": 2}, ValueError, r"window \(sliding-window attention\) needs causal=True"),
        ({"causal": True, "window": 0}, ValueError, r"window must be a positive int or None, got 0"),
        ({"mask": torch.ones(3, 4, dtype=torch.bool)}, ValueError, r"mask must broadcast to \(B, H, T, S\) = \(1, 2, 3, 3\), got shape \(3, 4\)"),
        ({"mask": torch.ones(3, 3, dtype=torch.long)}, TypeError, r"mask must be bool \(True = may attend\) or an additive float mask"),
        ({"mask": [[True]]}, TypeError, r"mask must be a torch.Tensor"),
        ({"attention_mask": torch.ones(1, 3)}, TypeError, r"attention_mask must be a bool or 0/1 int tensor \(1/True = real token\), got dtype torch.float32"),
        ({"attention_mask": torch.full((1, 3), 2)}, ValueError, r"attention_mask must hold only 0 \(padding\) and 1 \(real token\), got values \[2\]"),
        ({"attention_mask": torch.ones(1, 4, dtype=torch.bool)}, ValueError, r"attention_mask must have shape \(B, S\) = \(1, 3\), got \(1, 4\)"),
    ],
)
def test_bad_arguments(kw, error, match):
    with pytest.raises(error, match=match):
        hw.attention(*_qkv(), **kw)


def test_attention_weights_checks_its_arguments_too():
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"scale must be a positive finite number or None"):
        hw.attention_weights(q, k, scale=-1.0)
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, S\)"):
        hw.attention_weights(q, k, attention_mask=torch.ones(2, 3, dtype=torch.bool))


# ----------------------------------------------------------------------------- heads helpers


def test_split_and_merge_heads_round_trip():
    from headwise.functional import merge_heads, split_heads

    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 4)  # head size 4: three heads
    assert heads.shape == (2, 3, 5, 4)
    for h in range(3):
        assert torch.equal(heads[:, h], x[..., 4 * h : 4 * (h + 1)])
    assert torch.equal(merge_heads(heads), x)


def test_auto_uses_math_while_observed_and_reports_its_steps():
    q, k, v = _qkv()
    seen = []
    with hw.observe(lambda name, t: seen.append(name)):
        hw.attention(q, k, v, causal=True)
    assert seen == ["scores", "masked_scores", "weights", "context"]
    seen.clear()
    hw.attention(q, k, v, causal=True)  # nobody observes: nothing reported
    assert seen == []


def test_observed_steps_in_training_add_up_to_the_context():
    """With dropout the weights reported are the softmax; the dropped weights, which multiply the values, are reported
    after them: context == dropped_weights @ values."""
    q, k, v = _qkv()
    seen = {}
    torch.manual_seed(0)
    with hw.observe(lambda name, t: seen.setdefault(name, t)):
        out = hw.attention(q, k, v, causal=True, dropout_p=0.5)
    assert list(seen) == ["scores", "masked_scores", "weights", "dropped_weights", "context"]
    torch.testing.assert_close(seen["weights"].sum(-1), torch.ones_like(seen["weights"].sum(-1)))
    torch.testing.assert_close(out, seen["dropped_weights"] @ v)
    assert not torch.equal(seen["dropped_weights"], seen["weights"])


def test_int_padding_mask_equals_bool_mask(device):
    """HuggingFace's meaning: 1/True = real token, 0/False = padding; ints and bools alike."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    ints = hw.attention(*on(device, (q, k, v)), causal=True, attention_mask=real.to(device)).cpu()
    bools = hw.attention(*on(device, (q, k, v)), causal=True, attention_mask=real.bool().to(device)).cpu()
    torch.testing.assert_close(ints, bools, rtol=0, atol=0)
    want = reference_attention(q.double(), k.double(), v.double(), causal=True, attention_mask=real.bool())
    torch.testing.assert_close(ints.double(), want, rtol=1e-5, atol=1e-6)
