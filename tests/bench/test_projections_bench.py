"""``headwise.bench.projections``: each path timed, the rule's choice named, and the module runs tiny."""

import pytest
import torch

import headwise.linear as hl
from headwise.bench import projections as bench
from headwise.linear import onednn, panels


def test_a_tiny_projection_is_timed_on_each_path():
    r = bench.projection("tiny", 3, torch.float32, shape=(64, 32), repeats=2)
    assert (r.name, r.rows) == ("tiny", 3) and r.torch_ms > 0 and (r.onednn_ms is None) == (onednn.ops_error(torch.float32) is not None)
    assert (r.ratio is None or r.ratio == r.onednn_ms / r.torch_ms) and r.auto == "torch"  # a small weight's few rows: F.linear
    assert (r.panels_ms is not None) == ((torch.float32, torch.float32) in panels.operands(compiled=False))
    assert r.panels_ms is None or r.panels_ms > 0


def test_main_prints_one_row_per_projection_and_row_count_under_a_header_naming_the_cpu(capsys):
    bench.main(["--names", "attn.c_proj", "--rows", "1,17", "--dtypes", "fp32,bf16"])
    out = capsys.readouterr().out
    assert "family" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))]
    assert len(rows) == 4 and all(line.endswith(("| torch |", "| onednn |", "| panels |", "| widened |")) for line in rows)


def test_onednn_is_left_out_where_its_private_ops_fail(monkeypatch):
    """A dtype oneDNN's private ops refuse here (bfloat16 on a CPU without AVX-512) is timed on the other paths only."""
    monkeypatch.setattr(onednn, "ops_error", lambda dtype: "RuntimeError: refused")
    r = bench.projection("tiny", 3, torch.float32, shape=(64, 32), repeats=2)
    assert r.torch_ms > 0 and r.onednn_ms is None and r.ratio is None


def test_the_widened_way_is_timed_for_bfloat16_on_a_cpu_without_its_dot_products(machine, monkeypatch):
    """bfloat16 rows on a CPU without its dot products: ``widened`` is timed beside F.linear at every row count,
    whichever path the rule takes; a float32 call's is not."""
    machine("AuthenticAMD", "AVX2", ["avx2"])
    monkeypatch.setattr(onednn, "ops_error", lambda dtype: "refused")  # as on such a CPU: oneDNN is not timed
    for rows in (1, hl.AVX2_WIDE_ROWS + 1):
        r = bench.projection("tiny", rows, torch.bfloat16, shape=(2304, 64), repeats=2)
        assert r.widened_ms is not None and r.widened_ms > 0, rows
    assert r.auto == "widened"  # more rows than the panels take there
    assert bench.projection("tiny", 1, torch.float32, shape=(2304, 64), repeats=2).widened_ms is None


def test_int8_prints_the_widened_weight_against_the_panels_and_what_the_layer_takes(capsys):
    """``--int8``: one row per projection and row count, both ways timed where the panels take the int8 weight, and the
    layer's own choice named: the panels at up to WIDE_ROWS rows where ``Int8Linear`` says so."""
    from headwise import quantize

    wide, ours, takes = bench.int8_projection("attn.c_proj", 17, torch.float32, repeats=2)
    probe = quantize.Int8Linear(torch.randn(768, 768))
    assert wide > 0 and (ours is None) == (quantize.panel_sums(torch.zeros(1, 768, dtype=torch.bfloat16), probe.weight) is None)
    assert takes == probe.uses_panels(torch.randn(17, 768))
    bench.main(["--int8", "--names", "attn.c_proj", "--rows", "1,17", "--dtypes", "fp32"])
    out = capsys.readouterr().out
    assert "family" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith("| fp32 | attn.c_proj |")]
    assert len(rows) == 2 and all(line.endswith(("| panels |", "| widened |")) for line in rows)


def test_gelu_times_each_way_that_runs_here(capsys):
    """``--gelu``: c_fc and its GELU four ways where they run (oneDNN's where its private ops work, the panels' where
    they take the operands), one row per dtype and row count, each way's time over oneDNN's."""
    ms, auto = bench.gelu_projection(3, torch.float32, "tanh", repeats=2)
    assert list(ms) == [w for w in bench.GELU_WAYS if w in ms] and all(t > 0 for t in ms.values())
    assert (bench.GELU_WAYS[1] in ms) == (onednn.ops_error(torch.float32) is None)
    assert (bench.GELU_WAYS[2] in ms) == ((torch.float32, torch.float32) in panels.operands(compiled=False))
    assert auto in ("onednn", "panels", "torch")
    bench.main(["--gelu", "none", "--rows", "1,17", "--dtypes", "fp32"])
    out = capsys.readouterr().out
    assert "family" in out.splitlines()[0] and "approximate='none'" in out.splitlines()[0]
    assert len([line for line in out.splitlines() if line.startswith("| fp32 |")]) == 2


def test_gelu_and_int8_are_one_table_or_the_other():
    with pytest.raises(SystemExit):
        bench.main(["--gelu", "tanh", "--int8"])
