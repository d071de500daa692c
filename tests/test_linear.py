"""The oneDNN projection path (headwise.linear): float32-exact, differentiable, never stale, and
the modules that use it still match the float64 reference (in bf16 within 2x a plain bf16 one)."""

import math

import pytest
import torch
import torch.nn.functional as F
from reference import linear as ref_linear
from reference import reference_mha

import headwise as hw
from headwise import linear as hl

needs_onednn = pytest.mark.skipif(not hl._onednn_available(), reason="torch built without oneDNN")


@pytest.fixture
def onednn(monkeypatch):
    """Take the oneDNN path whatever this machine's one-time probe said."""
    monkeypatch.setattr(hl, "onednn_pays", lambda dtype=torch.float32: dtype in hl._DTYPES)


def rel_err(got, ref):
    return ((got.double() - ref).norm() / ref.norm()).item()


def make(m=96, k=80, n=72, *, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m // 2, k, generator=gen)  # (B, T, K)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)  # (N, K)
    b = torch.randn(n, generator=gen) if bias else None  # (N,)
    return x, w, b


# ----------------------------------------------------------------------------- the op


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_forward_is_float32_exact(onednn, bias, grad):
    x, w, b = make(bias=bias)
    w.requires_grad_(grad)
    assert hl.uses_onednn(x, w, b)
    ref = ref_linear(x, w.detach(), b)  # (B, T, N) float64
    got = hl.linear(x, w, b)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    plain = rel_err(F.linear(x, w, b), ref)
    assert rel_err(got, ref) <= max(4 * plain, 4 * torch.finfo(torch.float32).eps)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_float64(onednn, bias):
    x, w, b = make(bias=bias)
    x.requires_grad_(True)
    w.requires_grad_(True)
    if b is not None:
        b.requires_grad_(True)
    y = hl.linear(x, w, b)
    assert type(y.grad_fn).__name__ == "_OneDNNLinearBackward"
    g = torch.randn_like(y)
    y.backward(g)
    g64, x64, w64 = g.double().reshape(-1, g.shape[-1]), x.detach().double().reshape(-1, x.shape[-1]), w.detach().double()
    eps = 8 * torch.finfo(torch.float32).eps
    assert rel_err(x.grad.reshape(-1, x.shape[-1]), g64 @ w64) < eps  # (M, K)
    assert rel_err(w.grad, g64.T @ x64) < eps  # (N, K)
    if b is not None:
        assert rel_err(b.grad, g64.sum(0)) < eps


@needs_onednn
def test_only_the_inputs_that_need_grad_get_one(onednn):
    x, w, b = make()
    w.requires_grad_(True)
    hl.linear(x, w, b).sum().backward()
    assert w.grad is not None and x.grad is None and b.grad is None


@needs_onednn
def test_packed_weight_follows_every_change(onednn):
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


@needs_onednn
def test_inference_mode_and_inference_tensors(onednn):
    x, w, b = make()
    with torch.inference_mode():
        lin = torch.nn.Linear(80, 72)  # parameters that are inference tensors: no version counter
        assert rel_err(hl.project(lin, x), ref_linear(x, lin.weight, lin.bias)) < 1e-6
        assert rel_err(hl.linear(x, w, b), ref_linear(x, w, b)) < 1e-6


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
def test_falls_back_to_f_linear_where_onednn_does_not_apply(onednn):
    x, w, b = make()
    assert not hl.uses_onednn(x.double(), w.double(), b.double())  # float64: oneDNN has none
    assert not hl.uses_onednn(x[:, :2], w, b)  # 4 rows: a decode step
    assert not hl.uses_onednn(x, w.bfloat16(), b)  # mixed dtypes: F.linear raises its own error
    assert not hl.uses_onednn(x, torch.randn(72, 160)[:, :80], b)  # a sliced weight: oneDNN's slow path
    with torch.backends.mkldnn.flags(enabled=False):  # the user's switch
        assert not hl.uses_onednn(x, w, b)
    torch.testing.assert_close(hl.linear(x.double(), w.double(), b.double()), F.linear(x.double(), w.double(), b.double()), rtol=0, atol=0)


def test_probe_answers_false_for_dtypes_without_a_fast_path():
    assert hl.onednn_pays(torch.float64) is False
    assert isinstance(hl.onednn_pays(torch.float32), bool)


def test_project_calls_hooked_or_replaced_layers_as_they_are(onednn):
    x = make()[0]
    lin = torch.nn.Linear(80, 72)
    seen = []
    lin.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    hl.project(lin, x)
    assert seen == [torch.Size([2, 48, 72])]

    class Doubled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    dbl = Doubled(80, 72)
    torch.testing.assert_close(hl.project(dbl, x), 2 * F.linear(x, dbl.weight, dbl.bias))


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


@needs_onednn
@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_module_forward_and_backward_on_the_fast_path_match_float64(onednn, kind):
    mod, weights = make_module(kind)
    x = torch.randn(2, 24, 64, requires_grad=True)  # (B, T, C): 48 rows, on the oneDNN path
    assert hl.uses_onednn(x, mod.out_proj.weight if kind == "mha" else mod.c_proj.weight)
    out = mod(x)
    x64 = x.detach().double().requires_grad_(True)
    w64 = [t.detach().double().requires_grad_(True) for t in weights(mod)]
    ref = reference_mha(x64, *w64[:6], *w64[6:], num_heads=4, causal=True)
    assert rel_err(out, ref) < 1e-6
    g = torch.randn_like(out)
    out.backward(g)
    ref.backward(g.double())
    assert rel_err(x.grad, x64.grad) < 1e-5
    got_grads = [p.grad for p in mod.parameters()]
    assert all(gr is not None for gr in got_grads)
    wo = mod.out_proj.weight if kind == "mha" else mod.c_proj.weight
    assert rel_err(wo.grad, w64[6].grad) < 1e-5
    with torch.no_grad():  # the packed path gives the same numbers
        assert rel_err(mod(x), ref.detach()) < 1e-6


@needs_onednn
@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_bf16_end_to_end_within_2x_of_a_plain_bf16_implementation(onednn, kind):
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


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_project_many_fuses_without_grad_and_follows_changes(onednn, bias):
    x = make()[0]
    layers = [torch.nn.Linear(80, n, bias=bias) for n in (72, 40, 40)]

    def check(grad):
        with torch.set_grad_enabled(grad):
            outs = hl.project_many(layers, x)
        assert [o.shape[-1] for o in outs] == [72, 40, 40]
        for out, layer in zip(outs, layers, strict=True):
            assert rel_err(out, ref_linear(x, layer.weight, layer.bias)) < 1e-6
        return outs

    fused = check(False)
    assert fused[0].data_ptr() + 72 * 4 == fused[1].data_ptr()  # views of one GEMM's output
    with torch.no_grad():
        layers[1].weight.mul_(-2.0)
    check(False)
    layers[2].load_state_dict(torch.nn.Linear(80, 40, bias=bias).state_dict())
    check(False)
    separate = check(True)  # with autograd: one differentiable call per layer
    assert all(o.requires_grad for o in separate)
