"""headwise.quantize with ``activations="int8"``: each row of activations rounded to int8 with its own scale, exact
integer sums. Checked against the same arithmetic written out with float64 sums of the integers, bit for bit, on
every path; against float32 for what it costs; and through whole models (decode steps, the flat step, generate)."""

import copy

import pytest
import torch
from test_quantize import MODELS, teacher_forced
from torch import nn

from headwise import linear as hl
from headwise.models.flat_step import flat_step
from headwise.quantize import Int8Linear, int8_errors, int8_weights


def written_out(x: torch.Tensor, lin: Int8Linear) -> torch.Tensor:
    """The arithmetic of the docstring, step by step: per-row float32 scale max|x| * (1/127), the rows rounded, the
    integer products summed in float64 (exact), the sums in float32 times the row's scale, then the channel's, the bias."""
    rows = x.reshape(-1, x.shape[-1]).float()
    reciprocal = torch.tensor(1 / 127, dtype=torch.float32)  # 1/127 rounded to float32
    row_scales = torch.stack([(r.abs().max() * reciprocal).clamp_min(torch.finfo(torch.float32).tiny) for r in rows])[:, None]  # (M, 1)
    q = (rows / row_scales).round()  # (M, K)
    assert q.abs().max() <= 127
    sums = (q.double()[:, None, :] * lin.weight.double()[None, :, :]).sum(-1).float()  # (M, N): every product, summed in float64
    y = sums * row_scales
    y = y * lin.scales
    if lin.bias is not None:
        y = lin.bias.float() + y
    return y.to(x.dtype).view(*x.shape[:-1], -1)


@pytest.mark.parametrize("rows", [1, 3, hl.DECODE_ROWS, 40])
# odd widths; K = 3072: sums past float32's exact integers; K = 1: torch's int8 GEMM read a (1, N) transpose's strides wrong
@pytest.mark.parametrize("k, n", [(64, 48), (37, 11), (3072, 24), (1, 7)])
@pytest.mark.parametrize("bias", [True, False])
def test_every_path_gives_the_written_out_arithmetic_bit_for_bit(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows + k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    lin = Int8Linear(w, torch.randn(n, generator=g) if bias else None, activations="int8")
    x = torch.randn(2, rows, k, generator=g) * torch.logspace(-3, 2, rows)[None, :, None]  # rows of very different size
    x[0, 0] = 0.0  # a zero row
    want = written_out(x, lin)
    assert torch.equal(lin(x), want)  # torch's int8 GEMM on the CPU
    assert torch.equal(lin(x.requires_grad_()), want)  # autograd: the float64 GEMM of the same integers
    assert torch.equal(lin(x.detach().bfloat16()), written_out(x.detach().bfloat16(), lin))


def test_torch_int8_gemm_at_its_edges_gives_the_written_out_arithmetic():
    """No rows, a layer whose weight and input are views at odd offsets into larger storage: torch._int_mm checks
    its operands itself, and its sums stay exact there."""
    lin = Int8Linear(torch.randn(9, 17), torch.randn(9), activations="int8")
    assert lin(torch.randn(0, 17)).shape == (0, 9)
    storage = torch.zeros(3 + 9 * 17, dtype=torch.int8)
    storage[3:] = lin.weight.flatten()
    lin.weight = storage[3:].view(9, 17)  # the same weight at an odd offset
    x = torch.randn(1 + 2 * 17)[1:].view(2, 17)
    assert torch.equal(lin(x), written_out(x, lin))


@pytest.mark.parametrize("amx", [True, False])
def test_under_compile_the_int8_gemm_is_out_of_inductors_sight_off_amx(monkeypatch, amx):
    """Off AMX (``machine.amx_int8_on``), a compiled int8-activation projection calls ``torch._int_mm`` through the
    opaque ``headwise::int_mm`` (inductor's frozen int8 GEMMs run a scalar kernel there); on AMX the GEMM is traced.
    The written-out arithmetic bit for bit either way."""
    from headwise import quantize

    monkeypatch.setattr(quantize, "_AMX_INT8", amx)
    g = torch.Generator().manual_seed(5)
    lin = Int8Linear(torch.randn(24, 64, generator=g), torch.randn(24, generator=g), activations="int8")
    x = torch.randn(3, 64, generator=g)
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm

    torch._dynamo.reset()
    assert torch.equal(torch.compile(lin, backend=backend, fullgraph=True)(x), written_out(x, lin))
    opaque, traced = "headwise.int_mm" in seen, any("_int_mm" in t for t in seen)  # the op, or torch._int_mm itself
    assert (opaque, traced) == (not amx, amx), seen


def test_without_vnni_a_prompts_rows_take_the_panels_not_torchs_scalar_int8_gemm(monkeypatch):
    """Where torch's int8 GEMM is a scalar loop (a CPU without AVX512-VNNI), every row count
    runs the panels' integer GEMM (AVX2's word products): a prompt's 600 rows in chunks, the written-out arithmetic bit
    for bit. (Runs on such CPUs only.)"""
    from headwise import quantize
    from headwise.linear import panels

    if (torch.int8, torch.int8) not in panels.operands(compiled=False) or quantize._VECTOR_INT_MM:
        pytest.skip("the panels' int8 x int8 path for every row count runs on x86 CPUs without AVX512-VNNI")
    monkeypatch.setattr(torch, "_int_mm", lambda *args: pytest.fail("torch._int_mm ran"))
    g = torch.Generator().manual_seed(8)
    lin = Int8Linear(torch.randn(80, 771, generator=g), torch.randn(80, generator=g), activations="int8")
    x = torch.randn(2, 300, 771, generator=g)  # (B, T, K): K odd, the last pair padded
    assert torch.equal(lin(x), written_out(x, lin))


def test_on_each_device_the_cpus_numbers_bit_for_bit(device):
    """Off the CPU (cuda where torch sees one) the float64 GEMM of the same integers: the CPU's int32 sums, the same bits.
    (Its first run on a GPU found the row scales differing: they were a division by 127, which CUDA runs as a product
    with the reciprocal; they are now that product on every device.)"""
    g = torch.Generator().manual_seed(4)
    lin = Int8Linear(torch.randn(24, 3072, generator=g), torch.randn(24, generator=g), activations="int8")
    x = torch.randn(5, 3072, generator=g)
    want = lin(x)
    assert torch.equal(lin.to(device)(x.to(device)).cpu(), want)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    lin = Int8Linear(torch.randn(40, 96), activations="int8")
    x = torch.randn(9, 96)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(9)])
    assert torch.equal(lin(x), alone)


