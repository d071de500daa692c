"""headwise.linear: both paths float32-exact and differentiable for every operand layout, the
rule that picks the path, the guard on the private ops, never-stale packed and stacked weights,
and the modules that use it still matching the float64 reference (bf16 within 2x a plain bf16 one)."""

import copy
import math
import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from reference import linear as ref_linear
from reference import reference_mha

import headwise as hw
from headwise import linear as hl
from headwise.linear import onednn, weight_cache

EPS = torch.finfo(torch.float32).eps


def rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def make(m=96, k=80, n=72, *, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=gen)  # (B, T, K)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)  # (N, K)
    b = torch.randn(n, generator=gen) if bias else None  # (N,)
    return x, w, b


# Inputs of one (B=2, T=48, K=80) shape in the layouts callers hand over: a batch-first 3-D view of a
# (T, B, K) tensor, a slice of a wider tensor, a broadcast (stride-0) row, and a plain contiguous tensor.
LAYOUTS = {
    "contiguous": lambda x: x.clone(),
    "batch-first view": lambda x: x.transpose(0, 1).contiguous().transpose(0, 1),
    "sliced": lambda x: torch.cat([x, torch.randn_like(x)], dim=-1)[..., : x.shape[-1]],
    "expanded": lambda x: x[:1, :1].expand_as(x),
}
LOSSES = {
    "sum": lambda y: y.sum(),  # an expanded (stride-0) gradient reaches the backward
    "mean": lambda y: y.mean(),
    "dense": lambda y: (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(1))).sum(),
}


# ----------------------------------------------------------------------------- the op, each path forced


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_forward_is_float32_exact_for_every_input_layout(linear_path, layout, bias, grad):
    x, w, b = make(bias=bias)
    x = LAYOUTS[layout](x)
    w.requires_grad_(grad)
    assert hl.path_for(x, w, b) == ("torch" if linear_path == "panels" and grad else linear_path)  # the panels: inference only
    ref = ref_linear(x, w.detach(), b)  # (B, T, N) float64
    got = hl.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert rel_err(got, ref) <= max(4 * rel_err(F.linear(x, w, b), ref), 4 * EPS)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_float64_for_every_layout_and_loss(linear_path, layout, loss, bias):
    x0, w0, b0 = make(bias=bias)
    x = LAYOUTS[layout](x0).detach().requires_grad_(True)
    w = w0.clone().requires_grad_(True)
    b = None if b0 is None else b0.clone().requires_grad_(True)
    y = hl.linear(x, w, b)
    assert (type(y.grad_fn).__name__ == "OneDNNLinearBackward") == (linear_path == "onednn")
    LOSSES[loss](y).backward()
    x64, w64 = x.detach().double().requires_grad_(True), w0.double().requires_grad_(True)
    b64 = None if b0 is None else b0.double().requires_grad_(True)
    LOSSES[loss](ref_linear(x64, w64, b64)).backward()
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad), (None if b is None else b.grad, None if b is None else b64.grad)):
        if want is not None:
            assert got.shape == want.shape and rel_err(got, want) < 8 * EPS


def test_a_sliced_or_transposed_weight_takes_f_linear_and_still_trains(linear_path):
    x, _, b = make()
    for weight in (torch.randn(72, 160)[:, :80], torch.randn(80, 72).t()):  # (N, K) views whose rows are not contiguous
        weight.requires_grad_(True)
        assert not hl.uses_onednn(x, weight, b)
        y = hl.linear(x, weight, b)
        assert rel_err(y, ref_linear(x, weight.detach(), b)) < 4 * EPS
        y.sum().backward()
        assert rel_err(weight.grad, torch.ones(96, 72, dtype=torch.float64).T @ x.reshape(-1, 80).double()) < 8 * EPS


def test_only_the_inputs_that_need_grad_get_one(linear_path):
    x, w, b = make()
    w.requires_grad_(True)
    hl.linear(x, w, b).sum().backward()
    assert w.grad is not None and x.grad is None and b.grad is None


