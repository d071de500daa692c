"""headwise.bench.llama_decode: data only, no timing asserted."""

import pytest

from headwise.bench.llama_decode import llama_latency
from headwise.models import LlamaConfig

TINY = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=32)


def test_returns_decode_and_prefill_rows_that_agree_with_transformers():
    decode, prefill = llama_latency(9, config=TINY, decode_repeats=2, prefill_repeats=1, warmup=0)
    assert (decode.what, prefill.what) == ("decode", "prefill")
    for row in (decode, prefill):
        assert row.context == 9 and row.headwise_ms > 0 and row.transformers_ms > 0
        assert row.max_abs_diff < 1e-5  # the same model on both sides
    assert [r.what for r in llama_latency(4, config=TINY, decode_repeats=1, prefill_repeats=0)] == ["decode"]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"context must be an int in \[2, 32\], got 40"):
        llama_latency(40, config=TINY)
    with pytest.raises(ValueError, match=r"decode_repeats must be an int >= 0, got -1"):
        llama_latency(8, config=TINY, decode_repeats=-1)


def test_rows_hold_milliseconds_and_the_speedup_of_the_times_measured(monkeypatch):
    """headwise steps taking 2 ms and transformers' 5 ms: 2.0 and 5.0 ms in the row, a speedup of 2.5."""
    from headwise.bench import llama_decode

    def fake(steps, repeats, warmup):
        for step in steps.values():
            step()  # keeps each output
        return {name: [{"headwise": 0.002, "transformers": 0.005}[name]] * repeats for name in steps}

    monkeypatch.setattr(llama_decode, "interleaved", fake)
    for row in llama_decode.llama_latency(6, config=TINY, decode_repeats=2, prefill_repeats=2, warmup=0):
        assert (row.headwise_ms, row.transformers_ms, row.speedup) == pytest.approx((2.0, 5.0, 2.5))
