"""headwise.linear's few-rows rule (decode-shaped calls): which path it names on which CPU, each path
forced at decode shapes against the float64 reference, and a model's decode step on either path."""

import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F
from reference import linear as ref_linear

from headwise import GPT2Config
from headwise import linear as hl
from headwise.linear import onednn, panels, weight_cache
from headwise.models import GPT2LMHeadModel

N, K = 512, 256  # N*K = MIN_DECODE_WEIGHT: the smallest weight the few-rows rule covers


def decode_case(rows, dtype, *, n=N, k=K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, k, generator=gen)  # (B, T=1, K): a decode step's input
    w = torch.randn(n, k, generator=gen) / k**0.5  # (N, K)
    b = torch.randn(n, generator=gen)  # (N,)
    return x.to(dtype), w.to(dtype), b.to(dtype)


@pytest.mark.parametrize(
    "vendor, capability, flags, version, dtype, gemv, few, many",
    [
        ("AuthenticAMD", "AVX512", ["avx512f", "avx512_bf16"], "2.13.0", torch.float32, "onednn", "onednn", "onednn"),
        ("AuthenticAMD", "AVX512", ["avx512f", "avx512_bf16"], "2.13.0", torch.bfloat16, "onednn", "onednn", "onednn"),
        ("GenuineIntel", "AVX512", ["avx512f", "amx_bf16", "amx_tile"], "2.13.0", torch.bfloat16, "onednn", "onednn", "onednn"),
        ("GenuineIntel", "AVX512", ["avx512f", "amx_bf16"], "2.13.0", torch.float32, "torch", "onednn", "torch"),  # MKL's GEMV up to 3 rows
        ("GenuineIntel", "AVX2", ["avx2"], "2.13.0", torch.float32, "torch", "torch", "torch"),
        ("GenuineIntel", "AVX512", ["avx512f"], "2.14.0", torch.float32, "torch", "torch", "torch"),  # untested torch
        ("AuthenticAMD", "AVX512", ["avx512f"], "2.13.0", torch.bfloat16, "torch", "torch", "widened"),  # no native bf16 dot products
        ("AuthenticAMD", "AVX2", ["avx2"], "2.13.0", torch.float32, "torch", "torch", "torch"),
        ("AuthenticAMD", "AVX512", ["avx512f", "avx512_bf16"], "2.14.0", torch.bfloat16, "torch", "torch", "torch"),  # untested torch
        ("AuthenticAMD", "AVX512", ["avx512f", "avx512_bf16"], "2.13.0", torch.float16, "torch", "torch", "torch"),
    ],
)
def test_the_few_rows_rule_depends_on_cpu_flags_dtype_rows_and_torch_version_only(machine, vendor, capability, flags, version, dtype,
                                                                                   gemv, few, many):
    """The paths the rule names on each pretended machine, against the table (nothing timed: test_linear.py)."""
    machine(vendor, capability, flags, version=version)
    assert hl.choose_few_rows(dtype, hl.GEMV_ROWS)[0] == gemv
    assert hl.choose_few_rows(dtype, hl.GEMV_ROWS + 1)[0] == hl.choose_few_rows(dtype)[0] == few
    assert hl.choose(dtype)[0] == many
    if dtype in (torch.float32, torch.bfloat16):
        for rows, path in ((1, gemv), (hl.GEMV_ROWS, gemv), (hl.GEMV_ROWS + 1, few), (hl.DECODE_ROWS, few)):
            x, w, b = decode_case(rows, dtype)
            assert hl.uses_onednn(x, w, b) == (path == "onednn"), rows  # a decode-sized weight: the few-rows rule
        assert hl.uses_onednn(x[:, :, :128], w[:128, :128].contiguous(), b[:128]) is False  # a small weight: F.linear
        x_many = torch.randn(64, 1, K).to(dtype)
        assert hl.uses_onednn(x_many, w, b) == (many == "onednn")  # 64 rows: the many-rows rule