def test_packed_weight_follows_every_change(linear_path):
    lin = torch.nn.Linear(80, 72)
    x = make()[0]

    def check():
        with torch.no_grad():
            got = hl.project(lin, x)
        assert rel_err(got, ref_linear(x, lin.weight, lin.bias)) < 1e-6

    check()
    with torch.no_grad():
        lin.weight.mul_(-3.0)  # in place: _version moves
    check()
    lin.load_state_dict({"weight": torch.randn(72, 80), "bias": torch.randn(72)})
    check()
    lin.weight.data = torch.randn(72, 80)  # a new tensor under the same Parameter
    check()
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    hl.project(lin, x).square().sum().backward()
    opt.step()
    check()


def test_inference_mode_and_inference_tensors(linear_path):
    x, w, b = make()
    with torch.inference_mode():
        lin = torch.nn.Linear(80, 72)  # parameters that are inference tensors: no version counter
        assert rel_err(hl.project(lin, x), ref_linear(x, lin.weight, lin.bias)) < 1e-6
        assert rel_err(hl.linear(x, w, b), ref_linear(x, w, b)) < 1e-6
        outs = hl.project_many([lin, torch.nn.Linear(80, 40)], x)  # inference tensors: one call per layer
        assert rel_err(outs[0], ref_linear(x, lin.weight, lin.bias)) < 1e-6


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
def test_per_call_fallbacks_to_f_linear():
    x, w, b = make()
    with hl.use_path("onednn"):
        assert not hl.uses_onednn(x.double(), w.double(), b.double())  # float64: oneDNN has none
        assert not hl.uses_onednn(x[:, :2], w, b)  # 4 rows: a decode step
        assert not hl.uses_onednn(x, w.bfloat16(), b)  # mixed dtypes: F.linear raises its own error
        with torch.backends.mkldnn.flags(enabled=False):  # the user's switch
            assert not hl.uses_onednn(x, w, b)
        torch.testing.assert_close(hl.linear(x.double(), w.double(), b.double()), F.linear(x.double(), w.double(), b.double()), rtol=0, atol=0)
    with hl.use_path("torch"):
        assert not hl.uses_onednn(x, w, b)


def test_project_calls_hooked_or_replaced_layers_as_they_are(linear_path):
    x = make()[0]
    lin = torch.nn.Linear(80, 72)
    seen = []
    lin.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    hl.project(lin, x)
    hl.project_many([lin, torch.nn.Linear(80, 72)], x)
    assert seen == [torch.Size([2, 48, 72])] * 2

    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    dbl = Doubled(80, 72)
    torch.testing.assert_close(hl.project(dbl, x), 2 * F.linear(x, dbl.weight, dbl.bias))


@pytest.mark.parametrize("rows", [1, 48])
@pytest.mark.parametrize("kind", ["linear", "int8", "int8-a8"])
def test_a_forward_set_on_the_instance_runs(linear_path, kind, rows):
    """accelerate's hooks and offloading replace a module's forward on the instance: it runs, at every row count."""
    from headwise.quantize import Int8Linear

    torch.manual_seed(0)
    w = torch.randn(72 * 32, 80)  # 2^17+ weights: a decode call's packed or panels path where the CPU has one
    layers = [torch.nn.Linear(80, 72 * 32) if kind == "linear" else Int8Linear(w, activations="int8" if kind == "int8-a8" else "bf16")
              for _ in range(2)]
    x = torch.randn(1, rows, 80)
    with torch.no_grad():
        for layer in layers:
            hl.project(layer, x), hl.project_many(layers, x)  # the kept copies made first
        own = layers[0].forward
        layers[0].forward = lambda t: own(t) * 0
        assert hl.project(layers[0], x).abs().max() == 0
        first, second = hl.project_many(layers, x)
        assert first.abs().max() == 0
        torch.testing.assert_close(second, layers[1](x), rtol=1e-5, atol=1e-5)  # its own path: F.linear to rounding


def test_backward_hooks_fire_through_every_module():
    mha = hw.MultiHeadAttention(64, 64, 32, 0.0, num_heads=4)
    calls = []
    mha.out_proj.register_full_backward_hook(lambda m, gi, go: calls.append("own"))
    mha.W_query.register_full_backward_pre_hook(lambda m, go: calls.append("pre"))
    mha(torch.randn(2, 8, 64, requires_grad=True)).sum().backward()
    assert sorted(calls) == ["own", "pre"]
    everyone = torch.nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: calls.append(type(m).__name__))
    try:
        calls.clear()
        mha(torch.randn(2, 8, 64, requires_grad=True)).sum().backward()
        assert calls.count("Linear") == 4
    finally:
        everyone.remove()


