"""headwise.bench.variants: every way runs, the packed ways agree, the table names each row."""

from __future__ import annotations

import pytest
import torch

from headwise.bench import variants as V


def test_packed_ways_compute_the_same_thing():
    q, k, v, cu = V._packed_inputs(3, 16, 2, 8)
    outs = [V.packed_call(way, q, k, v, cu)() for way in V.PACKED_WAYS]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"way must be one of"):
        V.packed_call("nope", q, k, v, cu)


def test_small_runs_give_a_table():
    rows = V.packed(docs=2, doc_len=8, heads=2, head_dim=8, repeats=1, warmup=0)
    rows += V.terms(batch=1, tokens=16, heads=2, head_dim=8, modes=("forward", "backward"), repeats=1, warmup=0)
    assert [r.way for r in rows[:3]] == list(V.PACKED_WAYS)
    assert all(r.ms is not None and r.ms > 0 for r in rows if not r.note)
    assert {r.way for r in rows} >= {"headwise causal", "headwise softcap", "headwise sinks", "headwise ALiBi"}
    table = V.markdown(rows)
    ways = {(r.case, r.way) for r in rows}
    assert table.count("\n") == len(ways) + 1 and "one after another" in table  # one line per way, both modes on it
    causal = next(line for line in table.splitlines() if "| headwise causal |" in line)
    assert causal.count("1.00x") == 2  # the baseline of both modes