@pytest.mark.parametrize("vendor, recorded", [("GenuineIntel", "torch"), ("AuthenticAMD", "onednn")])
def test_few_rows_under_autograd_keep_the_faster_backward(machine, vendor, recorded):
    """On Intel a float32 call of 4-16 rows takes oneDNN for inference only: one autograd records keeps
    F.linear (its backward at so few rows was the faster); AMD's fp32 rule takes oneDNN either way."""
    machine(vendor, "AVX512", ["avx512f"])
    x, w, b = decode_case(8, torch.float32)
    assert hl.uses_onednn(x, w, b) is True  # nothing wants a gradient: inference
    for wants in (x, w, b):
        wants.requires_grad_(True)
        assert hl.uses_onednn(x, w, b) is (recorded == "onednn")
        with torch.no_grad():
            assert hl.uses_onednn(x, w, b) is True  # not recorded under no_grad
        wants.requires_grad_(False)


def test_rows_up_to_the_bound_take_the_few_rows_rule(machine):
    machine("GenuineIntel", "AVX512", ["avx512f"])  # float32 on Intel: MKL's GEMV, oneDNN for 4-16 rows, then MKL's GEMM
    w = torch.randn(N, K)
    for rows, path in [(1, False), (hl.GEMV_ROWS + 1, True), (hl.DECODE_ROWS, True), (hl.DECODE_ROWS + 1, False), (hl.MIN_ROWS, False)]:
        assert hl.uses_onednn(torch.randn(rows, K), w) is path, rows


@pytest.mark.parametrize("flags, path", [(["avx512f", "avx512_bf16"], "onednn"), (["avx512f", "amx_bf16"], "onednn"), (["avx512f"], "torch")])
def test_bf16_takes_the_packed_weight_at_any_rows_unless_autograd_records_the_call(machine, flags, path):
    """With native bf16 dot products, every bf16 inference call runs on oneDNN's weight packed once (torch's bf16
    GEMM runs oneDNN too, packing the plain weight again each call); one autograd records keeps F.linear from
    DECODE_ROWS + 1 rows on (its backward)."""
    machine("AuthenticAMD", "AVX512", flags)
    assert hl.choose(torch.bfloat16)[0] == (path if path == "onednn" else "widened") and hl.choose(torch.bfloat16, recorded=True)[0] == "torch"
    w = torch.randn(N, K, dtype=torch.bfloat16)
    for rows in (1, hl.DECODE_ROWS, hl.DECODE_ROWS + 1, 256, 2048):
        x = torch.randn(rows, K, dtype=torch.bfloat16)
        assert hl.uses_onednn(x, w) is (path == "onednn"), rows
        with torch.enable_grad():
            assert hl.uses_onednn(x, w.requires_grad_(True)) is (path == "onednn" and rows <= hl.DECODE_ROWS), rows
        w.requires_grad_(False)


