"""headwise.bench.decode and the one interleaved timing loop (data only: no timing is asserted)."""

import pytest

from headwise.bench.timing import interleaved


def test_interleaved_rotates_who_goes_first_and_skips_warmup():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = interleaved(steps, repeats=3, warmup=1)
    assert calls == list("abc" "bca" "cab" "abc")  # warm-up round, then three rotated rounds
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_decode_benchmark_returns_rows_and_agrees_with_transformers():
    from headwise.bench.decode import decode_latency

    rows = decode_latency((5, 9), n_layer=2, n_embd=32, n_head=4, repeats=1, warmup=0)
    assert [r.context for r in rows] == [5, 9]
    for r in rows:
        assert r.cached_ms > 0 and r.uncached_ms > 0 and r.hf_cached_ms > 0 and r.repeats == 1
        assert r.max_abs_diff < 1e-5  # the headwise and transformers stacks decode the same numbers
        assert r.hf_speedup == r.hf_cached_ms / r.cached_ms
    (only,) = decode_latency((4,), n_layer=1, n_embd=8, n_head=2, repeats=1, uncached=False, hf=False)
    assert only.uncached_ms is None and only.hf_speedup is None and only.cache_speedup is None
    with pytest.raises(ValueError, match=r"contexts \(in \(2000,\)\) must be an int in \[2, 1024\], got 2000"):
        decode_latency((2000,))
    with pytest.raises(ValueError, match=r"repeats must be a positive int, got 0"):
        decode_latency(repeats=0)