# ----------------------------------------------------------------------------- project_many: one GEMM on both paths


@pytest.mark.parametrize("bias", [True, False])
def test_project_many_is_one_gemm_and_follows_changes(linear_path, bias):
    x = make()[0]
    layers = [torch.nn.Linear(80, n, bias=bias) for n in (72, 40, 40)]

    def check(grad):
        with torch.set_grad_enabled(grad):
            outs = hl.project_many(layers, x)
        assert [o.shape[-1] for o in outs] == [72, 40, 40]
        assert outs[0].data_ptr() + 72 * 4 == outs[1].data_ptr()  # views of one GEMM's (B, T, 152) output
        for out, layer in zip(outs, layers, strict=True):
            assert rel_err(out, ref_linear(x, layer.weight, layer.bias)) < 1e-6
        return outs

    check(False)
    with torch.no_grad():
        layers[1].weight.mul_(-2.0)
    check(False)
    layers[2].load_state_dict(torch.nn.Linear(80, 40, bias=bias).state_dict())
    check(False)
    assert all(o.requires_grad for o in check(True))


@pytest.mark.parametrize("loss", LOSSES)
def test_project_many_under_autograd_gives_every_weight_its_gradient(linear_path, loss):
    x = make()[0].requires_grad_(True)
    layers = [torch.nn.Linear(80, n) for n in (72, 40, 40)]
    layers[1].weight.requires_grad_(False)  # a frozen layer among trainable ones
    outs = hl.project_many(layers, x)
    LOSSES[loss](torch.cat(outs, -1)).backward()
    x64 = x.detach().double().requires_grad_(True)
    p64 = [(lay.weight.detach().double().requires_grad_(True), lay.bias.detach().double().requires_grad_(True)) for lay in layers]
    LOSSES[loss](torch.cat([ref_linear(x64, w, b) for w, b in p64], -1)).backward()
    assert rel_err(x.grad, x64.grad) < 8 * EPS
    assert layers[1].weight.grad is None
    for lay, (w64, b64) in zip(layers, p64, strict=True):
        assert rel_err(lay.bias.grad, b64.grad) < 8 * EPS
        if lay.weight.requires_grad:
            assert rel_err(lay.weight.grad, w64.grad) < 8 * EPS


def test_project_many_with_mixed_biases_runs_each_layer():
    x = make()[0]
    layers = [torch.nn.Linear(80, 72), torch.nn.Linear(80, 40, bias=False)]
    outs = hl.project_many(layers, x)
    assert outs[0].data_ptr() + 72 * 4 != outs[1].data_ptr()
    assert rel_err(outs[1], ref_linear(x, layers[1].weight, None)) < 1e-6


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    "vendor, capability, version, dtype, path",
    [
        ("AuthenticAMD", "AVX512", "2.13.0+cpu", torch.float32, "onednn"),
        ("AuthenticAMD", "AVX512", "2.13.0+cpu", torch.bfloat16, "widened"),  # no native bf16 dot products: float32's GEMM
        ("AuthenticAMD", "AVX2", "2.13.0+cpu", torch.bfloat16, "widened"),
        ("AuthenticAMD", "AVX2", "2.13.0+cpu", torch.float32, "torch"),
        ("GenuineIntel", "AVX512", "2.13.0+cpu", torch.float32, "torch"),
        ("AuthenticAMD", "AVX512", "2.14.0+cpu", torch.float32, "torch"),  # untested torch: off unless forced
        ("AuthenticAMD", "AVX512", "2.13.0+cpu", torch.float64, "torch"),
    ],
)
def test_the_rule_depends_on_cpu_dtype_and_torch_version_only(machine, monkeypatch, vendor, capability, version, dtype, path):
    import time

    machine(vendor, capability, version=version)
    onednn.ops_error(dtype)  # the one-time check that oneDNN's ops work here (cached): not part of the rule

    def no(*args, **kwargs):
        raise AssertionError("the rule read a clock or ran a GEMM")

    for clock in ("perf_counter", "perf_counter_ns", "monotonic", "time", "process_time", "thread_time"):
        monkeypatch.setattr(time, clock, no)
    monkeypatch.setattr(onednn, "inner_product", no)
    monkeypatch.setattr(F, "linear", no)
    assert hl.choose(dtype)[0] == path  # nothing timed, nothing run: from the facts alone
    hl.choose_few_rows(dtype)  # the decode-shaped calls' rule neither


