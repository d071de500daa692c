"""Rotary position embeddings against a float64 reference written here (pairs as complex numbers)."""

from __future__ import annotations

import math

import pytest
import torch

import headwise.rope as rope_module
from headwise.rope import RotaryEmbedding, inverse_frequencies, rotate

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def reference_frequencies(r: int, theta: float, scaling: dict | None) -> list[float]:
    """theta^(-2i/R), then Meta's Llama 3.1 rule one frequency at a time, or linear division."""
    freqs = [theta ** (-2 * i / r) for i in range(r // 2)]
    if scaling is None:
        return freqs
    if scaling["rope_type"] == "linear":
        return [f / scaling["factor"] for f in freqs]
    factor, low, high, old = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(f)
        elif wavelen > old / low:
            out.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return out


def reference_rope(x: torch.Tensor, positions: torch.Tensor, freqs: list[float], layout: str) -> torch.Tensor:
    """x (B, H, T, D), positions (B, T): each pair (a, b) -> (a + ib)·exp(i·p·f) in float64; dims past R unchanged."""
    x = x.double()
    r = 2 * len(freqs)
    a, b = (x[..., : r // 2], x[..., r // 2 : r]) if layout == "rotate_half" else (x[..., 0:r:2], x[..., 1:r:2])
    angle = positions.double()[:, None, :, None] * torch.tensor(freqs, dtype=torch.float64)  # (B, 1, T, R/2)
    z = torch.complex(a, b) * torch.exp(1j * angle)
    pairs = torch.cat((z.real, z.imag), -1) if layout == "rotate_half" else torch.stack((z.real, z.imag), -1).flatten(-2)
    return torch.cat((pairs, x[..., r:]), dim=-1)


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, None), (32, 8)])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3], ids=["plain", "linear", "llama3"])
def test_rotation_matches_the_float64_reference(layout, head_dim, rotary_dim, scaling):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, head_dim, generator=g)
    rope = RotaryEmbedding(head_dim, rotary_dim=rotary_dim, theta=500.0, scaling=scaling, layout=layout)
    freqs = reference_frequencies(rotary_dim or head_dim, 500.0, scaling)
    start = 300  # far enough that float32 angles (p * f rounded) would show
    want = reference_rope(x, torch.arange(start, start + 7).expand(2, 7), freqs, layout)
    got = rope(x, start)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=0)
    ids = torch.tensor([[5, 0, 1, 2, 3, 4, 9], [300, 301, 302, 303, 304, 305, 900]])  # (B, T) per-row positions
    torch.testing.assert_close(rope(x, ids).double(), reference_rope(x, ids, freqs, layout), atol=4e-6, rtol=0)


def test_frequencies_match_the_reference():
    for scaling in (None, {"rope_type": "linear", "factor": 2.0}, LLAMA3):
        want = torch.tensor(reference_frequencies(64, 500000.0, scaling), dtype=torch.float64)
        torch.testing.assert_close(inverse_frequencies(64, theta=500000.0, scaling=scaling), want)
    legacy = {("type" if k == "rope_type" else k): v for k, v in LLAMA3.items()}  # transformers 4's spelling
    assert torch.equal(inverse_frequencies(64, theta=500000.0, scaling=legacy), inverse_frequencies(64, theta=500000.0, scaling=LLAMA3))
    assert not torch.equal(inverse_frequencies(64, theta=500000.0, scaling=LLAMA3), inverse_frequencies(64, theta=500000.0))


def test_scores_depend_only_on_the_distance():
    rope = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16).double(), torch.randn(1, 1, 1, 16).double()
    scores = [(rope(q, p + 5) @ rope(k, p).transpose(-1, -2)).item() for p in (0, 17, 200)]  # the query 5 tokens after the key
    assert max(scores) - min(scores) < 1e-5
    assert abs((rope(q, 9) @ rope(k, 0).transpose(-1, -2)).item() - scores[0]) > 1e-3  # another distance, another score


def test_tables_grow_and_stay_the_same():
    rope = RotaryEmbedding(8)
    x = torch.randn(1, 2, 3, 8)
    early = rope(x, 10)
    rope(x, 5000)  # grows the tables past 5003
    assert rope.tables(1, "cpu")[0].shape[0] >= 5003
    assert torch.equal(rope(x, 10), early)


