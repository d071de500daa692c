"""``headwise.bench.hf``: the transformers benchmark returns its rows as data and names the machine."""

from __future__ import annotations

import pytest

from headwise.bench.hf import hf_latency, markdown


@pytest.mark.slow
def test_rows_for_each_mode_with_every_implementation_transformers_accepts():
    rows = hf_latency(batch=1, tokens=8, layers=1, repeats=1, warmup=0)
    assert [(r.model, r.mode) for r in rows] == [(m, mode) for m in ("llama", "gemma2", "gpt_oss") for mode in ("forward", "backward")]
    for r in rows:
        assert all(r.ms[i] is not None and r.ms[i] > 0 for i in ("headwise", "eager"))
        # sdpa always runs the Llama; softcap (Gemma 2) and sinks (gpt-oss) it refuses in recent transformers (5.24),
        # where older ones (5.17) ran Gemma 2 on it: None or a time, as that version does
        assert r.ms["sdpa"] is not None or r.model != "llama"
        assert r.max_abs_diff < 1e-4
    table = markdown(rows)
    assert "family" in table and "| llama | forward | 1 | 8 | no | 1 |" in table


@pytest.mark.slow
def test_a_padded_batch_compares_the_real_tokens_only():
    """Left-padded rows (eager and headwise differ only at queries that see no key) agree at every real token."""
    rows = hf_latency(("llama", "gpt_oss"), batch=3, tokens=12, layers=1, repeats=1, warmup=0, modes=("forward",), padded=True)
    assert all(r.padded and r.max_abs_diff < 1e-4 for r in rows)
    assert "| llama | forward | 3 | 12 | left | 1 |" in markdown(rows)


@pytest.mark.slow
def test_decode_steps_over_a_padded_batchs_cache_agree_and_take_the_decode_kernel(monkeypatch):
    """One-token steps over the prompt's cache, every row's mask one key longer a step: headwise's last hidden state is
    eager's, and each padded step's attention runs in the C++ decode kernel with the padding (not a mask)."""
    from headwise.backends import decode_kernel

    padded_steps = []
    run = decode_kernel.run

    def spy(q, k, v, spec):
        padded_steps.append(spec.attention_mask is not None)
        return run(q, k, v, spec)

    monkeypatch.setattr(decode_kernel, "run", spy)
    rows = hf_latency(("llama", "gemma2", "gpt_oss"), batch=3, tokens=12, layers=1, repeats=1, warmup=0, modes=("decode",), padded=True,
                      decode_steps=3)
    assert [r.mode for r in rows] == ["decode"] * 3 and all(r.max_abs_diff < 1e-4 for r in rows)
    assert all(r.ms["headwise"] > 0 and r.ms["eager"] > 0 for r in rows)
    assert "| gemma2 | decode | 3 | 12 | left | 1 |" in markdown(rows)
    if decode_kernel.available():
        assert padded_steps.count(True) >= 3 * 3  # three models' three steps, a layer each (warmup none, one round)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"models among \['llama', 'gemma2', 'gpt_oss'\], got \['bloom'\]"):
        hf_latency(("bloom",))
    with pytest.raises(ValueError, match=r"tokens must be an int >= 2, got 1"):
        hf_latency(("llama",), tokens=1)
    with pytest.raises(ValueError, match=r"decode_steps must be at most tokens \(8: the steps feed the prompt's first tokens\), got 9"):
        hf_latency(("llama",), tokens=8, modes=("decode",), decode_steps=9)
    with pytest.raises(ValueError, match=r"modes must be among \['forward', 'backward', 'decode'\]"):
        hf_latency(("llama",), modes=("generate",))


def test_the_command_refuses_more_decode_steps_than_tokens_in_one_line(capsys):
    """The steps feed the prompt's first tokens: the default 16 steps over a shorter prompt is an argument error (it
    was a traceback), before anything runs."""
    from headwise.bench.hf import main

    with pytest.raises(SystemExit) as e:
        main(["--tokens", "2", "--modes", "decode"])
    assert e.value.code == 2
    assert "error: --decode-steps must be at most --tokens (2: the steps feed the prompt's first tokens), got 16" in capsys.readouterr().err
