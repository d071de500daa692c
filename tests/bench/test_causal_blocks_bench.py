"""``headwise.bench.causal_blocks``: one call and each block size timed, their outputs compared first, the plan's choice named."""

import pytest
import torch

from headwise.backends import plan, prefill_kernel, sdpa
from headwise.bench import causal_blocks as bench


def test_each_block_size_is_timed_beside_one_call_and_the_plans_choice_is_named(monkeypatch):
    monkeypatch.setattr(plan, "mkl_avx512", lambda: False)  # blocks on any machine the prefill kernel is not for
    monkeypatch.setattr(prefill_kernel, "_MACHINE", False)
    r = bench.causal_prompt("fp32", 200, [64, 100], batch=1, repeats=1)
    assert (r.dtype, r.tokens, sorted(r.blocks_ms)) == ("fp32", 200, [64, 100]) and r.one_call_ms > 0
    assert r.auto == f"sdpa causal blocks of {plan.causal_rows(200)} queries"
    assert r.markdown([64, 100]).startswith("| fp32 | 200 | ") and r.markdown([64, 100]).endswith(f"| {r.auto} |")
    assert (r.kernel_ms is not None) == prefill_kernel.available()  # timed wherever it is built
    assert r.markdown([64, 100]).count(" | ") == 6 and ("—" in r.markdown([64, 100])) != prefill_kernel.available()
    monkeypatch.setattr(prefill_kernel, "_MACHINE", True)
    if prefill_kernel.available():
        assert bench.causal_prompt("fp32", 200, [64], batch=1, repeats=1).auto == plan.PREFILL_KERNEL
    monkeypatch.setattr(prefill_kernel, "_MACHINE", False)
    monkeypatch.setattr(plan, "mkl_avx512", lambda: True)
    assert bench.causal_prompt("bf16", 100, [64], batch=1, repeats=1).auto == "sdpa is_causal"
    assert bench.causal_prompt("fp32", plan.CAUSAL_BLOCKS_UP_TO + 1, [256], batch=1, repeats=1).auto == "sdpa is_causal"


def test_blocks_that_disagree_with_one_call_are_an_error_not_a_row(monkeypatch):
    monkeypatch.setattr(sdpa, "masked_blocks", lambda q, k, v, spec, rows: torch.zeros_like(q))
    with pytest.raises(RuntimeError, match=r"blocks of 64 queries are .* from one call \(fp32, T = 100\)"):
        bench.causal_prompt("fp32", 100, [64], batch=1, repeats=1)


@pytest.mark.skipif(not prefill_kernel.available(), reason="the C++ kernels could not be built here")
def test_a_kernel_that_disagrees_with_one_call_is_an_error_not_a_row(monkeypatch):
    monkeypatch.setattr(prefill_kernel, "run", lambda q, k, v, spec: torch.zeros_like(q))
    with pytest.raises(RuntimeError, match=r"the C\+\+ prefill kernel is .* from one call \(bf16, T = 100\)"):
        bench.causal_prompt("bf16", 100, [64], batch=1, repeats=1)


def test_main_prints_a_row_per_dtype_and_length_under_a_header_naming_the_cpu(capsys):
    bench.main(["--tokens", "80,130", "--rows", "64", "--dtypes", "fp32,bf16", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "family" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))]
    runners = ("| sdpa is_causal |", "| sdpa causal blocks of 64 queries |", f"| {plan.PREFILL_KERNEL} |")
    assert len(rows) == 4 and all(line.endswith(runners) for line in rows)


def test_a_chunk_after_cached_keys_is_timed_as_one_masked_call_and_the_kernel(monkeypatch):
    """With keys before the prompt there are no blocks: one call with the bottom-right mask, and the kernel where built."""
    monkeypatch.setattr(prefill_kernel, "_MACHINE", False)
    r = bench.causal_prompt("fp32", 8, [64], batch=1, repeats=1, cached=100)
    assert r.blocks_ms == {} and r.cached == 100 and r.one_call_ms > 0 and r.auto == "sdpa"
    assert r.markdown([64]).startswith("| fp32 | 8 | ") and "| — |" in r.markdown([64])
    assert (r.kernel_ms is not None) == prefill_kernel.available()


def test_a_window_times_its_blocks_and_the_kernel_beside_one_masked_call(monkeypatch):
    """With ``window``, one call folds the band into its mask and the blocks are ``masked_blocks``: all compared first."""
    monkeypatch.setattr(prefill_kernel, "_MACHINE", False)
    r = bench.causal_prompt("fp32", 200, [64], batch=1, repeats=1, window=30)
    assert r.window == 30 and sorted(r.blocks_ms) == [64] and r.auto == f"sdpa window blocks of {plan.window_rows(30)} queries"
    assert bench.causal_prompt("fp32", 100, [64], batch=1, repeats=1, window=100).window is None  # every key: no window
    monkeypatch.setattr(sdpa, "masked_blocks", lambda q, k, v, spec, rows: torch.zeros_like(q))
    with pytest.raises(RuntimeError, match=r"blocks of 64 queries are .* from one call \(fp32, T = 200\)"):
        bench.causal_prompt("fp32", 200, [64], batch=1, repeats=1, window=30)