@pytest.mark.parametrize("vendor, flags, fp32, bf16, fp32_many, bf16_many", [
    ("AuthenticAMD", ["avx512f", "avx512_bf16"], "panels", "panels", "panels", "panels"),
    ("GenuineIntel", ["avx512f", "avx512_bf16"], "panels", "panels", "torch", "panels"),  # MKL's float32 GEMM for many rows
    ("GenuineIntel", ["avx512f", "avx512_bf16", "amx_bf16", "amx_tile"], "panels", "panels", "torch", "onednn"),  # AMX: oneDNN's for prompts
    ("AuthenticAMD", ["avx512f"], "panels", "torch", "panels", "widened"),  # no native bf16 dot products
])
def test_where_the_library_builds_inference_takes_the_panels(machine, vendor, flags, fp32, bf16, fp32_many, bf16_many):
    """On a CPU whose torch kernels run AVX-512, with headwise's C++ library built, a decode-shaped inference call of
    float32 (and of bfloat16 with AVX512-BF16, AMX tiles or not) takes the panels GEMM, and so does every inference call
    where oneDNN's packed weight would run it otherwise (float32 on AMD, bfloat16 without AMX: one packed copy); a call
    autograd records keeps its own rule; one where the library does not build never takes them, an AVX2 CPU only for
    float32 calls of decode shape."""
    machine(vendor, "AVX512", flags, library=True)
    assert hl.choose_few_rows(torch.float32)[0] == hl.choose_few_rows(torch.float32, 1)[0] == fp32
    assert hl.choose_few_rows(torch.bfloat16)[0] == hl.choose_few_rows(torch.bfloat16, 1)[0] == bf16
    assert (hl.choose(torch.float32)[0], hl.choose(torch.bfloat16)[0]) == (fp32_many, bf16_many)
    assert "panels" not in (hl.choose(torch.float32, recorded=True)[0], hl.choose(torch.bfloat16, recorded=True)[0])
    assert hl.describe()["few_rows"]["float32"]["reason"].startswith("float32 inference, 1-16 rows, AVX-512 kernels: headwise's C++ GEMM")
    here = (torch.float32, torch.float32) in panels.operands(compiled=False)  # what this machine's library runs eagerly
    for rows, path in ((4, fp32), (64, fp32_many)):
        x, w, b = decode_case(rows, torch.float32)
        want = path if path != "panels" or here else "torch"
        assert hl.path_for(x, w, b) == want, rows
        with torch.no_grad():
            assert hl.path_for(x, w.requires_grad_(True), b) == want, rows
        assert hl.path_for(x, w, b) != "panels", rows  # autograd records it: no backward in the panels
        with torch.inference_mode():
            wanted = "onednn" if vendor == "AuthenticAMD" or rows <= hl.DECODE_ROWS else "torch"  # the rule without the panels
            wanted = wanted if path != "panels" or here else "torch"  # operands this machine's panels do not take: F.linear
            assert hl.path_for(x, torch.randn(N, K), b) == wanted, rows  # an inference tensor: nothing packed is kept
    machine(vendor, "AVX512", flags, library=False)
    assert "panels" not in (hl.choose_few_rows(torch.float32)[0], hl.choose_few_rows(torch.bfloat16)[0], hl.choose(torch.float32)[0])
    machine(vendor, "AVX2", ["avx2"], library=True)  # up to AVX2_ROWS rows, decode-shaped or not
    assert hl.choose_few_rows(torch.float32)[0] == hl.choose_few_rows(torch.float32, 1)[0] == "panels"
    assert hl.choose(torch.float32)[0] == "torch"
    assert hl.choose(torch.bfloat16)[0] == "widened"  # many rows: beyond AVX2_WIDE_ROWS
    assert hl.choose_few_rows(torch.float32)[1].startswith(f"float32 inference, 1-{hl.AVX2_ROWS} rows, AVX2 kernels:")
    assert hl.choose_few_rows(torch.bfloat16, 1)[0] == hl.choose_few_rows(torch.bfloat16)[0] == "panels"
    assert hl.choose_few_rows(torch.bfloat16)[1].startswith(f"bfloat16 inference, 1-{hl.AVX2_WIDE_ROWS} rows, AVX2 kernels, each pair widened")
    assert hl.describe()["compiled_step"]["float32"]["path"] == "inductor"  # a compiled step's: not measured with AVX2


