"""bench.compile: compiled modules beside their eager selves and the compiled fused layer (data, not speed)."""

from __future__ import annotations

import pytest
import torch._dynamo as dynamo

from headwise.bench import Case, compile_case
from headwise.bench.compile import REFERENCE, markdown


@pytest.mark.slow
def test_rows_for_each_implementation_with_compile_time_and_both_medians():
    dynamo.reset()
    case = Case("tiny", 1, 8)
    rows = compile_case(case, "forward", impls=("headwise GPT2MultiHeadAttention", REFERENCE), repeats=2, warmup=0)
    dynamo.reset()
    assert [r.impl for r in rows] == ["headwise GPT2MultiHeadAttention", REFERENCE]
    for r in rows:
        assert r.mode == "forward" and r.case == case and r.repeats == 2
        assert r.compile_s >= 0 and r.median_s > 0 and r.eager_median_s > 0 and r.q1_s <= r.median_s <= r.q3_s
        assert r.speedup == r.eager_median_s / r.median_s
    table = markdown(rows)
    assert table[0].startswith("| compiled: case | mode | implementation | compile s |")
    assert table[2].startswith("| tiny B=1 T=8 fp32 | forward | **headwise GPT2MultiHeadAttention** |")
    assert table[3].endswith(f"| 1.00x | {rows[1].load} |")  # the reference against itself, then the load it ran under
    assert rows[0].load is not None and rows[0].load == rows[1].load  # one interleaved loop


def test_unknown_implementation_and_mode_are_named():
    with pytest.raises(ValueError, match=r"impls must name implementations in headwise.bench.IMPLS, got 'nope'"):
        compile_case(Case("tiny", 1, 8), "forward", impls=("nope",))
    with pytest.raises(ValueError, match=r"mode must be 'forward' or 'backward' here, got 'memory'"):
        compile_case(Case("tiny", 1, 8), "memory")
