"""headwise.bench.decode and the one interleaved timing loop (data only: no timing is asserted)."""

import pytest
import torch

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
    (only,) = decode_latency((4,), n_layer=1, n_embd=8, n_head=2, repeats=1, uncached=False, hf=False)
    assert only.uncached_ms is None and only.hf_speedup is None and only.cache_speedup is None
    with pytest.raises(ValueError, match=r"contexts \(in \(2000,\)\) must be an int in \[2, 1024\], got 2000"):
        decode_latency((2000,))
    with pytest.raises(ValueError, match=r"repeats must be a positive int, got 0"):
        decode_latency(repeats=0)


@pytest.mark.slow
def test_model_decode_rows_count_bytes_and_agree_with_transformers(tmp_path):
    """Whole-model decode on tiny models: rows for every case, bytes read counted from the weights
    as stored and the KV actually held, and both libraries' logits equal on the same cache contents."""
    from headwise.bench.model_decode import decode_speeds, markdown, read_bytes
    from headwise.quantize import int8_weights

    rows = decode_speeds(["gpt2", "llama"], ["fp32", "int8"], [(1, 9), (3, 5)], repeats=1, warmup=0, tiny=True, root=tmp_path)
    assert [(r.model, r.dtype, r.batch, r.context) for r in rows] == [
        (m, d, b, n) for m in ("gpt2", "llama") for d in ("fp32", "int8") for b, n in [(1, 9), (3, 5)]]
    for r in rows:
        assert r.headwise_ms > 0 and r.sum_gbps > 0 and r.repeats == 1 and r.load is not None
    for model in ("gpt2", "llama"):  # a model's rows are timed in the same rounds: one sum, one load
        assert len({(r.sum_gbps, r.load) for r in rows if r.model == model}) == 1
        assert (r.transformers_ms is None) == (r.dtype == "int8") == (r.max_abs_diff is None)
        if r.max_abs_diff is not None:
            assert r.max_abs_diff < 1e-4  # same weights, same cached keys and values, same token
        assert r.gbps == r.read_bytes / r.headwise_ms / 1e6 and r.tokens_per_s == 1e3 * r.batch / r.headwise_ms
    # GPT-2 tiny: C=64, 2 layers, vocab 320, fp32: 4 projections (C*3C + C*C + C*4C + 4C*C) a layer + the tied head; K/V of 2 layers
    fp32 = 4 * (2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 320 * 64)
    assert rows[0].read_bytes == fp32 + 4 * 2 * 2 * 1 * 9 * 64  # + (k, v) x 2 layers x B=1 x 9 tokens x C floats
    from headwise import GPT2Config
    from headwise.models import GPT2LMHeadModel

    model = int8_weights(GPT2LMHeadModel(GPT2Config(vocab_size=320, n_positions=16, n_embd=64, n_layer=2, n_head=4)))
    assert read_bytes(model, 1, 1) == fp32 // 4 + 4 * (2 * (192 + 64 + 256 + 64) + 320) + 4 * 2 * 2 * 64  # int8 + float32 scales + K/V
    table = markdown(rows)
    assert table.count("\n| gpt2 | int8 |") == 2 and table.splitlines()[0].endswith("| speed-up | load |")
    with pytest.raises(ValueError, match=r"a context \(in shapes \(\(1, 1\),\)\) must be an int >= 2, got 1"):
        decode_speeds(shapes=[(1, 1)])
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'bf16', 'int8', 'int8-bf16', 'int8-a8'\], got 'int4'"):
        decode_speeds(dtypes=["int4"])


def test_model_decode_over_bf16_caches_reads_half_the_keys_and_values(tmp_path):
    from headwise.bench.model_decode import decode_speeds

    same, row = decode_speeds(["gpt2"], ["fp32"], [(1, 9)], repeats=1, warmup=0, tiny=True, root=tmp_path, cache_dtypes=[None, torch.bfloat16])
    fp32 = 4 * (2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 320 * 64)  # GPT-2 tiny's weights, as above
    assert (same.dtype, row.dtype) == ("fp32", "fp32, bf16 cache") and row.read_bytes == fp32 + 2 * 2 * 2 * 1 * 9 * 64  # 2-byte keys and values
    assert 0 < row.max_abs_diff < 0.05  # transformers' float32 step over the same (rounded) keys and values
    rows = decode_speeds(["gpt2"], ["bf16"], [(1, 9)], repeats=1, warmup=0, tiny=True, hf=False, root=tmp_path, cache_dtypes=[None, torch.bfloat16])
    assert [r.dtype for r in rows] == ["bf16"]  # a bf16 model's caches hold bf16 either way: one row, not two alike
    rows = decode_speeds(["gpt2"], ["fp32", "bf16"], [(1, 9)], repeats=1, warmup=0, tiny=True, hf=False, root=tmp_path,
                         cache_dtypes=[None, torch.int8])
    assert [r.dtype for r in rows] == ["fp32", "fp32, int8 cache", "bf16", "bf16, int8 cache"]  # 8-bit rows under either model


@pytest.mark.slow
def test_the_generation_table_runs_headwise_over_each_cache_dtype_asked_for():
    from headwise.bench.model_decode import generation_engines

    names = ["headwise", "transformers", "llama.cpp"]
    assert generation_engines(names, False, False, ["model"]) == names
    assert generation_engines(names, True, True, ["model", "bf16"]) == [
        *names, "headwise compiled", "transformers compiled", "headwise bf16 cache", "headwise compiled bf16 cache"]
    assert generation_engines(names, False, False, ["bf16"]) == ["transformers", "llama.cpp", "headwise bf16 cache"]
    assert generation_engines(names, True, False, ["int8"]) == ["transformers", "llama.cpp", "headwise int8 cache", "headwise compiled int8 cache"]


