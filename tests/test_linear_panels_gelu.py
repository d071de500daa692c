"""headwise::panels_linear_gelu: the panels GEMM with GELU ("none": erf's, "tanh") computed on each float32 sum plus its
bias before it is stored, against float64's GELU value by value (the tails included), at the row counts and widths its
loops branch on, under this build and under torch's AVX2 kernels, and what it refuses."""

import pytest
import torch
import torch.nn.functional as F
from helpers import outputs_under_avx2

from headwise.linear import panels

DTYPES = [pytest.param(torch.float32, id="fp32"),
          pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.skipif((torch.bfloat16,) * 2 not in panels.operands(compiled=False),
                                                                            reason="bfloat16 panels need AVX512-BF16 or AVX2 kernels"))]
pytestmark = pytest.mark.skipif(not panels.available(), reason="the panels GEMM runs where torch's kernels are AVX-512 or AVX2 and the library builds")
APPROXIMATE = ["none", "tanh"]
#: sums from -120 to 120, the tails where GELU underflows or is x included; each is one output of x . I
SUMS = torch.cat([torch.linspace(-120, 120, 2401), torch.linspace(-6, 6, 1201), torch.tensor([0.0, 1e-30, -1e-30, 1e-8, -1e-8, 1e4, -1e4])])


def gelu_of_sums(values: torch.Tensor, dtype: torch.dtype, approximate: str) -> torch.Tensor:
    """The op over x = the values, 32 a row, by the identity: each output is one value (exact: one product by 1, the
    rest by 0), GELU'd."""
    k = 32
    x = F.pad(values, (0, -values.numel() % k)).view(-1, k).to(dtype)  # (M, 32)
    return torch.ops.headwise.panels_linear_gelu(x, torch.ops.headwise.pack_panels(torch.eye(k, dtype=dtype)), None, k, approximate).flatten()


def gelu64(s: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU in float64 without cancellation in the negative tail (where float64's 1 + erf(x) and 1 + tanh(u) lose
    every digit): x Phi(x) from erfc, x sigmoid(2u)."""
    s = s.double()
    if approximate == "none":
        return s * 0.5 * torch.special.erfc(-s / 2**0.5)
    return s * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (s + 0.044715 * s**3))


def assert_gelu_of(got: torch.Tensor, sums: torch.Tensor, approximate: str) -> None:
    """got within a few units in float32's last place of float64's GELU of the float32 sums, relative to each value
    (so the tails count: there e^-(x^2 / 2) carries the rounding of x^2, a relative error of a few units of x^2's
    last place), then one rounding to got's dtype; values under 1e-36 may be 0."""
    want, s = gelu64(sums, approximate), sums.double()
    relative = 2e-6 + 4e-7 * torch.where(s < 0, s * s, 0)
    bound = relative * want.abs() + (2**-8 * want.abs() if got.dtype == torch.bfloat16 else 0) + 1e-36
    assert bool(((got.double() - want).abs() <= bound).all()), (got.double() - want).abs().max()


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_value_is_gelus_to_a_few_units_in_the_last_place(dtype, approximate):
    got = gelu_of_sums(SUMS, dtype, approximate)[: SUMS.numel()]
    assert_gelu_of(got, SUMS.to(dtype).float(), approximate)
    assert bool((got[SUMS <= -100] == 0).all()) and torch.equal(got[SUMS >= 100], SUMS[SUMS >= 100].to(dtype))


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_stays_nan(dtype, approximate):
    got = gelu_of_sums(torch.tensor([float("nan")]), dtype, approximate)  # (NaN times the identity's zeros: all NaN)
    assert bool(got.isnan().all())


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("rows", [1, 3, 9, 16, 17, 40, 129])
@pytest.mark.parametrize("n", [1, 33, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gemm_with_its_bias_then_gelu_matches_float64(dtype, n, rows, approximate):
    """The sums plus the bias within float32's bound of float64's, then GELU (whose slope is at most 1.13) of them."""
    gen = torch.Generator().manual_seed(rows * n)
    k = 70
    x, w, b = (torch.randn(rows, k, generator=gen).to(dtype), (torch.randn(n, k, generator=gen) / k**0.5).to(dtype),
               torch.randn(n, generator=gen).to(dtype))
    got = torch.ops.headwise.panels_linear_gelu(x, torch.ops.headwise.pack_panels(w), b, n, approximate)  # (rows, n)
    linear = F.linear(x.double(), w.double(), b.double())
    scale = x.double().abs() @ w.double().abs().T + b.double().abs()
    want = gelu64(linear, approximate)
    bound = 1.13 * (k + 2) * 2**-24 * scale + 2e-6 * want.abs() + (2**-8 * want.abs() if dtype == torch.bfloat16 else 0) + 1e-30
    assert got.dtype == dtype and got.shape == (rows, n)
    assert bool(((got.double() - want).abs() <= bound).all())


def gelu_outputs() -> dict[str, torch.Tensor]:
    """The op's outputs over ``SUMS`` for each dtype the panels take here and each approximation."""
    return {f"{dtype} {approximate}": gelu_of_sums(SUMS, dtype, approximate)[: SUMS.numel()]
            for dtype in (torch.float32, torch.bfloat16) if (dtype, dtype) in panels.operands(compiled=False) for approximate in APPROXIMATE}


def test_under_avx2_each_value_is_gelus_too(tmp_path):
    """Under torch's AVX2 kernels (the library built with AVX2's flags: e^x by its own rounding and scaling, a division
    for the reciprocal) the same bound holds value by value."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no AVX2: torch runs its plain kernels whatever it is asked")
    theirs = outputs_under_avx2("test_linear_panels_gelu", "gelu_outputs", tmp_path)
    assert theirs
    for name, got in theirs.items():
        assert_gelu_of(got, SUMS.to(got.dtype).float(), name.split()[-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_it_passes_torchs_opcheck(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 1, 64, generator=gen).to(dtype), torch.randn(100, 64, generator=gen).to(dtype), torch.randn(100, generator=gen).to(dtype)
    args = (x, torch.ops.headwise.pack_panels(w), b, 100, "tanh")
    assert set(torch.library.opcheck(torch.ops.headwise.panels_linear_gelu, args).values()) == {"SUCCESS"}


def test_it_refuses_int8_operands_and_other_approximations():
    x, w = torch.randn(2, 16), torch.randn(40, 16)
    packed = torch.ops.headwise.pack_panels(w)
    with pytest.raises(RuntimeError, match="approximate must be"):
        torch.ops.headwise.panels_linear_gelu(x, packed, None, 40, "erf")
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.headwise.panels_linear_gelu(x.bfloat16(), torch.ops.headwise.pack_panels(w.to(torch.int8)), None, 40, "tanh")
