"""headwise.bench.panels: each case's outputs checked against torch's kernel before it is timed, and its table."""

import pytest
import torch

from headwise.bench import panels as bench
from headwise.linear import panels


@pytest.mark.parametrize("case", list(bench.CASES))
def test_rates_time_what_agrees_with_torchs_kernel(case):
    if bench.CASES[case] not in panels.operands(compiled=False):
        with pytest.raises(ValueError, match=f"case '{case}': the panels do not run"):
            bench.rates(case, 3, layers=1, shapes=((64, 48),), repeats=1)
        return
    row = bench.rates(case, 3, layers=1, shapes=((64, 48), (40, 32)), repeats=1)
    assert row.case == case and row.rows == 3 and min(row.panels_gbps, row.torch_gbps, row.sum_gbps) > 0
    assert row.ratio == row.panels_gbps / row.torch_gbps


def test_a_disagreement_is_an_error(monkeypatch):
    case = next((c for c, pair in bench.CASES.items() if pair in panels.operands(compiled=False)), None)
    if case is None:
        pytest.skip("the panels run nothing here")
    monkeypatch.setattr(bench, "_theirs", lambda case, x, w, ones: torch.ops.headwise.panels_linear(x, torch.ops.headwise.pack_panels(w, x.dtype), None, w.shape[0]) + 1)
    with pytest.raises(ValueError, match="outputs disagree"):
        bench.rates(case, 2, layers=1, shapes=((64, 48),), repeats=1)


def test_main_prints_a_row_per_case_and_rows(capsys):
    bench.main(["--cases", "int8-a8,fp32", "--rows", "1", "--layers", "1", "--repeats", "1", "--threads", "1"])
    out = capsys.readouterr().out
    assert "| case | rows | panels |" in out and out.count("| int8-a8 |") == 1 and out.count("| fp32 |") == 1
