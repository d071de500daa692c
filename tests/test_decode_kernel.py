"""The C++ decode kernel (``backends.decode_kernel``): its dense op against the float64 reference, what the plan
gives it (eager and under ``torch.compile``), the op inside an inductor graph, and a build that fails. (Its paged op:
``test_paged_rows.py``.)"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from helpers import outputs_under_avx2
from reference_variants import variant_attention

import headwise as hw
from headwise import native
from headwise.backends import decode_kernel, plan
from headwise.backends.spec import Spec

pytestmark = pytest.mark.skipif(not decode_kernel.available(), reason="the C++ decode kernel could not be built here")

KERNEL, SUMMED = plan.DECODE_KERNEL, "math, products summed (compiled)"


def _qkv(B=2, H=6, Hkv=2, S=40, D=64, Dv=None, dtype=torch.float32, room=7, seed=0):
    """q (B, H, 1, D); k, v views of a cache with ``room`` more slots (rows contiguous, not the tensors)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S + room, D, generator=g).to(dtype)[:, :, :S]
    v = torch.randn(B, Hkv, S + room, Dv or D, generator=g).to(dtype)[:, :, :S]
    return q, k, v


def _bound(dtype, want):
    return (2**-8 if dtype == torch.bfloat16 else 2**-20) * 2 * float(want.abs().max())  # one rounding to dtype, float32 sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "H,Hkv,S,D,Dv",
    [(12, 12, 513, 64, 64), (6, 2, 70, 128, 128), (8, 1, 3, 64, 64), (4, 4, 1, 128, 128), (6, 3, 19, 80, 48), (2, 2, 65, 32, 32),
     (32, 16, 90, 80, 80)],
    ids=["G=1 S=513 D=64", "G=3 S=70 D=128", "G=8 S=3", "one key", "D=80 Dv=48 (plain loops)", "S=65 D=32",
         "32 items D=80 (each thread's next item, plain loops)"],
)
def test_the_dense_op_gives_the_references_numbers(dtype, H, Hkv, S, D, Dv):
    q, k, v = _qkv(H=H, Hkv=Hkv, S=S, D=D, Dv=Dv, dtype=dtype)
    out = decode_kernel.run(q, k, v, Spec(T=1, S=S, causal=True, scale=D**-0.5))
    want = variant_attention(q, k, v, causal=True)  # (B, H, 1, Dv) float64
    assert out.shape == (2, H, 1, Dv) and out.dtype == dtype
    assert float((out.double() - want).abs().max()) <= _bound(dtype, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padding_is_masked_and_a_row_without_keys_is_zeros(dtype):
    q, k, v = _qkv(B=3, S=40, dtype=dtype)
    real = torch.arange(40).expand(3, 40) >= torch.tensor([[0], [15], [40]])  # (B, S): row 1 left-padded, row 2 no key
    v[1, :, :15] = float("nan")  # a padded key's value: never read into the context
    out = decode_kernel.run(q, k, v, Spec(T=1, S=40, causal=True, attention_mask=real, scale=64**-0.5))
    want = variant_attention(q, k, v.nan_to_num(0.0), causal=True, attention_mask=real)
    assert float((out[:2].double() - want[:2]).abs().max()) <= _bound(dtype, want[:2])
    assert not out[2].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "H,Hkv,S,D,terms",
    [(6, 2, 70, 64, {"softcap": 2.0}), (4, 4, 33, 128, {"softcap": 50.0}), (6, 3, 19, 80, {"softcap": 1.0}),
     (6, 2, 70, 64, {"sinks": "random"}), (8, 1, 5, 64, {"sinks": "large"}), (6, 2, 70, 64, {"window": 17}),
     (4, 4, 129, 128, {"window": 128}), (6, 2, 90, 64, {"window": 40, "softcap": 3.0, "sinks": "random", "padded": True}),
     (6, 3, 19, 80, {"sinks": "random", "padded": True}), (6, 2, 70, 64, {"alibi": "H"}), (8, 8, 33, 128, {"alibi": "BH"}),
     (6, 2, 90, 64, {"alibi": "H", "window": 40, "softcap": 3.0, "sinks": "random", "padded": True})],
    ids=["softcap 2", "softcap 50 D=128", "softcap 1 D=80 (plain loops, a tail)", "sinks", "sinks above every score",
         "window 17", "window 128 of 129", "window, softcap, sinks, padding", "sinks, padding, D=80", "ALiBi", "ALiBi a row's own, D=128",
         "ALiBi, a window, softcap, sinks, padding"],
)
def test_softcap_sinks_and_a_window_give_the_references_numbers(dtype, H, Hkv, S, D, terms):
    """Each term as the float64 reference defines it: scores capped by tanh, less ALiBi's slope times each key's distance,
    each head's sink in its softmax with no value, a window's query at position S - 1 seeing its last W keys, and
    padding among them."""
    terms = dict(terms)
    q, k, v = _qkv(B=3, H=H, Hkv=Hkv, S=S, D=D, dtype=dtype)
    k = k * 4  # scores well past the softcaps' knees
    g = torch.Generator().manual_seed(3)
    kind = terms.pop("sinks", None)
    sinks = None if kind is None else torch.randn(H, generator=g) * 2 + (20.0 if kind == "large" else 0.0)
    alibi = terms.pop("alibi", None)
    if alibi is not None:  # (H,) as the model's standard slopes, or (B, H) a row's own
        terms["alibi_slopes"] = torch.rand((H,) if alibi == "H" else (3, H), generator=g) * 0.5
    real = None
    if terms.pop("padded", False):
        real = torch.arange(S).expand(3, S) >= torch.tensor([[0], [S // 3], [S - 2]])  # (B, S): rows 1 and 2 left-padded
    slopes = terms.pop("alibi_slopes", None)
    spec = Spec(T=1, S=S, causal=True, attention_mask=real, sinks=sinks, scale=D**-0.5, **terms,
                alibi=None if slopes is None else slopes.view(-1, H))
    if slopes is not None:
        terms["alibi_slopes"] = slopes
    assert hw.plan(q, k, v, causal=True, attention_mask=real, sinks=sinks, **terms).runner == KERNEL
    out = decode_kernel.run(q, k, v, spec)
    want = variant_attention(q, k, v, causal=True, attention_mask=real, sinks=sinks, **terms)  # (B, H, 1, D) float64
    assert out.shape == (3, H, 1, D) and out.dtype == dtype
    assert float((out.double() - want).abs().max()) <= _bound(dtype, want)


@pytest.mark.parametrize("cap", [1e-6, 1e-3, 1.0, 30.0, 1e4, 1e30])
def test_every_softcap_the_checks_accept_gives_the_references_numbers(cap):
    q, k, v = _qkv(S=77)
    out = hw.attention(q, k * 3, v, causal=True, softcap=cap)  # the plan's way: the kernel, where built
    want = variant_attention(q, k * 3, v, causal=True, softcap=cap)  # (B, H, 1, D) float64
    assert float((out.double() - want).abs().max()) <= _bound(torch.float32, want)


def test_a_sink_with_no_key_seen_gives_zeros_and_the_softcaps_tanh_is_close():
    q, k, v = _qkv(B=2, S=20)
    real = torch.ones(2, 20, dtype=torch.bool)
    real[1] = False  # row 1 sees no key: zeros, sink or not (as the reference and the prompt kernel give)
    out = decode_kernel.run(q, k, v, Spec(T=1, S=20, causal=True, attention_mask=real, sinks=torch.full((6,), 3.0), scale=0.125))
    assert not out[1].any() and out[0].abs().sum() > 0
    # one key per score, the values one-hot: the weights are the capped scores' softmax, each within float32 ulps
    S, D, cap = 61, 64, 7.0
    scores = torch.linspace(-60, 60, S, dtype=torch.float64)
    qq = torch.zeros(1, 1, 1, D)
    qq[..., 0] = 1.0
    kk = torch.zeros(1, 1, S, D)
    kk[0, 0, :, 0] = scores.float()
    vv = torch.eye(S, D).view(1, 1, S, D)
    got = torch.ops.headwise.decode_attention(qq, kk, vv, None, 1.0, cap, None)[0, 0, 0, :S].double()
    want = torch.softmax(cap * torch.tanh(scores / cap), 0)
    assert float(((got - want).abs() / want).max()) <= 4e-6


def test_the_softmax_weights_over_a_wide_range_of_scores():
    """The exponentials (16 lanes at a time, then a tail) over scores spread far below the row's largest: each softmax
    weight within a few float32 ulps of float64's, and those below float32's normal range 0 or as small."""
    g = torch.Generator().manual_seed(1)
    S, D = 77, 128  # four vectors of scores and a tail of 13
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, S, D)
    k[0, 0, :, 0] = torch.empty(S).uniform_(-110, 0, generator=g)  # the scores (scale 1)
    k[0, 0, 5, 0] = 0.0
    v = torch.eye(S, D).view(1, 1, S, D)  # one-hot rows: the output is the weights
    got = torch.ops.headwise.decode_attention(q, k, v, None, 1.0)[0, 0, 0, :S].double()
    scores = k[0, 0, :, 0].double()
    want = torch.softmax(scores, 0)
    normal = want > 1e-37
    assert bool((((got - want).abs() / want)[normal] <= 1e-6).all())
    assert bool(((got - want).abs()[~normal] <= 1e-37).all()) and int((~normal).sum()) > 5  # 0 or a subnormal


def test_a_query_not_contiguous_and_a_scale_of_its_own():
    q, k, v = _qkv(S=33)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, 1, D), strides of (B, 1, H, D)
    out = decode_kernel.run(qt, k, v, Spec(T=1, S=33, causal=False, scale=0.3))
    want = variant_attention(q, k, v, scale=0.3)
    assert float((out.double() - want).abs().max()) <= _bound(torch.float32, want)


def _plan(q, k, v, **kwargs):
    return hw.plan(q, k, v, **kwargs).runner


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
def test_the_plan_takes_it_for_a_decode_step_it_computes(monkeypatch, traced):
    q, k, v = _qkv()
    if traced:
        monkeypatch.setattr(torch.compiler, "is_dynamo_compiling", lambda: True)  # (as while Dynamo traces)
    assert _plan(q, k, v, causal=True) == KERNEL
    assert _plan(q, k, v, causal=True, backend="sdpa") == KERNEL
    assert _plan(q, k, v, causal=True, backend="math") == (SUMMED if traced else "math, every score at once")  # math's own way
    assert _plan(q, k, v, causal=True, attention_mask=torch.ones(2, 40, dtype=torch.bool)) == KERNEL
    assert _plan(*(t.bfloat16() for t in (q, k, v)), causal=True) == KERNEL
    for terms in ({"softcap": 5.0}, {"sinks": torch.zeros(6)}, {"alibi_slopes": torch.ones(6)}):
        assert _plan(q, k, v, causal=True, **terms) == KERNEL, terms
    assert _plan(q, k, v, causal=True, window=8) == (SUMMED if traced else KERNEL)  # traced: no comparison of S to W
    with torch.enable_grad():  # a sink or a slope to train: no backward
        assert _plan(q, k, v, causal=True, sinks=torch.zeros(6, requires_grad=True)) != KERNEL
        assert _plan(q, k, v, causal=True, alibi_slopes=torch.ones(6, requires_grad=True)) != KERNEL
    for terms in ({"mask": torch.zeros(40)}, {"documents": torch.zeros(2, 40, dtype=torch.long)}):
        runner = _plan(q, k, v, causal=True, **terms)
        assert (runner == SUMMED) if traced else (runner != KERNEL), terms  # traced: math's sums; eager: the other rules
    assert _plan(*(t.half() for t in (q, k, v)), causal=True) != KERNEL
    assert _plan(torch.randn(2, 6, 2, 64), k, v, causal=True) != KERNEL  # two queries per row: not a decode step
    with torch.enable_grad():
        assert _plan(q.requires_grad_(), k, v, causal=True) != KERNEL  # no backward
    monkeypatch.setattr(decode_kernel, "available", lambda: False)
    assert _plan(q.detach(), k, v, causal=True) == (SUMMED if traced else "sdpa")


def test_inductor_calls_the_op_with_symbolic_lengths():
    torch._dynamo.reset()  # the graphs of earlier tests out of the way: this one counts its own
    q, k, v = _qkv(S=50)
    graphs = []

    def recording(gm, inputs):
        from torch._inductor.compile_fx import compile_fx

        graphs.append([node.target for node in gm.graph.nodes])
        return compile_fx(gm, inputs)

    step = torch.compile(lambda q, k, v: hw.attention(q, k, v, causal=True), backend=recording, fullgraph=True, dynamic=True)
    traced = []  # graphs made by each call: the first may trace twice (a symbolic head size's scale, a float to the op,
    # is specialised by a restart when inductor's cache is cold), the second call must make none
    with torch.no_grad():
        for S in (50, 31):
            out = step(q, k[:, :, :S], v[:, :, :S])  # (B, H, 1, D)
            traced.append(len(graphs) - sum(traced))
            want = variant_attention(q, k[:, :, :S], v[:, :, :S], causal=True)
            assert float((out.double() - want).abs().max()) <= _bound(torch.float32, want)
    reasons = torch._dynamo.utils.guard_failures  # why the second length recompiled, if it did
    assert traced[0] >= 1 and traced[1] == 0, (traced, [r for code, rs in reasons.items() if code.co_name == "<lambda>" for r in rs])
    assert torch.ops.headwise.decode_attention in graphs[-1]


def test_a_build_that_fails_says_so_once_and_leaves_the_loops(monkeypatch):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.warns(UserWarning, match=r"C\+\+ kernels could not be built \(RuntimeError: no compiler\)"):
        assert native._build() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert decode_kernel.available()  # the cached build of this process stands


def test_no_builder_says_so_once_and_leaves_the_loops(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.cpp_extension", None)  # as where setuptools is missing: the import fails
    monkeypatch.delattr(torch.utils, "cpp_extension", raising=False)
    with pytest.warns(UserWarning, match=r"C\+\+ kernels could not be built \((ModuleNotFound|Import)Error"):
        assert native._build() is False


@pytest.mark.parametrize("cached", [False, True], ids=["built", "loaded"])
def test_a_build_is_announced_and_a_load_is_not(monkeypatch, tmp_path, caplog, cached):
    from torch.utils import cpp_extension

    loads = []
    monkeypatch.setattr(cpp_extension, "load", lambda name, *args, **kwargs: loads.append(name))
    monkeypatch.setattr(native, "_PATH", [])  # (this fake load's path, None, is not the process's library)

    def folder(name, verbose):  # torch's extension cache: the library's folder, holding it when cached
        (tmp_path / name).mkdir(exist_ok=True)
        if cached:  # built from these sources' paths, after they were written, and sealed at its first load
            (tmp_path / name / "build.ninja").write_text("\n".join(str(s) for s in native.SOURCES))
            (tmp_path / name / f"{name}.so").touch()
            native._seal(tmp_path / name, name)
        return str(tmp_path / name)

    monkeypatch.setattr(cpp_extension, "_get_build_directory", folder)
    with caplog.at_level("WARNING", logger="headwise"):
        assert native._build() is True
    assert len(loads) == 1
    announced = [r.getMessage() for r in caplog.records if r.name == "headwise"]
    assert (announced == []) if cached else ("building its C++ kernels" in announced[0] and len(announced) == 1)


@pytest.mark.parametrize("dtype,stored", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("tables", ["none", "shared", "per row", "per row, strided"])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("with_terms", [False, True], ids=["no terms", "softcap, sinks, ALiBi"])
def test_the_step_op_is_the_rotation_the_write_and_the_dense_op_bit_for_bit(dtype, stored, tables, padded, with_terms):
    """``decode_kernel.step`` against the Python ops it stands for: ``rope.rotate`` of q and k together, the cache's
    write at the slot, ``dense`` over the slots so far (with its terms), the heads merged. Strided tables take the op's
    ATen ops rather than its loop."""
    from headwise.rope import RotaryEmbedding, rotate

    g = torch.Generator().manual_seed(3)
    B, H, Hkv, D, L, start = 3, 6, 2, 64, 50, 37
    qkv = torch.randn(B, 1, (H + 2 * Hkv) * D, generator=g).to(dtype)  # one projection's output, as the step gets it
    q, k, v = (t.view(B, 1, -1, D).transpose(1, 2) for t in qkv.split((H * D, Hkv * D, Hkv * D), -1))  # (B, H|Hkv, 1, D) views
    rotary = RotaryEmbedding(D, theta=500.0)
    cos = sin = None
    if tables != "none":
        where = start if tables == "shared" else torch.tensor([[start], [start - 5], [3]])  # an int start or (B, 1) positions
        cos, sin = rotary.at(where, 1, torch.device("cpu"))  # (1, D) or (B, 1, 1, D)
        if tables.endswith("strided"):
            cos, sin = (torch.stack((t, t), -1).flatten(-2)[..., ::2] for t in (cos, sin))  # the same values, every other float
    k_cache = torch.randn(B, Hkv, L, D, generator=g).to(stored)
    v_cache = torch.randn(B, Hkv, L, D, generator=g).to(stored)
    real = (torch.arange(L).expand(B, L) >= torch.tensor([[0], [9], [30]])) if padded else None  # (B, L)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    qr, kr = (q, k) if cos is None else rotate(torch.cat((q, k), 1), cos, sin).split((H, Hkv), 1)
    k_want[:, :, start:start + 1] = kr.to(stored)
    v_want[:, :, start:start + 1] = v.to(stored)
    seen = None if real is None else real[:, :start + 1]
    terms = (3.0, torch.randn(H, generator=g), torch.rand(B, H, generator=g) / 4) if with_terms else ()  # softcap, sinks, (B, H) slopes
    context = decode_kernel.dense(qr.to(stored), k_want[:, :, :start + 1], v_want[:, :, :start + 1], seen, D**-0.5, *terms).to(dtype)
    want = context.transpose(1, 2).reshape(B, 1, -1)  # (B, 1, H*D)
    with torch.inference_mode():
        got = decode_kernel.step(q, k, v, cos, sin, k_cache, v_cache, real, start, D**-0.5, *terms)
    assert got.shape == (B, 1, H * D) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want)


@pytest.mark.parametrize("dtype,stored", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                          (torch.float32, torch.int8), (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("tables", ["none", "per row", "per row, strided"])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("with_terms", [False, True], ids=["no terms", "softcap, sinks, ALiBi"])
def test_the_paged_step_op_is_the_rotation_the_pools_write_and_the_one_call_bit_for_bit(dtype, stored, tables, window, with_terms):
    """``decode_kernel.paged_step`` against the Python ops it stands for (a paged batch's path in ``functional``):
    ``rope.rotate`` of q and k, the pool's write at the slots (8-bit rows by ``quantize_rows``), the queries gathered by
    rows in the pool's dtype and widened, ``paged``'s one call (with its terms), the context in the pool's dtype placed
    at the rows, the heads merged. Strided tables take the op's ATen ops rather than its loop."""
    from headwise.cache.static import quantize_rows
    from headwise.rope import RotaryEmbedding, rotate

    if not decode_kernel.available():
        pytest.skip("the C++ kernels are not built here")
    g = torch.Generator().manual_seed(4)
    N, H, Hkv, D, bs, blocks = 3, 6, 2, 64, 4, 12
    qkv = torch.randn(1, N, (H + 2 * Hkv) * D, generator=g).to(dtype)  # one projection's output: sequence n's token at row n
    q, k, v = (t.view(1, N, -1, D).transpose(1, 2) for t in qkv.split((H * D, Hkv * D, Hkv * D), -1))  # (1, H|Hkv, N, D) views
    width = D + 4 if stored == torch.int8 else D
    k_pool = torch.randn(Hkv, blocks * bs, width, generator=g)
    v_pool = torch.randn(Hkv, blocks * bs, width, generator=g)
    k_pool, v_pool = (quantize_rows(t[..., :D]) if stored == torch.int8 else t.to(stored) for t in (k_pool, v_pool))
    tables_of = torch.tensor([[5, 2, 9], [0, 7, 0], [11, 3, 8]])  # (N, nb): each sequence's blocks, padded with block 0
    seen_to = torch.tensor([10, 5, 12])  # the keys each sequence holds with its new token (its last: slot seen_to - 1)
    slots = torch.stack([tables_of[n, (s - 1) // bs] * bs + (s - 1) % bs for n, s in enumerate(seen_to.tolist())])  # (N,)
    rows = torch.tensor([1, 0, 2])  # fewest keys first, as a paged batch gives them
    cos = sin = None
    if tables != "none":
        cos, sin = RotaryEmbedding(D, theta=500.0).at(torch.tensor([[9, 4, 11]]), N, torch.device("cpu"))  # (1, 1, N, D)
        if tables.endswith("strided"):
            cos, sin = (torch.stack((t, t), -1).flatten(-2)[..., ::2] for t in (cos, sin))  # the same values, every other float
    k_want, v_want = k_pool.clone(), v_pool.clone()
    qr, kr = (q, k) if cos is None else rotate(torch.cat((q, k), 1), cos, sin).split((H, Hkv), 1)
    taken = torch.float32 if stored == torch.int8 else stored
    as_stored = quantize_rows if stored == torch.int8 else (lambda t: t)
    k_want.index_copy_(1, slots, as_stored(kr.to(taken))[0])
    v_want.index_copy_(1, slots, as_stored(v.to(taken))[0])
    one = qr[0].index_select(1, rows).to(taken).float().view(Hkv, H // Hkv, N, D).permute(2, 0, 1, 3).contiguous()  # (N, Hkv, G, D)
    seen_from = torch.zeros_like(seen_to) if window is None else (seen_to - window).clamp(min=0)
    terms = (3.0, torch.randn(H, generator=g), torch.rand(1, H, generator=g) / 4) if with_terms else ()  # softcap, sinks, (1, H) slopes
    out = decode_kernel.paged(one, k_want, v_want, tables_of[rows], seen_from[rows], seen_to[rows], bs, D**-0.5, *terms)  # (N, Hkv, G, D)
    context = torch.empty(1, H, N, D, dtype=taken)
    context[0, :, rows] = out.flatten(1, 2).transpose(0, 1).to(taken)
    want = context.to(dtype).transpose(1, 2).reshape(1, N, -1)  # (1, N, H*D)
    with torch.inference_mode():
        got = decode_kernel.paged_step(q, k, v, cos, sin, k_pool, v_pool, slots, rows, tables_of[rows], seen_to[rows], window, bs, D**-0.5,
                                       *terms)
    assert got.shape == (1, N, H * D) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)


def test_the_step_rounds_its_rotation_as_addcmul_does_on_this_machine():
    """The step's own rotation loop rounds ``x·cos + partner·sin`` once or twice as torch's ``addcmul_`` does for this
    CPU capability (its AVX2 and AVX-512 kernels fuse the multiply-add, its plain one does not): what ``addcmul_`` gives
    here, told apart in float64, is what the op found."""
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4, 8, 1, 80, generator=g) for _ in range(3))
    got = a.clone().addcmul_(b, c)
    once = (a.double() + b.double() * c.double()).float()  # b·c is exact in float64: one rounding, to float32
    twice = a + b * c  # two roundings
    assert not torch.equal(once, twice)  # values where the two differ
    want = "once" if torch.equal(got, once) else "twice" if torch.equal(got, twice) else "neither"
    assert decode_kernel.rotation_rounding() == want


@pytest.mark.parametrize("capability,rounding", [("avx2", "once"), ("default", "twice")])
def test_the_kernels_build_for_torchs_other_capabilities_and_the_step_rounds_as_they_do(capability, rounding):
    """Under torch's AVX2 kernels and its plain ones (``ATEN_CPU_CAPABILITY``; the C++ kernels are built with the flags
    of the capability torch runs, so each gets a build of its own): the kernels build, and the step's loop rounds as that
    capability's ``addcmul_`` does (the AVX2 kernel fuses, the plain one does not): the step test's cases, bit for bit."""
    import subprocess
    import sys

    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2: torch runs its plain kernels whatever it is asked")
    code = (
        "import sys, pytest, torch; from headwise.backends import decode_kernel; "
        f"assert torch.backends.cpu.get_cpu_capability() == {capability.upper()!r}, torch.backends.cpu.get_cpu_capability(); "
        "assert decode_kernel.available(); "
        f"assert decode_kernel.rotation_rounding() == {rounding!r}, decode_kernel.rotation_rounding(); "
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-x', __file__ + '::test_the_step_op_is_the_rotation_the_write_and_the_dense_op_bit_for_bit', "
        "__file__ + '::test_the_paged_step_op_is_the_rotation_the_pools_write_and_the_one_call_bit_for_bit']))"
    ).replace("__file__", repr(__file__))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def attention_outputs() -> dict[str, torch.Tensor]:
    """The dense op on seeded cases: head sizes 64 and 128 (the vector loops; other sizes' plain loops leave their sums'
    order to the compiler's vector width), one and three query heads a key head, float32 and bfloat16 caches, with and
    without padding masked, and with every term that changes a score."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for H, Hkv, S, D in ((4, 4, 300, 64), (6, 2, 77, 128), (3, 1, 1000, 64), (2, 2, 5, 128)):
            q, k, v = _qkv(B=2, H=H, Hkv=Hkv, S=S, D=D, dtype=dtype, seed=S)
            real = torch.rand(2, S, generator=torch.Generator().manual_seed(S)) > 0.2  # (B, S)
            name = f"{dtype}, {H} heads over {Hkv}, S={S}, D={D}"
            out[name] = decode_kernel.dense(q, k, v, None, D**-0.5)
            out[name + ", masked"] = decode_kernel.dense(q, k, v, real, D**-0.5)
            g = torch.Generator().manual_seed(S + 1)
            sinks, slopes = torch.randn(H, generator=g), torch.rand(2, H, generator=g)  # (H,), (B, H)
            out[name + ", softcap, sinks, ALiBi"] = decode_kernel.dense(q, k * 4, v, real, D**-0.5, 5.0, sinks, slopes)
    return out


def test_the_avx2_build_gives_this_builds_bits(tmp_path):
    """Under torch's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``: the library built with AVX2's flags, whose loops run on
    8-float registers) the dense op gives this process's AVX-512 build's numbers bit for bit, case by case: the same
    multiply-adds and sums in the same order."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("torch runs its AVX-512 kernels only on a CPU with AVX-512: here both builds are the same")
    theirs, ours = outputs_under_avx2("test_decode_kernel", "attention_outputs", tmp_path), attention_outputs()
    assert list(theirs) == list(ours)
    assert [name for name in ours if not torch.equal(ours[name], theirs[name])] == []


def test_the_ops_pass_torchs_opcheck():
    """Each C++ attention op, with every term it takes, against ``torch.library.opcheck``: its schema's mutations (the
    steps write their caches or pools, nothing else), its fake (the shapes a compiled graph is traced with), its
    autograd registration and its run under AOT dispatch."""
    from headwise.backends import prefill_kernel

    if not decode_kernel.available():
        pytest.skip("the C++ kernels are not built here")
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, S, L = 2, 6, 2, 64, 20, 30
    q, k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    real = torch.ones(B, L, dtype=torch.bool)
    real[0, :3] = False  # (B, L): a left-padded row
    sinks, slopes = torch.randn(H, generator=g), torch.rand(B, H, generator=g)  # (H,), (B, H)
    N, bs = 3, 4
    queries = torch.randn(N, Hkv, H // Hkv, D, generator=g)  # (N, Hkv, G, D)
    k_pool, v_pool = torch.randn(Hkv, 12 * bs, D, generator=g), torch.randn(Hkv, 12 * bs, D, generator=g)
    tables, seen_to = torch.tensor([[5, 2, 9], [0, 7, 0], [11, 3, 8]]), torch.tensor([10, 5, 12])
    slots, rows = torch.tensor([9 * bs + 1, 7 * bs, 8 * bs + 3]), torch.tensor([1, 0, 2])
    prompt = torch.randn(B, H, 16, D, generator=g)
    calls = {
        "decode_attention": (q, k, v, real[:, :S], 0.125, 3.0, sinks, slopes),
        "paged_decode_attention": (queries, k_pool, v_pool, tables, torch.zeros(N, dtype=torch.long), seen_to, bs, 0.125, 3.0, sinks,
                                   slopes[:1]),
        "decode_step": (q, k[:, :, :1], v[:, :, :1], None, None, torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g),
                        real, 20, 0.125, 3.0, sinks, slopes),
        "paged_step": (torch.randn(1, H, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g),
                       None, None, k_pool, v_pool, slots, rows, tables[rows], seen_to[rows], None, bs, 0.125, 3.0, sinks, slopes[:1]),
    }
    if prefill_kernel.available():
        calls["prefill_attention"] = (prompt, k[:, :, :16].contiguous(), v[:, :, :16].contiguous(), True, 0.125, 0, sinks, real[:, :16].contiguous(), 3.0,
                                      slopes)
    for name, args in calls.items():
        result = torch.library.opcheck(getattr(torch.ops.headwise, name), args)
        assert set(result.values()) == {"SUCCESS"}, (name, result)