def test_forcing_overrides_the_rule_by_env_and_by_function(machine, monkeypatch):
    machine("GenuineIntel", "AVX512", version="2.99.0")
    assert hl.choose()[0] == "torch"
    monkeypatch.setenv(hl.ENV, "onednn")
    assert hl.choose() == ("onednn", "forced by HEADWISE_LINEAR")
    with hl.use_path("torch"):
        assert hl.choose() == ("torch", "forced by use_path")
        assert hl.describe()["float32"] == {"path": "torch", "reason": "forced by use_path"}
    assert hl.choose()[0] == "onednn"
    previous = hl.set_path("torch")
    try:
        assert hl.choose() == ("torch", "forced by set_path")
    finally:
        hl.set_path(previous)
    monkeypatch.setenv(hl.ENV, "fast")
    with pytest.raises(ValueError, match=r"HEADWISE_LINEAR must be one of \('auto', 'onednn', 'panels', 'torch'\), got 'fast'"):
        hl.linear(*make())


def test_set_path_rejects_unknown_paths():
    with pytest.raises(ValueError, match=r"path must be one of \('auto', 'onednn', 'panels', 'torch'\) or None, got 'mkl'"):
        hl.set_path("mkl")


@pytest.mark.parametrize("vendor, capability, fp32", [("AuthenticAMD", "AVX512", "onednn"), ("GenuineIntel", "AVX512", "torch"),
                                                    ("AuthenticAMD", "AVX2", "torch")])
def test_describe_reports_the_machine_and_the_decision(machine, vendor, capability, fp32):
    machine(vendor, capability)
    info = hl.describe()
    assert info["cpu"]["vendor"] == vendor and info["cpu"]["capability"] == capability
    assert info["torch"] == torch.__version__ and info["tested_torch"] == ["2.13"]
    assert info["float32"]["path"] == fp32 and info["bfloat16"]["path"] == "widened"  # no native bf16 flags pretended
    assert info["few_rows"]["bfloat16"]["path"] == "torch"  # a decode step's rows: widening the weight would triple its bytes
    assert info["float32"]["reason"].startswith("AMD family 26" if fp32 == "onednn" else vendor) and info["setting"] == "auto (default)"


def test_failing_private_ops_fall_back_to_f_linear_with_one_warning(monkeypatch):
    def broken(*args):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(onednn, "inner_product", broken)
    onednn.ops_error.cache_clear()
    try:
        x, w, b = make()
        with hl.use_path("onednn"):
            with pytest.warns(RuntimeWarning, match="oneDNN's private ops fail for torch.float32 here .*no such kernel.*using F.linear"):
                assert hl.choose() == ("torch", "oneDNN's private ops fail here: RuntimeError: no such kernel")
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the second call: no second warning
                torch.testing.assert_close(hl.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)
    finally:
        onednn.ops_error.cache_clear()


def test_pyproject_states_the_tested_torch_versions():
    tomllib = pytest.importorskip("tomllib")
    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    with open(pyproject, "rb") as f:
        assert tuple(tomllib.load(f)["tool"]["headwise"]["onednn-tested-torch"]) == hl.TESTED_TORCH


# ----------------------------------------------------------------------------- the modules


def mha_weights(mha):
    return (mha.W_query.weight, mha.W_key.weight, mha.W_value.weight, mha.W_query.bias, mha.W_key.bias, mha.W_value.bias,
            mha.out_proj.weight, mha.out_proj.bias)


def gpt2_weights(attn):
    C = attn.d_in
    w, b = attn.c_attn.weight, attn.c_attn.bias
    return (w[:C], w[C : 2 * C], w[2 * C :], b[:C], b[C : 2 * C], b[2 * C :], attn.c_proj.weight, attn.c_proj.bias)


