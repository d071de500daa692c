"""``headwise.bench.decode_attention``: the ways agree with each other, and the module runs tiny."""

import pytest
import torch

from headwise.backends import decode_kernel
from headwise.bench import decode_attention as bench


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_ways_compute_the_same_attention(dtype):
    g = torch.Generator().manual_seed(0)
    K, V = (torch.randn(2, 2, 20, 8, generator=g).to(dtype) for _ in range(2))  # (B, Hkv, L, D): a cache's buffers
    q = torch.randn(2, 6, 1, 8, generator=g).to(dtype)  # (B, H, 1, D)
    k, v = K[:, :, :13], V[:, :, :13]  # slices, as a decode step reads them
    outs = {name: way(q, k, v).double() for name, way in bench.ways(dtype).items()}
    assert ("C++ kernel" in outs) == (dtype != torch.float16 and decode_kernel.available())  # it reads float32 and bfloat16
    for name, out in outs.items():
        assert out.shape == (2, 6, 1, 8)
        assert float((out - outs["float32"]).abs().max()) <= (2**-6 if dtype != torch.float32 else 1e-5), name


def test_a_tiny_run_times_every_way():
    r = bench.decode_attention(1, 4, group=3, kv_heads=2, head_dim=8, steps=2, rounds=2)
    assert set(r.us) == set(bench.ways(torch.bfloat16)) and all(t > 0 for t in r.us.values())
    assert (r.dtype, r.batch, r.context, r.group, r.head_dim) == ("bfloat16", 1, 4, 3, 8)


def test_main_prints_one_row_per_shape_under_a_header_naming_the_cpu(capsys):
    bench.main(["--steps", "1", "--contexts", "3", "--batches", "1", "--dtypes", "bf16"])
    out = capsys.readouterr().out
    assert "family" in out.splitlines()[0]
    assert len([line for line in out.splitlines() if line.startswith("| bf16 |")]) == 4  # G 1, 3 x D 64, 128
    bench.main(["--steps", "1", "--contexts", "3", "--batches", "1", "--dtypes", "fp16"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| fp16 |")]
    assert len(rows) == 4 and all(row.endswith("| — |") for row in rows)  # the C++ kernel's column: it reads no float16