def test_forcing_the_panels_takes_every_inference_call_they_can_run(machine):
    machine("GenuineIntel", "AVX512", ["avx512f", "avx512_bf16"], library=True)
    with hl.use_path("panels"):
        assert hl.choose(torch.float32) == hl.choose_few_rows(torch.bfloat16) == ("panels", "forced by use_path")
        assert hl.choose(torch.float32, recorded=True)[0] == "torch"
        assert hl.choose(torch.float64)[0] == "torch"
        if (torch.float32, torch.float32) in panels.operands(compiled=False):
            x, w, b = decode_case(64, torch.float32)  # 64 rows: many, forced all the same
            assert hl.path_for(x, w, b) == "panels"
            torch.testing.assert_close(hl.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
            assert hl.path_for(x[:2, :, :128], w[:128, :128].contiguous(), b[:128]) == "torch"  # few rows of a small weight


def test_forcing_decides_decode_shapes_too(machine, monkeypatch):
    machine("GenuineIntel", "AVX512", [])
    with hl.use_path("onednn"):
        assert hl.choose_few_rows(torch.bfloat16) == ("onednn", "forced by use_path")
    monkeypatch.setenv(hl.ENV, "torch")
    assert hl.choose_few_rows(torch.float32) == ("torch", "forced by HEADWISE_LINEAR")


@pytest.mark.parametrize("vendor, flags, fp32_gemv, fp32, bf16", [
    ("AuthenticAMD", ["avx512f", "avx512_bf16"], "onednn", "onednn", "onednn"),
    ("GenuineIntel", ["avx512f"], "torch", "onednn", "torch"),
])
def test_describe_reports_the_few_rows_decision(machine, vendor, flags, fp32_gemv, fp32, bf16):
    machine(vendor, "AVX512", flags)
    info = hl.describe()["few_rows"]
    assert info["rows"] == 16 and info["min_weight"] == 2**17 and info["gemv"]["rows"] == 3
    assert (info["gemv"]["float32"]["path"], info["float32"]["path"], info["bfloat16"]["path"]) == (fp32_gemv, fp32, bf16)
    assert info["gemv"]["bfloat16"] == info["bfloat16"]
    assert info["bfloat16"]["reason"].startswith("bfloat16 with avx512_bf16" if bf16 == "onednn" else "bfloat16 on a CPU without avx512_bf16")


def plain_error(x, w, b, ref):
    """The error of F.linear computed in x's dtype against ref: what an honest low-precision GEMM makes."""
    got = F.linear(x, w, b)
    return (got.double() - ref).norm() / ref.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("shape", [(N, K), (2304, 768), (768, 3072)])
def test_each_path_matches_the_float64_reference_at_decode_shapes(linear_path, dtype, rows, shape):
    if linear_path == "onednn" and onednn.ops_error(dtype) is not None:
        pytest.skip(f"oneDNN's private ops fail for {dtype} here")
    x, w, b = decode_case(rows, dtype, n=shape[0], k=shape[1])
    if linear_path == "panels" and (dtype, dtype) not in panels.operands(compiled=False):
        pytest.skip(f"the panels do not multiply {dtype} here")
    assert hl.path_for(x, w, b) == linear_path
    ref = ref_linear(x, w, b)  # (rows, 1, N) float64 of the rounded operands
    with torch.inference_mode():
        got = hl.linear(x, w, b)
        again = hl.linear(x, w, b)  # the packed weight, made once, read again
    assert got.shape == (rows, 1, shape[0]) and got.dtype == dtype
    err = ((got.double() - ref).norm() / ref.norm()).item()
    if dtype == torch.float32:
        assert err < 1e-6
    else:
        assert err <= 2 * plain_error(x, w, b, ref) + 1e-6  # bf16: within 2x a plain bf16 GEMM's error
    torch.testing.assert_close(again, got, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_models_decode_step_agrees_on_both_paths(dtype):
    """GPT-2's projections and tied LM head at one row: the same greedy tokens and close logits on either path."""
    if onednn.ops_error(dtype) is not None:
        pytest.skip(f"oneDNN's private ops fail for {dtype} here")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=256, n_layer=2, n_head=4)).eval().to(dtype)
    ids = torch.randint(0, 1024, (2, 5), generator=torch.Generator().manual_seed(1))
    logits = {}
    for path in ("torch", "onednn", "panels") if (dtype, dtype) in panels.operands(compiled=False) else ("torch", "onednn"):
        with hl.use_path(path):
            caches = model.new_caches(2, 8)
            model(ids, cache=caches, logits_to_keep=1)
            logits[path] = model(ids[:, :1], cache=caches)[:, 0].float()  # (B, vocab): one row per sequence
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(logits["onednn"], logits["torch"], rtol=tol, atol=tol)
    if "panels" in logits:
        torch.testing.assert_close(logits["panels"], logits["torch"], rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- decode calls decided once


@pytest.mark.parametrize("bias", [True, False])
def test_a_decode_call_is_prepared_once_and_follows_every_change(linear_path, bias):
    """``project`` and ``project_many`` keep what a decode-shaped inference call runs; every change a
    full call would see (weights written or replaced, hooks, the path, grad mode) is seen."""
    layers = [torch.nn.Linear(K, n, bias=bias) for n in (N, 256, 256)]
    x = decode_case(2, torch.float32)[0]  # (2, 1, K)

    def check(*, many=True):
        with torch.no_grad():
            outs = hl.project_many(layers, x) if many else [hl.project(layers[0], x)]
        for out, layer in zip(outs, layers, strict=False):
            assert ((out.double() - ref_linear(x, layer.weight, layer.bias)).norm() / out.double().norm()).item() < 1e-6
        return outs

    first = check()
    assert check()[0].data_ptr() != first[0].data_ptr()  # a new output each call
    check(many=False)
    keys = [key for key in weight_cache.READY if id(layers[0]) in key]
    assert keys, "a decode-shaped call under no_grad is kept"
    with torch.no_grad():
        layers[1].weight.mul_(-2.0)  # in place: _version moves
    check()
    layers[2].load_state_dict(torch.nn.Linear(K, 256, bias=bias).state_dict())
    check()
    layers[0].weight.data = torch.randn(N, K)  # a new tensor under the same Parameter
    check(), check(many=False)
    layers[0].weight = torch.nn.Parameter(torch.randn(N, K))  # a new Parameter
    check(), check(many=False)
    seen = []
    handle = layers[2].register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    check()
    assert seen == [torch.Size([2, 1, 256])]  # a hooked layer runs as it is
    handle.remove()
    for other in {"torch", "onednn", "panels"} - {linear_path}:
        if (other != "onednn" or onednn.ops_error(torch.float32) is None) and (other != "panels" or panels.available()):
            with hl.use_path(other):
                check()
    outs = hl.project_many(layers, x.requires_grad_(True))  # autograd: the full path, every weight its gradient
    sum(o.sum() for o in outs).backward()
    assert all(layer.weight.grad is not None for layer in layers)
    del layers[:]
    assert not [key for key in keys if key in weight_cache.READY], "kept calls die with their layers"


def test_a_planned_loop_decides_each_call_once_and_follows_every_weight_change(linear_path, monkeypatch):
    """Inside ``planned`` (generate's flat step) a layer group's decision is made at its first call and asked only
    of its tensors' state after that: a weight written, loaded, set through ``.data`` or replaced is seen."""
    from headwise.linear import projection

    layers = [torch.nn.Linear(K, n) for n in (N, 256)]
    x = decode_case(2, torch.float32)[0]  # (2, 1, K)
    decided = []
    decide = projection._decide
    monkeypatch.setattr(projection, "_decide", lambda *args: decided.append(1) or decide(*args))
    kept: dict = {}

    def check():
        with torch.no_grad(), projection.planned(kept):
            outs = [*hl.project_many(layers, x), hl.project(layers[1], x)]
        for out, layer in zip(outs, [*layers, layers[1]], strict=True):
            assert ((out.double() - ref_linear(x, layer.weight, layer.bias)).norm() / out.double().norm()).item() < 1e-6

    check()
    assert len(decided) == 2 and len(kept) == 2  # the group and the lone layer, each decided once
    check(), check()
    assert len(decided) == 2, "later calls ask nothing but the weights' state"
    with torch.no_grad():
        layers[1].weight.mul_(-2.0)  # in place: _version moves
    check()
    assert len(decided) == 4  # both entries read layers[1]
    layers[0].load_state_dict(torch.nn.Linear(K, N).state_dict())
    check()
    layers[0].weight.data = torch.randn(N, K)  # a new tensor under the same Parameter
    check()
    layers[1].bias = torch.nn.Parameter(torch.randn(256))  # a new Parameter
    check()
    assert getattr(projection._steps, "kept", None) is None  # outside the loop, every call decides again


def test_a_kept_decode_call_follows_the_rows_band(machine):
    """Where the rule sends 1..GEMV_ROWS rows and GEMV_ROWS + 1..DECODE_ROWS rows apart (float32 on an
    Intel CPU with AVX-512), a layer kept for one batch size runs the other's own decision."""
    machine("GenuineIntel", "AVX512", ["avx512f"])
    if onednn.ops_error(torch.float32) is not None:
        pytest.skip("oneDNN's private ops fail for float32 here")
    lin = torch.nn.Linear(K, N)
    with torch.no_grad():
        for rows, run in ((1, F.linear), (8, onednn.inner_product), (hl.GEMV_ROWS, F.linear), (hl.GEMV_ROWS + 1, onednn.inner_product)):
            x = decode_case(rows, torch.float32)[0]  # (rows, 1, K)
            out = hl.project(lin, x)
            kept = [entry for key, entry in weight_cache.READY.items() if id(lin) in key and key[-4] == (rows <= hl.GEMV_ROWS)]
            assert len(kept) == 1 and kept[0].run is run, rows
            assert ((out.double() - ref_linear(x, lin.weight, lin.bias)).norm() / out.double().norm()).item() < 1e-6


@pytest.mark.parametrize("dtype, beyond", [(torch.float32, "torch"), (torch.bfloat16, "widened")])
def test_rows_on_avx2_take_the_panels_up_to_their_bound(machine, dtype, beyond):
    """Where torch's kernels run AVX2, a float32 inference call of 1..AVX2_ROWS rows (bfloat16: AVX2_WIDE_ROWS) takes the panels
    (bfloat16: each pair widened to float32 in registers; a decode-shaped call kept) and one of more rows F.linear
    (bfloat16: ``widened``), as do those of a small weight; each output within float32's or half a bfloat16 step's rounding of the float64 sum."""
    machine("AuthenticAMD", "AVX2", ["avx2"], library=True)
    if (dtype, dtype) not in panels.operands(compiled=False):
        pytest.skip(f"the panels do not multiply {dtype} here")
    lin = torch.nn.Linear(K, N).to(dtype)
    with torch.no_grad():
        top = hl.AVX2_ROWS if dtype == torch.float32 else hl.AVX2_WIDE_ROWS
        for rows in (1, hl.DECODE_ROWS, hl.DECODE_ROWS + 1, hl.AVX2_ROWS, hl.AVX2_ROWS + 1, top, top + 1):
            x = decode_case(rows, dtype)[0]  # (rows, 1, K)
            assert hl.path_for(x, lin.weight, lin.bias) == ("panels" if rows <= top else beyond), rows
            out = hl.project(lin, x)
            if rows <= hl.DECODE_ROWS:
                kept = [entry for key, entry in weight_cache.READY.items() if id(lin) in key and key[-4] == (rows <= hl.GEMV_ROWS)]
                assert len(kept) == 1 and kept[0].run is torch.ops.headwise.panels_linear, rows
            ref = ref_linear(x, lin.weight, lin.bias)  # float64 of the rounded operands
            step = 2.0**-8 if dtype == torch.bfloat16 else 1e-5
            assert out.dtype == dtype and ((out.double() - ref).abs() <= ref.abs() * step + step).all(), rows
        small = torch.nn.Linear(256, 256).to(dtype)  # under MIN_DECODE_WEIGHT: its rows run faster in MKL's GEMM
        assert hl.path_for(torch.randn(hl.MIN_ROWS, 256).to(dtype), small.weight, small.bias) == beyond


def test_a_decode_call_of_inference_tensors_is_not_kept():
    with torch.inference_mode():
        lin = torch.nn.Linear(K, N)  # no version counter: a change could not be seen
        x = decode_case(1, torch.float32)[0]
        torch.testing.assert_close(hl.project(lin, x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert not [key for key in weight_cache.READY if id(lin) in key]


def test_a_call_that_cannot_run_leaves_the_kept_decision_as_it_was(linear_path):
    layers = [torch.nn.Linear(K, N), torch.nn.Linear(K, 256)]
    x = decode_case(1, torch.float32)[0]  # (1, 1, K)
    with torch.no_grad():
        hl.project_many(layers, x)
        kept = {key: entry for key, entry in weight_cache.READY.items() if id(layers[0]) in key}
        with pytest.raises(ValueError, match=r"layers\[0\] takes x \(\.\.\., K="):
            hl.project_many(layers, torch.randn(1, 1, K + 16))  # the wrong width: refused by name
        assert {key: entry for key, entry in weight_cache.READY.items() if id(layers[0]) in key} == kept


def test_a_decode_call_under_inference_mode_is_kept_on_the_packed_stack():
    """Layers built outside inference mode, decoded inside it: the stack made there is packed and kept as under no_grad."""
    layers = [torch.nn.Linear(K, n, bias=False) for n in (N, 256, 256)]
    x = decode_case(1, torch.float32)[0]  # (1, 1, K)
    with torch.inference_mode():
        outs = hl.project_many(layers, x)
    kept = [entry for key, entry in weight_cache.READY.items() if id(layers[0]) in key]
    assert kept, "the stack made under inference mode is a plain tensor: packed and kept"
    with torch.no_grad():
        path = hl.path_for(x, torch.cat([layer.weight for layer in layers]), None)  # the rule's path for this call
    if path != "torch":
        assert kept[0].run is {"onednn": onednn.inner_product, "panels": torch.ops.headwise.panels_linear}[path]  # on the packed stack
    for out, layer in zip(outs, layers, strict=True):
        torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_the_compiled_graphs_ops_keep_a_decode_call_by_its_weights(linear_path, bias):
    """``headwise::linear`` and ``headwise::linear_many`` (what a compiled inference call runs) get the weights,
    not their layers: a decode-shaped call is kept by the weight tensors and follows every change to them."""
    import headwise.linear.custom_ops  # noqa: F401  (registers the ops)

    layers = [torch.nn.Linear(K, n, bias=bias) for n in (N, 256)]
    x = decode_case(1, torch.float32)[0]  # (1, 1, K)

    def check(layers):
        with torch.no_grad():
            many = torch.ops.headwise.linear_many(x, [m.weight for m in layers], [m.bias for m in layers] if bias else [])  # (1, 1, N + 256)
            one = torch.ops.headwise.linear(x, layers[1].weight, layers[1].bias)  # (1, 1, 256)
        want = [ref_linear(x, layer.weight, layer.bias) for layer in layers]
        for got, ref in ((many, torch.cat(want, -1)), (one, want[1])):
            assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-6

    check(layers)
    firsts = {id(layers[0].weight), id(layers[1].weight)}
    kept = [key for key in weight_cache.READY if key[0] in firsts]
    assert len(kept) == 2, "both ops keep the decode call, keyed by the weights"
    with torch.no_grad():
        layers[1].weight.mul_(-3.0)  # in place: seen by both
    check(layers)
    del layers
    assert not [key for key in kept if key in weight_cache.READY], "kept calls die with their weights"


@pytest.mark.skipif(not torch._C.has_mkl, reason="a torch without MKL has no MKL GEMM to leave out")
@pytest.mark.skipif(not hasattr(importlib.import_module("torch._inductor.select_algorithm"), "get_algorithm_selector_cache"),
                    reason="this torch has no hook on inductor's choices: autotune chooses alone")
def test_a_frozen_graph_runs_inductors_gemm_where_it_has_one_not_mkls():
    """Under ``projection.freezing()`` a float32 projection of one row runs inductor's C++ GEMM, never MKL's packed
    GEMM, whatever max-autotune's timing would say. ``deterministic`` makes inductor pick an ATen kernel without
    timing: compiled so without ``freezing()`` (inductor's freezing alone) the graph calls MKL, with it the template."""
    from torch._inductor import config as inductor
    from torch._inductor.utils import run_and_get_code

    from headwise.linear import projection

    layer = torch.nn.Linear(K, N).eval()
    x = torch.randn(1, K)  # (1, K): one row, a size inductor does not make symbolic
    codes = {}
    with torch.no_grad():
        for way in ("inductor's freezing", "projection.freezing()"):
            torch._dynamo.reset()
            run = torch.compile(layer, fullgraph=True, options={"max_autotune": True})
            with inductor.patch(deterministic=True, freezing=True), projection.freezing() if way != "inductor's freezing" else contextlib.nullcontext():
                got, code = run_and_get_code(run, x)
            codes[way] = "\n".join(code)
            want = ref_linear(x, layer.weight, layer.bias)
            assert ((got.double() - want).norm() / want.norm()).item() < 1e-6, way
    assert "_mkl_linear" in codes["inductor's freezing"], "the control compiles to MKL's GEMM"
    assert "_mkl_linear" not in codes["projection.freezing()"] and "micro_gemm" in codes["projection.freezing()"]


@pytest.mark.parametrize("panels_on", [True, False], ids=["panels", "no panels"])
def test_a_graph_traced_with_the_weights_frozen_runs_the_projection_as_f_linear(panels_on, monkeypatch):
    """Under ``projection.freezing()`` (the compiled step's setting, per thread) Dynamo traces ``linear`` as
    ``F.linear``, for inductor to pack the frozen weight (or, for float32 where ``panels`` runs, as its packing and
    GEMM); outside it, as ``headwise::linear``. The setting is a guard: the graph traced one way is not reused the
    other way."""
    from headwise.linear import panels, projection

    if panels_on and (torch.float32,) * 2 not in panels.operands():
        pytest.skip("a compiled step's panels run where torch's kernels are AVX-512 and the library builds")
    if not panels_on:
        monkeypatch.setattr(panels, "_operands", lambda: ())
    layer = torch.nn.Linear(K, N)
    x = decode_case(1, torch.float32)[0]  # (1, 1, K)
    traced: list[set[str]] = []

    def recording(gm, inputs):
        traced.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm

    torch._dynamo.reset()
    run = torch.compile(lambda x: hl.linear(x, layer.weight, layer.bias), backend=recording, fullgraph=True)
    with torch.no_grad():
        with projection.freezing():
            frozen = run(x)
        plain = run(x)
    assert len(traced) == 2 and not projection.frozen()
    if panels_on:
        assert {"headwise.pack_panels", "headwise.panels_linear"} <= traced[0]
    else:
        assert any("linear" in t and "headwise" not in t for t in traced[0]) and not any("headwise" in t for t in traced[0])
    assert "headwise.linear" not in traced[0] and any("headwise.linear" in t for t in traced[1])
    want = ref_linear(x, layer.weight, layer.bias)
    for got in (frozen, plain):
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-6


@pytest.mark.parametrize("vendor, capability", [("AuthenticAMD", "AVX2"), ("GenuineIntel", "AVX512")])
def test_bf16_prompts_without_native_dot_products_take_float32s_gemm(machine, vendor, capability):
    """Without avx512_bf16 or amx_bf16 a bfloat16 inference call of more than DECODE_ROWS rows runs as a float32 GEMM
    of its operands widened, rounded once: the error of torch's bfloat16 GEMM against float64; decode rows and calls
    autograd records keep F.linear."""
    machine(vendor, capability, ["avx2"] if capability == "AVX2" else ["avx512f"])
    x, w, b = decode_case(hl.DECODE_ROWS + 1, torch.bfloat16, n=2304, k=768)
    assert hl.path_for(x, w, b) == "widened" and hl.path_for(x[:hl.DECODE_ROWS], w, b) == "torch"
    assert hl.path_for(x, w.float(), b) == "torch"  # operands of two dtypes: F.linear's own error
    with torch.enable_grad():
        assert hl.path_for(x, w.requires_grad_(True), b) == "torch"
    w.requires_grad_(False)
    ref = ref_linear(x, w, b)  # float64 of the rounded operands
    got = hl.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (hl.DECODE_ROWS + 1, 1, 2304)
    assert (got.double() - ref).norm() / ref.norm() <= 1.01 * plain_error(x, w, b, ref) + 1e-6
    # the sums rounded once to bfloat16: each output within half a bfloat16 step of the float64 sum, but for sum order
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3).all()
    machine(vendor, capability, ["avx512f", "avx512_bf16"])
    assert hl.path_for(x, w, b) != "widened"  # native bf16 dot products: oneDNN's GEMM