def make_module(kind, dtype=torch.float32):
    torch.manual_seed(7)
    if kind == "mha":
        mod, weights = hw.MultiHeadAttention(64, 64, 40, 0.0, num_heads=4, qkv_bias=True), mha_weights
    else:
        mod, weights = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=64, n_head=4, n_positions=40, attn_pdrop=0.0, resid_pdrop=0.0)), gpt2_weights
    return mod.to(dtype), weights


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("loss", LOSSES)
def test_module_forward_and_backward_match_float64(linear_path, kind, loss):
    mod, weights = make_module(kind)
    x = torch.randn(2, 24, 64, requires_grad=True)  # (B, T, C): 48 rows, enough for the oneDNN path
    assert hl.uses_onednn(x, mod.out_proj.weight if kind == "mha" else mod.c_proj.weight) == (linear_path == "onednn")
    out = mod(x)
    x64 = x.detach().double().requires_grad_(True)
    w64 = [t.detach().double().requires_grad_(True) for t in weights(mod)]
    ref = reference_mha(x64, *w64[:6], *w64[6:], num_heads=4, causal=True)
    assert rel_err(out, ref) < 1e-6
    LOSSES[loss](out).backward()
    LOSSES[loss](ref).backward()
    assert rel_err(x.grad, x64.grad) < 1e-5
    assert all(p.grad is not None for p in mod.parameters())
    wo = mod.out_proj.weight if kind == "mha" else mod.c_proj.weight
    assert rel_err(wo.grad, w64[6].grad) < 1e-5
    if kind == "mha":
        assert rel_err(mod.W_key.weight.grad, w64[1].grad) < 1e-5
    with torch.no_grad():  # the packed / stacked weights give the same numbers
        assert rel_err(mod(x), ref.detach()) < 1e-6


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_bf16_end_to_end_within_2x_of_a_plain_bf16_implementation(linear_path, kind):
    mod, weights = make_module(kind, torch.bfloat16)
    x = torch.randn(2, 32, 64).bfloat16()  # (B, T, C)
    with torch.no_grad():
        out = mod(x)
        assert out.dtype == torch.bfloat16
        w = weights(mod)
        ref = reference_mha(x.double(), *[t.double() for t in w], num_heads=4, causal=True)
        # plain bf16: every product and the softmax in bf16, no float32 anywhere
        q, k, v = (F.linear(x, wt, bt).view(2, 32, 4, 16).transpose(1, 2) for wt, bt in zip(w[:3], w[3:6], strict=True))  # (B, H, T, D)
        scores = (q @ k.transpose(-2, -1)) * 0.25  # (B, H, T, T)
        scores = scores.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), -math.inf)
        ctx = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(2, 32, 64)  # (B, T, C)
        plain = F.linear(ctx, w[6], w[7])
    assert rel_err(out, ref) <= 2 * rel_err(plain, ref)



