"""``project(layer, x, act)``: an MLP's GELU inside the GEMM on the panels' and oneDNN's paths, the activation applied
after it on torch's, the numbers against float64 at every row count, the kept decode calls with and without it apart."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headwise import GPT2Config
from headwise import linear as hl
from headwise.linear import onednn, panels, weight_cache
from headwise.models import GPT2LMHeadModel


def case(rows, dtype, *, n=512, k=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) / k**0.5)
        lin.bias.copy_(torch.randn(n, generator=gen))
    return torch.randn(rows, 1, k, generator=gen).to(dtype), lin.to(dtype)  # (B, T=1, K), (N, K)


def reference(x, lin, approximate):
    """F.gelu(F.linear(...)) in float64 from the operands as stored."""
    return F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double()), approximate=approximate)


def error(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 6e-3)])
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 40])  # the kept decode calls' bands, then the full path
def test_project_with_a_gelu_matches_float64_on_each_path(linear_path, approximate, dtype, tolerance, rows):
    x, lin = case(rows, dtype)
    act = nn.GELU(approximate=approximate)
    want = reference(x, lin, approximate)
    with torch.no_grad():
        for _ in range(2):  # the decode call is made at the first, kept for the second
            got = hl.project(lin, x, act)
            assert got.dtype == dtype and got.shape == (rows, 1, 512)
            assert error(got, want) < tolerance
        assert error(hl.project(lin, x), F.linear(x.double(), lin.weight.double(), lin.bias.double())) < tolerance  # no GELU


def test_the_gelu_runs_inside_the_gemm_on_onednns_path(monkeypatch):
    """On oneDNN's path the fused op computes the GELU (kept decode calls and the full path); F.gelu is not called."""
    if onednn.ops_error(torch.float32) is not None:
        pytest.skip("oneDNN's private ops fail here")
    calls = []
    monkeypatch.setattr(F, "gelu", lambda *a, **k: calls.append(1))
    with hl.use_path("onednn"), torch.no_grad():
        for rows in (1, 8, 40):
            x, lin = case(rows, torch.float32)
            out = hl.project(lin, x, nn.GELU(approximate="tanh"))
            assert torch.equal(out, onednn.inner_product_gelu(x, onednn.packed(lin.weight), lin.bias.detach(), "tanh")), rows
            kept = [entry for key, entry in weight_cache.READY.items() if id(lin) in key]
            assert [entry.run for entry in kept] == ([onednn.inner_product_gelu] if rows <= hl.DECODE_ROWS else []), rows
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_panels_path_the_gelu_runs_inside_the_gemm(monkeypatch, dtype):
    """On the panels' path ``panels_linear_gelu`` computes the GELU on the sums (kept decode calls and the full path,
    decided by the rule or forced); F.gelu is not called."""
    if (dtype, dtype) not in panels.operands(compiled=False):
        pytest.skip(f"the panels do not multiply {dtype} here")
    calls = []
    monkeypatch.setattr(F, "gelu", lambda *a, **k: calls.append(1))
    with hl.use_path("panels"), torch.no_grad():
        for rows in (1, 8, 40):
            x, lin = case(rows, dtype)
            for _ in range(2):  # made, then kept
                out = hl.project(lin, x, nn.GELU(approximate="tanh"))
                packed = panels.packed(lin.weight, dtype)
                assert torch.equal(out, torch.ops.headwise.panels_linear_gelu(x, packed, lin.bias.detach(), 512, "tanh")), rows
            kept = [entry for key, entry in weight_cache.READY.items() if id(lin) in key]
            assert [entry.run for entry in kept] == ([torch.ops.headwise.panels_linear_gelu] if rows <= hl.DECODE_ROWS else []), rows
    assert calls == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gelu_after_does_not_change_the_rules_path(dtype):
    """Where the rule gives a prompt's rows the panels, a call with a GELU after takes them too, the GELU inside (one
    packed copy of the weight for prompts and decode steps): the op's numbers, bit for bit."""
    x, lin = case(40, dtype)
    with torch.no_grad():
        if hl.path_for(x, lin.weight, lin.bias) != "panels":
            pytest.skip(f"the rule gives {dtype} prompts another path here")
        out = hl.project(lin, x, nn.GELU(approximate="none"))
        assert torch.equal(out, torch.ops.headwise.panels_linear_gelu(x, panels.packed(lin.weight, dtype), lin.bias.detach(), 512, "none"))


