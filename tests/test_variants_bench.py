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


@pytest.mark.slow
def test_small_runs_give_a_table_and_the_packed_peaks_follow_the_documents():
    """Packed: each way's peak in a fresh process; documents= stays near the documents run alone, the dense mask does not."""
    rows = V.packed(docs=4, doc_len=512, heads=4, head_dim=16, repeats=1, warmup=0)
    ours, alone, dense = (r.peak_mib for r in rows)
    assert None not in (ours, alone, dense), "peak memory not measured (Linux /proc/self/clear_refs)"
    assert ours <= 2 * alone + 4, f"documents= took {ours:.1f} MiB, the documents alone {alone:.1f} MiB"
    mask_mib = (4 * 512) ** 2 / 2**20  # the (T, T) bool mask alone
    assert dense >= ours + mask_mib, f"the dense (T, T) mask took {dense:.1f} MiB, documents= {ours:.1f} MiB: the measure does not see it"
    rows += V.terms(batch=1, tokens=16, heads=2, head_dim=8, modes=("forward", "backward"), repeats=1, warmup=0)
    assert [r.way for r in rows[:3]] == list(V.PACKED_WAYS)
    assert all(r.ms is not None and r.ms > 0 for r in rows if not r.note)
    assert {r.way for r in rows} >= {"headwise causal", "headwise softcap", "headwise sinks", "headwise ALiBi"}
    table = V.markdown(rows)
    ways = {(r.case, r.way) for r in rows}
    assert table.count("\n") == len(ways) + 1 and "one after another" in table  # one line per way, both modes on it
    causal = next(line for line in table.splitlines() if "| headwise causal |" in line)
    assert causal.count("1.00x") == 2  # the baseline of both modes


def test_the_decode_terms_time_each_way_and_the_rules_without_the_kernel_give_the_same_numbers():
    """A decode step's terms: every way timed against plain causal, and the runner the rules give without the C++ decode
    kernel (the bench's "before") computing what ``attention`` computes."""
    rows = V.decode_terms(context=40, heads=4, kv_heads=2, head_dim=16, window=8, calls=2, repeats=1, warmup=0)
    ways = {r.way for r in rows}
    assert ways >= {"headwise causal", "headwise softcap", "headwise sinks", "headwise window 8",
                    "headwise sinks, rules without the decode kernel"}
    assert all(r.ms is not None and r.ms > 0 for r in rows if not r.note)
    assert next(r for r in rows if r.way == "headwise causal").vs_baseline == 1.0
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    for kw in ({"softcap": 2.0}, {"sinks": torch.randn(4, generator=g)}, {"window": 8}):
        spec = V.Spec(T=1, S=40, causal=True, scale=0.25, **kw)
        torch.testing.assert_close(V.without_decode_kernel(q, k, v, spec), V.attention(q, k, v, causal=True, **kw), atol=2e-6, rtol=0)