@pytest.mark.slow
def test_compiled_inference_runs_the_eager_path_as_one_op_and_training_traces_the_stack(linear_path):
    """Without autograd a compiled call runs ``linear`` / the stacked GEMM as opaque ops (``headwise::linear``,
    ``headwise::linear_many``): they stack and pack once when they run, as the eager call does, and repeated
    calls add nothing. With autograd the stack is a ``torch.cat`` in the graph and no cache names the parameters."""
    torch.manual_seed(0)
    mod = hw.MultiHeadAttention(64, 64, 40, 0.0, num_heads=4)
    x = torch.randn(2, 24, 64)  # (B, T, C)
    mine = {id(p) for p in mod.parameters()}

    def entries() -> list:
        return [ids for cache in (weight_cache.STACKED, weight_cache.PACKED) for ids in cache if mine & set(ids)]

    compiled = torch.compile(mod, fullgraph=True)
    compiled(x).sum().backward()  # training: traced, nothing cached
    assert entries() == []
    assert all(p.grad is not None for p in mod.parameters())
    mod.eval()
    with torch.no_grad():
        got = compiled(x)
        made = entries()
        assert made, "the compiled inference call stacks (and on the oneDNN path packs) the weights once"
        for _ in range(3):
            compiled(x)
        assert entries() == made
        want = mod(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_the_opaque_ops_pass_torch_library_checks(linear_path, bias):
    x, w, b = make(bias=bias)
    torch.library.opcheck(torch.ops.headwise.linear, (x, w, b))
    w2 = torch.randn(24, 80)
    b2 = torch.randn(24) if bias else None
    torch.library.opcheck(torch.ops.headwise.linear_many, (x, [w, w2], [b, b2] if bias else []))
    got = torch.ops.headwise.linear_many(x, [w, w2], [b, b2] if bias else [])  # (B, T, 72 + 24)
    torch.testing.assert_close(got, torch.cat([F.linear(x, w, b), F.linear(x, w2, b2)], -1), rtol=1e-5, atol=1e-5)



def test_owns_output_only_for_layers_whose_result_nothing_else_holds():
    """A plain nn.Linear's result and an Int8Linear's are new tensors; a hook may keep one, and a subclass may
    return something it keeps, so neither is the caller's to overwrite."""
    from headwise.quantize import Int8Linear

    class Kept(torch.nn.Linear):
        pass

    class KeptInt8(Int8Linear):
        pass

    plain, hooked = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    hooked.register_forward_hook(lambda *args: None)
    int8 = Int8Linear(torch.randn(3, 4))
    assert hl.owns_output(plain) and hl.owns_output(int8)
    assert not hl.owns_output(hooked) and not hl.owns_output(Kept(4, 3)) and not hl.owns_output(KeptInt8(torch.randn(3, 4)))


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_under_autocast_every_path_gives_what_autocast_gives_f_linear(linear_path, rows):
    """Autocast casts F.linear's operands (bfloat16 on the CPU here); the panels and oneDNN's packed weight would
    compute in x's own dtype, so under autocast every call takes F.linear: nn.Linear's dtype and numbers, bit for bit."""
    lin, layers = torch.nn.Linear(768, 2304), [torch.nn.Linear(768, 512) for _ in range(3)]
    x = torch.randn(rows, 1, 768)  # (B, T, C)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert hl.path_for(x, lin.weight, lin.bias) == "torch"
        for _ in range(2):  # a decode call is never kept under autocast either
            assert torch.equal(hl.project(lin, x), lin(x)) and hl.project(lin, x).dtype == torch.bfloat16
            assert all(torch.equal(got, layer(x)) for got, layer in zip(hl.project_many(layers, x), layers, strict=True))
    with torch.no_grad():
        assert hl.project(lin, x).dtype == torch.float32  # outside it, x's dtype again


def test_onednns_self_test_is_not_fooled_by_the_callers_autocast():
    """The one-time check of oneDNN's ops computes its reference in float32 whatever autocast the first caller runs
    (a bfloat16 reference once failed it, and oneDNN stayed off for the whole process)."""
    if onednn.ops_error(torch.float32) is not None:
        pytest.skip("oneDNN's private ops fail here")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert onednn.ops_error.__wrapped__(torch.float32) is None


@pytest.mark.parametrize("grad", [True, False])
def test_a_forward_mode_tangent_is_carried_on_every_path(linear_path, grad):
    """``torch.autograd.forward_ad``: a dual x's tangent comes out of ``linear``, ``project`` and ``project_many`` as
    F.linear's (the private ops and kept copies carry none: such a call takes torch's ops), and out of a module."""
    import torch.autograd.forward_ad as fwAD

    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(300, 600)
    x, tangent = torch.randn(2, 300, generator=gen), torch.randn(2, 300, generator=gen)
    want = F.linear(tangent, lin.weight.detach())  # (2, 600): the JVP of x -> x W^T + b
    with torch.set_grad_enabled(grad), fwAD.dual_level():
        dual = fwAD.make_dual(x, tangent)
        for got in (hl.linear(dual, lin.weight, lin.bias), hl.project(lin, dual), hl.project_many([lin, lin], dual)[1]):
            torch.testing.assert_close(fwAD.unpack_dual(got).tangent, want, rtol=1e-5, atol=1e-5)
    mha = hw.MultiHeadAttention(64, 64, 8, 0.0, 4).eval()
    xm, tm = torch.randn(1, 5, 64, generator=gen), torch.randn(1, 5, 64, generator=gen)
    with torch.set_grad_enabled(grad), fwAD.dual_level():
        got = fwAD.unpack_dual(mha(fwAD.make_dual(xm, tm))).tangent
    wide = hw.MultiHeadAttention(64, 64, 8, 0.0, 4).double().eval()
    wide.load_state_dict(mha.state_dict())
    with torch.no_grad(), fwAD.dual_level():
        exact = fwAD.unpack_dual(wide(fwAD.make_dual(xm.double(), tm.double()))).tangent
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-5)