def test_a_layer_called_with_and_without_its_gelu_keeps_two_calls():
    """The kept decode call of ``project(lin, x, gelu)`` is not the one of ``project(lin, x)``, either order."""
    x, lin = case(1, torch.float32)
    act = nn.GELU(approximate="tanh")
    plain = F.linear(x, lin.weight, lin.bias)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(hl.project(lin, x), plain, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(hl.project(lin, x, act), F.gelu(plain, approximate="tanh"), rtol=1e-5, atol=1e-5)


def test_an_activation_that_is_not_a_plain_gelu_is_called_as_it_is():
    """A hooked GELU, another activation, a hooked layer: the module runs after the projection, hooks and all."""
    x, lin = case(8, torch.float32)
    seen = []
    hooked = nn.GELU(approximate="tanh")
    hooked.register_forward_hook(lambda mod, inp, out: seen.append("act"))
    with torch.no_grad():
        out = hl.project(lin, x, hooked)
        torch.testing.assert_close(out, F.gelu(F.linear(x, lin.weight, lin.bias), approximate="tanh"), rtol=1e-5, atol=1e-5)
        assert seen == ["act"]
        torch.testing.assert_close(hl.project(lin, x, nn.ReLU()), F.relu(F.linear(x, lin.weight, lin.bias)), rtol=1e-5, atol=1e-5)
        lin.register_forward_hook(lambda mod, inp, out: seen.append("layer"))
        hl.project(lin, x, nn.GELU())
        assert seen == ["act", "layer"]


def test_gradients_through_a_projection_with_its_gelu(linear_path):
    x, lin = case(40, torch.float32)
    x.requires_grad_(True)
    hl.project(lin, x, nn.GELU(approximate="tanh")).square().sum().backward()
    got = [x.grad, lin.weight.grad, lin.bias.grad]
    x2, w2, b2 = (t.detach().double().requires_grad_(True) for t in (x, lin.weight, lin.bias))
    F.gelu(F.linear(x2, w2, b2), approximate="tanh").square().sum().backward()
    for g, r in zip(got, [x2.grad, w2.grad, b2.grad], strict=True):
        assert error(g, r) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt2s_mlp_with_its_gelu_in_the_gemm_matches_the_module_path(linear_path, dtype):
    """A GPT-2's logits with the MLP's GELU fused against the same model with the GELU called as a module (a hook
    on every ``act`` keeps it out of the GEMM): the same to the dtype's rounding."""
    config = GPT2Config(vocab_size=100, n_positions=64, n_embd=256, n_layer=2, n_head=4)
    model = GPT2LMHeadModel(config).eval().to(dtype)
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fused = model(ids).double()
        for block in model.transformer.h:
            block.mlp.act.register_forward_hook(lambda mod, inp, out: None)
        called = model(ids).double()
    assert ((fused - called).norm() / called.norm()).item() < (1e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("gelu", ["erf", "", "TANH", 1, True])
def test_linear_refuses_a_gelu_it_does_not_know_on_every_path(linear_path, gelu):
    """A ValueError naming ``gelu``, the same on every path (the panels' op, oneDNN and torch each failed their own way)."""
    x, lin = case(4, torch.float32)
    with pytest.raises(ValueError, match=r"gelu must be None or GELU's approximate, one of \('none', 'tanh'\), got"), torch.no_grad():
        hl.linear(x, lin.weight, lin.bias, gelu=gelu)
