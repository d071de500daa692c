"""Every ``python -m headwise.bench.<name>`` entry refuses a bad flag value the way ``headwise`` does:
argparse's one line naming the flag, exit status 2, no traceback, nothing run."""

from __future__ import annotations

import importlib

import pytest

BAD = [
    ("hf", ["--batch", "0"], "--batch: expected a positive int, got 0"),
    ("hf", ["--tokens", "-3"], "--tokens: expected an int >= 2, got -3"),
    ("hf", ["--tokens", "1"], "--tokens: expected an int >= 2, got 1"),
    ("hf", ["--models", "llama,bert"], "--models: expected a comma list of models: expected one of llama, gemma2, gpt_oss, got 'bert'"),
    ("hf", ["--models", ""], "--models: expected a comma list of models with no empty entries, got ''"),
    ("hf", ["--repeats", "2.5"], "--repeats: expected a positive int, got '2.5'"),
    ("model_decode", ["--models", "gpt3"], "--models: expected a comma list of models: expected one of gpt2, llama, got 'gpt3'"),
    ("model_decode", ["--dtypes", "fp32,int4"], "--dtypes: expected a comma list of dtypes: expected one of fp32, bf16, int8, int8-bf16, int8-a8, got 'int4'"),
    ("model_decode", ["--batches", "1,0"], "--batches: expected a comma list of positive ints: expected a positive int, got 0"),
    ("model_decode", ["--contexts", "512,"], "--contexts: expected a comma list of ints >= 2 with no empty entries, got '512,'"),
    ("model_decode", ["--contexts", "1"], "--contexts: expected a comma list of ints >= 2: expected an int >= 2, got 1"),
    ("model_decode", ["--threads", "2147483648"], "--threads: expected an int in [1, 4096], got 2147483648"),
    ("model_decode", ["--repeats", "0"], "--repeats: expected a positive int, got 0"),
    ("model_decode", ["--threads", "two"], "--threads: expected an int in [1, 4096], got 'two'"),
    ("model_decode", ["--engines", "headwise,vllm"],
     "--engines: expected a comma list of engines: expected one of headwise, transformers, CTranslate2, llama.cpp, got 'vllm'"),
    ("model_decode", ["--new-tokens", "1"], "--new-tokens: expected an int >= 2, got 1"),
    ("model_decode", ["--busy", "-1"], "--busy: expected an int in [0, 256], got -1"),
    ("model_decode", ["--root", "/proc/headwise-bench-root"],  # (a folder no one may make: refused before a checkpoint is built)
     "--root: expected a directory that can be written, got '/proc/headwise-bench-root' (No such file or directory)"),
    ("serving", ["--busy", "x"], "--busy: expected an int in [0, 256], got 'x'"),
    ("serving", ["--busy", "10000"], "--busy: expected an int in [0, 256], got 10000"),
    ("serving", ["--requests", "0"], "--requests: expected a positive int, got 0"),
    ("serving", ["--threads", "1.5"], "--threads: expected an int in [1, 4096], got '1.5'"),
    ("paged_attention", ["--threads", "-2"], "--threads: expected an int in [1, 4096], got -2"),
    ("projections", ["--rows", "1,0"], "--rows: expected a comma list of rows: expected a positive int, got 0"),
    ("projections", ["--names", "wte"], "--names: expected a comma list of names: expected one of c_attn, attn.c_proj, c_fc, mlp.c_proj, lm_head, got 'wte'"),
    ("decode_attention", ["--threads", "0"], "--threads: expected an int in [1, 4096], got 0"),
    ("decode_attention", ["--contexts", "128,x"], "--contexts: expected a comma list of positive ints: expected a positive int, got 'x'"),
    ("decode_attention", ["--dtypes", "fp64"], "--dtypes: expected a comma list of dtypes: expected one of bf16, fp16, fp32, got 'fp64'"),
    ("variants", ["--repeats", "0"], "--repeats: expected a positive int, got 0"),
    ("variants", ["--warmup", "-1"], "--warmup: expected an int >= 0, got -1"),
]
PROG = {"variants": "headwise bench --variants"}  # what it is called as: the headwise command hands it its flags


@pytest.mark.parametrize(("module", "argv", "message"), BAD, ids=[f"{m}{' '.join(a)}" for m, a, _ in BAD])
def test_a_bad_value_is_one_line_and_exit_2(module, argv, message, capsys):
    main = importlib.import_module(f"headwise.bench.{module}").main
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    prog = PROG.get(module, f"python -m headwise.bench.{module}")
    assert err.strip().splitlines()[-1] == f"{prog}: error: argument {message}"


def test_headwise_bench_modes_model_decode_runs_that_module_with_its_defaults(monkeypatch, capsys):
    from headwise.bench import cli, model_decode

    calls = []
    monkeypatch.setattr(model_decode, "main", lambda argv=None: calls.append(argv))
    cli.main(["--modes", "model-decode", "--plot", ""])
    assert calls == [[]]


def test_decode_contexts_past_gpt2s_are_refused_before_anything_runs(monkeypatch):
    from headwise.bench import harness

    ran = []
    monkeypatch.setattr(harness, "measure_ceiling", lambda *a, **k: ran.append("ceiling") or [])
    monkeypatch.setattr(harness, "_decode", lambda *a, **k: ran.append("decode") or [])
    with pytest.raises(ValueError, match=r"mode 'decode' takes contexts in \[2, 1024\] \(GPT-2's n_positions\), got \[512, 2048\]"):
        harness.run(modes=("decode",), tokens=(512, 2048))
    assert ran == []  # the 512 context was measured first before