def test_a_second_derivative_runs_through_every_path(linear_path):
    """A gradient penalty (``create_graph=True``, then a backward through it): oneDNN's backward is differentiable."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 300, generator=gen), torch.randn(600, 300, generator=gen) / 20, torch.randn(600, generator=gen)
    got, want = [], []
    for run, out in ((hl.linear, got), (F.linear, want)):
        leaves = [t.double().requires_grad_() if out is want else t.clone().requires_grad_() for t in (x, w, b)]
        y = run(*leaves)
        (gx,) = torch.autograd.grad((y**2).sum(), leaves[0], create_graph=True)
        out += torch.autograd.grad(gx.pow(2).sum(), leaves[1:])
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-3)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_a_sparse_x_runs_as_f_linear_does():
    lin = torch.nn.Linear(300, 600)
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).relu()
    with torch.no_grad():
        for sparse in (x.to_sparse(), x.to_sparse_csr()):
            torch.testing.assert_close(hl.project(lin, sparse), F.linear(x, lin.weight, lin.bias))


def test_project_many_names_a_layer_of_another_width():
    a, b = torch.nn.Linear(300, 600), torch.nn.Linear(200, 600)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=r"layers\[1\] takes x \(\.\.\., K=200\) \(its weight is \(600, 200\)\), but x "
                                                                            r"has shape \(40, 300\): project_many's layers share one input width"):  # fmt: skip
            hl.project_many([a, b], torch.randn(40, 300))
    with torch.no_grad(), pytest.raises(ValueError, match=r"layers\[0\] takes x \(\.\.\., K=300\) .*but x has shape \(1, 299\)"):
        hl.project_many([a, a], torch.randn(1, 299))


def test_use_path_holds_in_its_own_thread_only():
    """Two threads' ``use_path`` blocks overlapping (A enters, B enters, A leaves, B leaves): each thread sees its own
    path inside its block, the other's never, and nothing is left forced after both (a process-wide setting was left
    at A's path)."""
    import threading

    before = hl.rule._path_setting()
    entered, a_left = threading.Barrier(2), threading.Event()
    seen = {}

    def run(name, path, leave_first):
        with hl.use_path(path):
            entered.wait()
            seen[name] = hl.rule._path_setting()
            if not leave_first:
                a_left.wait()
        if leave_first:
            a_left.set()

    threads = [threading.Thread(target=run, args=("a", "torch", True)), threading.Thread(target=run, args=("b", "onednn", False))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {"a": "torch", "b": "onednn"}
    assert hl.rule._path_setting() == before
    with pytest.raises(ValueError, match=r"path must be one of \('auto', 'onednn', 'panels', 'torch'\), got 'mkl'"), hl.use_path("mkl"):
        pass


def test_project_many_runs_a_parametrized_layer_once_a_call():
    """A spectral-normed layer in train mode steps its power iteration once a call, as torch's own call does (a look at
    ``layer.weight`` to check its width ran one more step: other numbers, other buffers)."""
    from torch.nn.utils.parametrizations import spectral_norm

    torch.manual_seed(0)
    made = [spectral_norm(torch.nn.Linear(32, 24)) for _ in range(2)]
    twins = [copy.deepcopy(layer) for layer in made]
    x = torch.randn(3, 32)
    for _ in range(2):
        got = hl.project_many(made, x)
        want = [layer(x) for layer in twins]
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    for a, b in zip(made, twins, strict=True):
        assert torch.equal(a.parametrizations.weight[0]._u, b.parametrizations.weight[0]._u)
