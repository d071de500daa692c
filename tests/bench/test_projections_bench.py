"""``headwise.bench.projections``: both paths timed, the rule's choice named, and the module runs tiny."""

import torch

from headwise.bench import projections as bench


def test_a_tiny_projection_is_timed_on_both_paths():
    r = bench.projection("tiny", 3, torch.float32, shape=(64, 32), repeats=2)
    assert (r.name, r.rows) == ("tiny", 3) and r.torch_ms > 0 and r.onednn_ms > 0
    assert r.ratio == r.onednn_ms / r.torch_ms and r.auto in ("torch", "onednn")


def test_main_prints_one_row_per_projection_and_row_count_under_a_header_naming_the_cpu(capsys):
    bench.main(["--names", "attn.c_proj", "--rows", "1,17", "--dtypes", "fp32,bf16"])
    out = capsys.readouterr().out
    assert "family" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))]
    assert len(rows) == 4 and all(line.endswith(("| torch |", "| onednn |")) for line in rows)