def row(model, dtype, batch, context, ms, read, compiled=None):
    """A steps row: ``ms`` eager, ``compiled`` ms, ``read`` bytes a step."""
    from headwise.bench.model_decode import DecodeSpeed

    return DecodeSpeed(model, dtype, batch, context, ms, None, read, 20.0, None, 1, 2, compiled_ms=compiled)


def test_batching_rows_say_the_gain_over_one_row_beside_the_bytes_ratio():
    from headwise.bench.model_decode import batch_gains, gains_markdown

    weights, kv = 1000, 10  # bytes: every weight once a step, each row's own keys and values
    rows = [row("gpt2", "int8", 1, 512, 10.0, weights + kv, compiled=5.0), row("gpt2", "int8", 8, 512, 20.0, weights + 8 * kv, compiled=16.0),
            row("gpt2", "int8, bf16 cache", 8, 512, 18.0, 2000),  # no B = 1 row of its own: left out
            row("gpt2", "int8", 8, 128, 18.0, 2000), row("llama", "int8", 4, 512, 30.0, 900)]  # no B = 1 row at 128, nor for llama
    (gain,) = batch_gains(rows)
    assert (gain.model, gain.dtype, gain.batch, gain.context, gain.over) == ("gpt2", "int8", 8, 512, "B = 1")
    assert gain.eager == pytest.approx(8 * 10.0 / 20.0) and gain.compiled == pytest.approx(8 * 5.0 / 16.0)
    assert gain.bytes_ratio == pytest.approx(8 * 1010 / 1080)
    assert gains_markdown([gain]).splitlines()[-1] == "| gpt2 | int8 | 8 | 512 | B = 1 | 4.00x | 2.50x | 7.48x |"
    assert batch_gains([row("gpt2", "fp32", 1, 512, 10.0, 5), row("gpt2", "fp32", 8, 512, 20.0, 8)])[0].compiled is None


def test_precision_rows_say_the_gain_over_fp32_at_the_same_shape_and_cache():
    """Each precision over the fp32 row of its model, batch, context and cache dtype: times and bytes inverted."""
    from headwise.bench.model_decode import gains_markdown, precision_gains

    rows = [row("gpt2", "fp32", 1, 512, 12.0, 4000, compiled=10.0), row("gpt2", "int8", 1, 512, 4.0, 1100, compiled=3.0),
            row("gpt2", "fp32", 8, 512, 16.0, 4800), row("gpt2", "int8-a8", 8, 512, 8.0, 1900, compiled=6.0),
            row("gpt2", "fp32, bf16 cache", 1, 512, 11.0, 3900), row("gpt2", "int8, bf16 cache", 1, 512, 3.0, 1000),
            row("gpt2", "int8", 1, 128, 3.0, 1000), row("llama", "int8", 1, 512, 3.0, 1000)]  # no fp32 row at 128, nor for llama
    gains = precision_gains(rows)
    assert [(g.model, g.dtype, g.batch, g.context, g.over) for g in gains] == [
        ("gpt2", "int8", 1, 512, "fp32"), ("gpt2", "int8-a8", 8, 512, "fp32"), ("gpt2", "int8, bf16 cache", 1, 512, "fp32")]
    one, eight, halved = gains
    assert one.eager == pytest.approx(3.0) and one.compiled == pytest.approx(10.0 / 3.0) and one.bytes_ratio == pytest.approx(4000 / 1100)
    assert eight.eager == pytest.approx(2.0) and eight.compiled is None  # no compiled fp32 row to compare with
    assert halved.eager == pytest.approx(11.0 / 3.0) and halved.bytes_ratio == pytest.approx(3.9)
    assert gains_markdown([one]).splitlines()[-1] == "| gpt2 | int8 | 1 | 512 | fp32 | 3.00x | 3.33x | 3.64x |"


def test_model_decode_with_compile_times_generates_compiled_step(tmp_path):
    """``compile=True``: a compiled-step column (the step generate(compile=True) runs)."""
    from headwise.bench.model_decode import decode_speeds, markdown

    torch._dynamo.reset()
    rows = decode_speeds(["gpt2"], ["fp32"], [(2, 7)], repeats=1, warmup=1, tiny=True, hf=False, compile=True, root=tmp_path)
    assert rows[0].compiled_ms > 0 and rows[0].compiled_share == rows[0].read_bytes / rows[0].compiled_ms / 1e6 / rows[0].sum_gbps
    assert "| compiled ms | compiled share |" in markdown(rows)
    torch._dynamo.reset()


FAKE_S = {"cached": 0.002, "uncached": 0.010, "hf_cached": 0.006}  # seconds each step "takes"


def fake_interleaved(steps, repeats, warmup):
    """Each step run once (so that its output is kept), timed as FAKE_S says, every repeat alike."""
    for step in steps.values():
        step()
    return {name: [FAKE_S[name]] * repeats for name in steps}


def test_decode_rows_hold_milliseconds_and_speedups_of_the_times_measured(monkeypatch):
    """With steps that take 2, 10 and 6 ms: the row says 2, 10 and 6 ms, a cache speedup of 5 and 3 over transformers."""
    from headwise.bench import decode

    monkeypatch.setattr(decode, "interleaved", fake_interleaved)
    (r,) = decode.decode_latency((5,), n_layer=1, n_embd=8, n_head=2, repeats=3, warmup=0)
    assert (r.cached_ms, r.uncached_ms, r.hf_cached_ms) == pytest.approx((2.0, 10.0, 6.0))
    assert (r.cache_speedup, r.hf_speedup) == pytest.approx((5.0, 3.0))