def test_bf16_is_rotated_in_float32_and_rounded_once():
    """Flash-attention rule: our bf16 error vs float64 within 2x that of a plain bf16 rotation (bf16 cos/sin, bf16 products)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 64, 32, generator=g).bfloat16()
    rope = RotaryEmbedding(32)
    pos = torch.arange(100, 164).expand(2, 64)
    want = reference_rope(x, pos, reference_frequencies(32, 10000.0, None), "rotate_half")
    got = rope(x, 100)
    assert got.dtype == torch.bfloat16
    cos, sin = (t[100:164].bfloat16() for t in rope.tables(164))
    plain = x * cos + x.roll(16, dims=-1) * sin  # (B, H, T, D) all in bf16
    ours_err, plain_err = (got.double() - want).abs().max().item(), (plain.double() - want).abs().max().item()
    assert plain_err > 0
    assert ours_err <= 2 * plain_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, None), (32, 8), (12, None)])
@pytest.mark.parametrize("per_row", [False, True], ids=["start", "position-ids"])
@pytest.mark.parametrize("one_copy", [False, True], ids=["two-copies", "one-copy"])
def test_rotate_half_in_place_equals_the_swapped_copy_bit_for_bit(dtype, head_dim, rotary_dim, per_row, one_copy, monkeypatch):
    """Each half adding the other half's product in place gives x·cos + swap(x)·sin with a swapped copy, exactly; so
    does a half x turned in one float32 copy (a prompt's, from ``ONE_COPY`` elements on: here from any size, or none)."""
    monkeypatch.setattr(rope_module, "ONE_COPY", 1 if one_copy else 1 << 62)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 5, 7, 3, head_dim, generator=g).to(dtype)[..., 0, :].transpose(1, 2)  # (B, H, T, D), strided as split heads
    rope = RotaryEmbedding(head_dim, rotary_dim=rotary_dim)
    cos, sin = rope.at(torch.tensor([[3, 4, 5, 6, 7], [0, 0, 1, 2, 3]]) if per_row else 40, 5, x.device)  # (B, 1, T, R) or (T, R)
    r = cos.shape[-1]
    part = x.float()[..., :r]  # (B, H, T, R)
    copied = torch.addcmul(part * cos, part.roll(r // 2, dims=-1), sin)  # (B, H, T, R): the swap as a copy
    want = torch.cat((copied, x.float()[..., r:]), dim=-1).to(dtype)  # (B, H, T, D)
    assert torch.equal(rotate(x, cos, sin), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_gradient_is_the_float32_gradient_rounded_once(dtype):
    """Under autograd a half x's gradient is summed in float32 and rounded once (the float32 rotation's, rounded)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 9, 64, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(2, 4, 9, 64, generator=g).to(dtype)
    cos, sin = RotaryEmbedding(64).at(5, 9, x.device)  # (T, R)
    rotate(x, cos, sin).backward(grad)
    wide = x.detach().float().requires_grad_()
    rotate(wide, cos, sin).backward(grad.float())
    assert torch.equal(x.grad, wide.grad.to(dtype))


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float64_is_rotated_by_float64_tables(layout, scaling, compiled):
    """A float64 x is turned by float64 tables, to float64's rounding (float32 tables moved it by ~1e-7 at position
    300), from the kept tables, from explicit positions and inside a compiled call (tables made in the graph)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 32, generator=g, dtype=torch.float64)
    rope = RotaryEmbedding(32, rotary_dim=24, theta=500.0, scaling=scaling, layout=layout)
    freqs = reference_frequencies(24, 500.0, scaling)
    ids = torch.tensor([[5, 0, 1, 2, 3, 4, 9], [300, 301, 302, 303, 304, 305, 900]])  # (B, T) per-row positions
    turn = torch.compile(rope.__call__, backend="eager", fullgraph=True) if compiled else rope
    for positions, where in ((300, torch.arange(300, 307).expand(2, 7)), (ids, ids)):
        got = turn(x, positions)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, reference_rope(x, where, freqs, layout), atol=1e-13, rtol=0)
    assert rope.tables(8)[0].dtype == torch.float32 and rope.tables(8, dtype=torch.float64)[0].dtype == torch.float64


def test_rotate_keeps_float64():
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    rope = RotaryEmbedding(8)
    cos, sin = (t[:4] for t in rope.tables(4))  # (L >= 4, 8) tables: the first 4 positions
    assert rotate(x, cos, sin).dtype == torch.float64


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"layout must be one of \['rotate_half', 'interleaved'\], got 'gptj'"):
        RotaryEmbedding(8, layout="gptj")
    with pytest.raises(ValueError, match=r"rotary_dim must be even \(dims rotate in pairs\), got 5"):
        RotaryEmbedding(8, rotary_dim=5)
    with pytest.raises(ValueError, match=r"rotary_dim must be an int in \[2, 8\], got 10"):
        RotaryEmbedding(8, rotary_dim=10)
    with pytest.raises(ValueError, match=r"head_dim must be even to rotate every dim \(dims rotate in pairs\), got 5; or pass an even rotary_dim"):
        RotaryEmbedding(5)  # (named rotary_dim, which the caller had not given)
    assert RotaryEmbedding(5, rotary_dim=4).rotary_dim == 4
    with pytest.raises(ValueError, match=r"theta must be a number in \(1, inf\), got 0"):
        RotaryEmbedding(8, theta=0)
    with pytest.raises(ValueError, match=r"rope_scaling's rope_type must be one of \['default', 'linear', 'llama3'\], got 'yarn'"):
        RotaryEmbedding(8, scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_scaling of rope_type 'llama3' needs .*, missing \['low_freq_factor', 'high_freq_factor'\]"):
        RotaryEmbedding(8, scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192})
    with pytest.raises(ValueError, match=r"rope_scaling\['factor'\] must be a number in \(0, inf\), got -2"):
        RotaryEmbedding(8, scaling={"rope_type": "linear", "factor": -2})
    with pytest.raises(ValueError, match=r"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got 1.0 and 4.0"):
        RotaryEmbedding(8, scaling={**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0})
    with pytest.raises(TypeError, match=r"rope_scaling must be a dict with a 'rope_type' or None, got str"):
        RotaryEmbedding(8, scaling="llama3")
