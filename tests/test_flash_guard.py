"""The guard in front of torch's private CPU flash op (``backends.sdpa.flash_guard``), against the op itself.

The op divides by zero (SIGFPE) on some empty shapes and reads some malformed ones without a
word, so every probe of the raw op runs in a child process. What the guard lets through must
give F.scaled_dot_product_attention's numbers; every empty call must come back from
``headwise.attention`` as zeros, sinks or not, with no crash.
"""

from __future__ import annotations

import pytest
import torch
from isolated import run_isolated

import headwise as hw
from headwise.backends.sdpa import flash_guard

_PROBE = """
import json, torch
results = []
for B, H, Hkv, T, S, D, Dv, layout in {shapes!r}:
    q = torch.randn(B, T, H, D).transpose(1, 2) if layout == "transposed" else torch.randn(B, H, T, D)
    k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
    if layout == "expanded":
        k, v = torch.randn(B, Hkv, 1, D).expand(B, Hkv, S, D), torch.randn(B, Hkv, 1, Dv).expand(B, Hkv, S, Dv)
    mask = torch.zeros(1, 1, T, S).masked_fill(torch.rand(T, S) < 0.3, -float("inf")) if layout == "mask" else None
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H != Hkv)
    results.append(bool(torch.allclose(o, want, atol=1e-5, equal_nan=True)))
print(json.dumps(results))
"""

# (B, H, Hkv, T, S, D, Dv, layout): every size 0 in turn, odd and tiny head sizes, GQA, strides, a mask.
SHAPES = [
    (1, 2, 2, 4, 4, 8, 8, "plain"), (0, 2, 2, 4, 4, 8, 8, "plain"), (1, 0, 0, 4, 4, 8, 8, "plain"),
    (1, 2, 2, 0, 4, 8, 8, "plain"), (1, 2, 2, 4, 0, 8, 8, "plain"), (0, 2, 2, 0, 4, 8, 8, "plain"),
    (1, 2, 2, 4, 4, 1, 1, "plain"), (1, 2, 2, 4, 4, 7, 7, "plain"), (1, 2, 2, 5, 3, 3, 3, "plain"),
    (2, 4, 1, 3, 6, 8, 8, "plain"), (1, 6, 2, 4, 5, 8, 8, "transposed"), (1, 2, 2, 4, 5, 8, 8, "expanded"),
    (1, 2, 2, 4, 5, 8, 8, "mask"), (1, 2, 2, 0, 5, 8, 8, "mask"),
]


@pytest.mark.slow
def test_what_the_guard_lets_through_the_op_computes_right():
    """Every shape the guard passes, run on the raw op in one child process; it stops only calls with nothing to compute."""
    passed = []
    for B, H, Hkv, T, S, D, Dv, layout in SHAPES:
        q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, Dv)
        if flash_guard(q, k, v, torch.zeros(1, 1, T, S) if layout == "mask" else None):
            passed.append((B, H, Hkv, T, S, D, Dv, layout))
        else:
            assert B * H * T * S == 0, (B, H, T, S)
    assert len(passed) == 8
    assert run_isolated(_PROBE.format(shapes=passed)) == [True] * len(passed)


def test_the_guard_refuses_what_the_op_would_misread():
    q, k = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"CPU flash op takes .* Hkv \| H, got \(1, 3, 4, 8\), \(1, 2, 4, 8\)"):
        flash_guard(q, k, k, None)  # H = 3 over 2 key heads: the op would answer anyway
    with pytest.raises(ValueError, match=r"CPU flash op takes"):
        flash_guard(torch.randn(1, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8), None)  # another batch
    with pytest.raises(ValueError, match=r"one dtype and a float mask of theirs or float32, got torch.float32, torch.float32, torch.float32, torch.bool"):
        flash_guard(q[:, :2], k, k, torch.ones(4, 4, dtype=torch.bool))
    half = [t.bfloat16() for t in (q[:, :2], k, k)]
    assert flash_guard(*half, torch.zeros(4, 4))  # a float32 mask beside bfloat16: the op adds it in float32
    with pytest.raises(ValueError, match=r"got torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float64"):
        flash_guard(*half, torch.zeros(4, 4, dtype=torch.float64))


_EMPTY_CALLS = """
import json, torch, headwise as hw
out = {}
q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
sinks = torch.zeros(2)
out["no queries"] = hw.attention(q[:, :, :0], k, k, sinks=sinks).shape[2]
out["no keys"] = hw.attention(q, k[:, :, :0], k[:, :, :0], sinks=sinks).abs().sum().item()
out["no queries, causal, no grad"] = hw.attention(q[:, :, :0], k, k, sinks=sinks, causal=True).shape[2]
mha = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, sinks=True).eval()
out["module, no tokens"] = list(mha(torch.randn(1, 0, 8)).shape)
cross = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, causal=False, kv_dim=6, sinks=True).eval()
out["cross, empty context"] = cross(torch.randn(1, 3, 8), context=torch.randn(1, 0, 6)).shape[1]
leaves = [t.clone().requires_grad_() for t in (q, k[:, :, :0], k[:, :, :0], sinks)]
y = hw.attention(*leaves[:3], sinks=leaves[3])
y.sum().backward()
out["grads"] = [t.grad.abs().sum().item() for t in leaves]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_empty_calls_with_sinks_come_back_empty_or_zero():
    got = run_isolated(_EMPTY_CALLS)
    assert got == {
        "no queries": 0, "no keys": 0.0, "no queries, causal, no grad": 0, "module, no tokens": [1, 0, 8],
        "cross, empty context": 3, "grads": [0.0, 0.0, 0.0, 0.0],
    }


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("S", [1, 3])
def test_sinks_on_the_fused_kernel_at_small_sizes_and_a_head_without_sink(T, S):
    q, k = torch.randn(1, 2, T, 4), torch.randn(1, 2, S, 4)
    sinks = torch.tensor([0.5, -float("inf")])
    got = hw.attention(q, k, k, sinks=sinks, backend="sdpa")
    want = hw.attention(q.double(), k.double(), k.double(), sinks=sinks.double(), backend="math")
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