def test_the_rounding_passes_the_gradient_straight_through():
    w = torch.randn(16, 32)
    lin = Int8Linear(w, activations="int8")
    x = torch.randn(3, 32, requires_grad=True)
    lin(x).sum().backward()
    torch.testing.assert_close(x.grad, lin.dequantized(torch.float32).sum(0).expand(3, 32), rtol=1e-5, atol=1e-6)


def test_its_error_against_float32_is_that_of_rounding_both_sides():
    """Gaussian rows and weights, K = 768: within 1.5% of the float64 product (relative norm), as each side's
    int8 rounding (~0.6% each for Gaussian values) adds up; the bf16-activation arithmetic for scale."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 768, generator=g), torch.randn(8, 768, generator=g)
    want = x.double() @ w.double().T
    errors = {a: ((Int8Linear(w, activations=a)(x).double() - want).norm() / want.norm()).item() for a in ("bf16", "int8")}
    assert errors["int8"] < 0.015 and errors["bf16"] < errors["int8"], errors


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_int8_rows_logits_and_greedy_tokens_stay_close_to_float32(name):
    """Along the float model's greedy continuation (24 decode steps, 3 prompts): logits within 5% (relative norm) at
    every step and the same greedy token at 85% of the steps or more; int8_errors measures it the same way."""
    model = MODELS[name]()
    q = int8_weights(copy.deepcopy(model), activations="int8")
    assert all(m.activations == "int8" for m in q.modules() if isinstance(m, Int8Linear))
    same = []
    for seed in range(3):
        ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(seed))
        steps = teacher_forced(model, q, ids, 24)
        for a, b in steps:
            assert ((b - a).norm() / a.norm()).item() < 0.05
        same += [bool(torch.equal(a.argmax(-1), b.argmax(-1))) for a, b in steps]
        assert int8_errors(model, q, ids, max_new_tokens=8).logits_rel_error < 0.05
    assert sum(same) >= 0.85 * len(same), same


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_a_prompt_the_steps_and_the_flat_step_multiply_alike(name):
    """Integer sums have no order: the prompt's logits at its last position equal a step-by-step decode's, bit for
    bit, and the flat decode step gives the forward's logits."""
    model = int8_weights(MODELS[name](), activations="int8")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    whole = model(ids, cache=model.new_caches(2, 9))[:, -1]  # (2, vocab)
    caches = model.new_caches(2, 12)
    model(ids[:, :8], cache=caches)
    step = model(ids[:, 8:], cache=caches, logits_to_keep=1)[:, 0]
    torch.testing.assert_close(step, whole, rtol=0, atol=1e-4)  # the attention's sums differ in order, not the projections'
    flat, plain = model.new_caches(2, 12), model.new_caches(2, 12)
    for c in (flat, plain):
        model(ids, cache=c, check=False)
    token = whole.argmax(-1, keepdim=True)
    assert torch.equal(flat_step(model)(token, None, flat), model(token, cache=plain, logits_to_keep=1, check=False)[:, 0])


def test_a_stack_keeps_the_arithmetic_and_refuses_to_mix_them():
    a, b = (Int8Linear(torch.randn(8, 16), activations="int8") for _ in range(2))
    stacked = Int8Linear.stack([a, b])
    x = torch.randn(3, 16)
    assert stacked.activations == "int8" and torch.equal(stacked(x), torch.cat([a(x), b(x)], dim=-1))
    with pytest.raises(ValueError, match="activations"):
        Int8Linear.stack([a, Int8Linear(torch.randn(8, 16))])


def test_an_unknown_arithmetic_is_refused_by_name():
    with pytest.raises(ValueError, match=r"activations must be one of \['bf16', 'int8'\], got 'fp8'"):
        Int8Linear(torch.randn(4, 4), activations="fp8")
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="activations must be one of"):
        int8_weights(model, activations="int4")
    assert type(model[0]) is nn.Linear, "nothing converted"
    assert "activations=int8" in repr(Int8Linear(torch.randn(4, 4), activations="int8"))


@pytest.mark.parametrize("where", [3, 64, 70])  # in a vector of 16, in the last full one, in the tail
@pytest.mark.parametrize("rows", [1, 5])
def test_a_nan_in_a_row_gives_that_row_nan_on_every_path(where, rows):
    """A max instruction drops a NaN: the decode kernel looks for it apart, so its row's outputs are NaN as forward's."""
    torch.manual_seed(0)
    layer = Int8Linear(torch.randn(48, 71), activations="int8")
    x = torch.randn(rows, 71)
    x[0, where] = float("nan")
    with torch.no_grad():
        want, got = layer(x), hl.project(layer, x)
    assert want[0].isnan().all() and got[0].isnan().all()
    assert torch.equal(got[1:], want[1:])  # the other rows as they were
