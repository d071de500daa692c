"""``headwise.bench.generation`` and ``bench.engines``: every engine on the same checkpoint, data only (no timing asserted).

The harness is checked with the optional engines missing (monkeypatched) and with fake times;
where CTranslate2 and llama.cpp are installed, a slow test checks that their first greedy tokens
equal headwise's on the same random weights (evidence each conversion is the same model), and each
engine's runner is checked to time its first token within its call.
"""

from __future__ import annotations

import os

import pytest
import torch

from headwise.bench import engines, generation
from headwise.bench.host import Load
from headwise.bench.models import checkpoint, tokenizer


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """One directory of tiny checkpoints (and their conversions) for the module's tests."""
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(autouse=True)
def no_settling(monkeypatch):
    """No pause before each engine's turn: the tests time nothing."""
    monkeypatch.setattr(generation, "SETTLE_S", 0.0)


def tiny(root, **kw):
    args = {"models": ("gpt2",), "precisions": ("fp32",), "batches": (1,), "prompt": 8, "new_tokens": 3, "rounds": 1, "warmup": 0,
            "root": root, "tiny": True, "init_std": 0.2, "isolated": False}
    return generation.generate_speeds(**(args | kw))


def timed(row) -> bool:
    """A row with a prefill and a decode time, both positive, and no note."""
    return row.note == "" and row.prefill_ms > 0 and row.decode_ms > 0


def made(ids, new, first_s=0.0, total_s=0.0):
    """A fake engine's call: (B, new) zeros, timed as told."""
    return engines.Generated(torch.zeros(ids.shape[0], new, dtype=torch.long), first_s, total_s)


def on_a_fake_clock(monkeypatch, load):
    """headwise's engine loaded by ``load`` (whose runner gives its own times); every round runs each engine's turn
    once, in order, and the probe's 4 x 512 MiB takes 50 ms."""

    def fake_interleaved(steps, repeats, warmup):
        for _ in range(warmup + repeats):
            for name, step in steps.items():
                if name != "sum":
                    step()
        return {"sum": [0.050] * repeats}

    monkeypatch.setattr(generation, "interleaved", fake_interleaved)
    monkeypatch.setitem(engines.ENGINES, "headwise", engines.ENGINES["headwise"].__class__(
        **{**engines.ENGINES["headwise"].__dict__, "load": load}))


def test_a_missing_engine_is_a_row_saying_so_not_a_failure(root, monkeypatch):
    monkeypatch.setattr(engines, "installed", lambda module: module == "transformers")
    rows = tiny(root, batches=(1, 2), precisions=("fp32", "int8"))
    got = {(r.precision, r.batch, r.engine): r for r in rows}
    assert len(rows) == 2 * 2 * 4
    for precision in ("fp32", "int8"):
        for batch in (1, 2):
            assert timed(got[precision, batch, "headwise"])
            for name in ("CTranslate2", "llama.cpp"):
                row = got[precision, batch, name]
                assert row.decode_ms is None and row.note == f"{name} is not installed (pip install 'headwise[anchors]')"
    assert got["fp32", 1, "transformers"].agree == 3  # the same model: every token equal
    assert got["int8", 1, "transformers"].note == "transformers has no int8 format on the CPU"
    table = generation.markdown(rows)
    assert "| gpt2 | fp32 | 1 | llama.cpp | f32 | llama.cpp is not installed (pip install 'headwise[anchors]') |" in table
    assert "| gpt2 | fp32 | 1 | transformers | fp32 |" in table and "| 3/3 |" in table


def test_an_engine_that_fails_to_load_is_reported_in_its_row(root, monkeypatch):
    def broken(directory, precision, threads):
        raise RuntimeError("convert_hf_to_gguf.py failed (exit 1):\nthe last line says why")

    monkeypatch.setitem(engines.ENGINES, "llama.cpp", engines.ENGINES["llama.cpp"].__class__(
        **{**engines.ENGINES["llama.cpp"].__dict__, "load": broken, "module": "", "limits": lambda precision: ""}))
    (hw, cpp) = tiny(root, engines=("headwise", "llama.cpp"))
    assert timed(hw)
    assert cpp.decode_ms is None and cpp.note == "failed: RuntimeError: the last line says why"


def test_an_engine_that_dies_while_running_is_reported_in_its_row_and_the_others_go_on(root, monkeypatch):
    calls = []

    def dies_on_its_second_call(directory, precision, threads):
        def run(ids, new):
            calls.append(new)
            if len(calls) > 1:
                raise RuntimeError("the engine's process ended\n(exit code -4)")
            return made(ids, new)

        return run

    monkeypatch.setitem(engines.ENGINES, "llama.cpp", engines.ENGINES["llama.cpp"].__class__(
        **{**engines.ENGINES["llama.cpp"].__dict__, "load": dies_on_its_second_call, "module": "", "limits": lambda precision: ""}))
    (hw, cpp) = tiny(root, engines=("headwise", "llama.cpp"), rounds=3)
    assert timed(hw)
    assert cpp.decode_ms is None and cpp.note == "failed while running: RuntimeError: (exit code -4)"
    assert calls == [3, 3]  # three rounds: its second turn failed, no third
    assert "| gpt2 | fp32 | 1 | llama.cpp | f32 | failed while running: RuntimeError: (exit code -4) |" in generation.markdown([hw, cpp])


def test_one_sequence_engines_get_a_note_at_larger_batches(root, monkeypatch):
    calls, loads = [], []

    def one_at_a_time(directory, precision, threads):
        loads.append(precision)

        def run(ids, new):
            calls.append(ids.shape[0])
            return made(ids, new)

        return run

    monkeypatch.setitem(engines.ENGINES, "llama.cpp", engines.ENGINES["llama.cpp"].__class__(
        **{**engines.ENGINES["llama.cpp"].__dict__, "load": one_at_a_time, "module": "", "limits": lambda precision: ""}))
    rows = tiny(root, engines=("headwise", "llama.cpp"), batches=(1, 3))
    assert set(calls) == {1} and loads == ["fp32"]
    said = [(r.batch, r.engine, r.note) for r in rows if r.note]
    assert said == [(3, "llama.cpp", "llama.cpp runs one sequence at a time here")]
    rows = tiny(root, engines=("headwise", "llama.cpp"), batches=(3,))
    assert loads == ["fp32"]  # not loaded where no batch can run
    said = [(r.batch, r.engine, r.note) for r in rows if r.note]
    assert said == [(3, "llama.cpp", "llama.cpp runs one sequence at a time here")]


def test_a_format_an_engine_already_ran_for_the_model_is_not_run_again(root, monkeypatch):
    """int8 and int8-a8 are one format for llama.cpp (q8_0): loaded and timed once, the second row says which row has it."""
    loads = []

    def recorded(directory, precision, threads):
        loads.append(precision)
        return made

    monkeypatch.setitem(engines.ENGINES, "llama.cpp", engines.ENGINES["llama.cpp"].__class__(
        **{**engines.ENGINES["llama.cpp"].__dict__, "load": recorded, "module": "", "limits": lambda precision: ""}))
    rows = tiny(root, engines=("headwise", "llama.cpp"), precisions=("int8", "fp32", "int8-a8"))
    assert loads == ["int8", "fp32"]
    got = {(r.precision, r.engine): r for r in rows}
    assert got["int8-a8", "llama.cpp"].decode_ms is None and got["int8-a8", "llama.cpp"].note == "the same q8_0 as its int8 row"
    assert timed(got["int8-a8", "headwise"])  # its own format


def test_decode_per_step_bytes_and_share_come_from_the_times_measured(root, monkeypatch):
    """A runner whose first token takes 10 ms and each further token 2 ms; the probe's 4 x 512 MiB in 50 ms.
    Then a step is 2 ms, and the bytes of a step are read in 2 ms."""
    on_a_fake_clock(monkeypatch, lambda directory, precision, threads: lambda ids, new: made(ids, new, 0.010, 0.010 + 0.002 * (new - 1)))
    (hw,) = tiny(root, engines=("headwise",), new_tokens=8, rounds=2, warmup=1)
    assert hw.prefill_ms == pytest.approx(10.0) and hw.decode_ms == pytest.approx(2.0)
    assert hw.sum_gbps == pytest.approx(4 * 512 * 2**20 / 0.050 / 1e9)
    # tiny GPT-2, fp32: its matrices (4 a layer, 2 layers, the tied head) and K/V of 2 layers at the mean context 8 + 8 // 2
    matrices = 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64) + 320 * 64
    assert hw.read_bytes == 4 * matrices + 4 * 2 * 2 * 64 * 12
    assert hw.gbps == pytest.approx(hw.read_bytes / 2.0 / 1e6) and hw.share == pytest.approx(hw.gbps / hw.sum_gbps)
    assert hw.tokens_per_s == pytest.approx(500.0) and isinstance(hw.load, Load) and hw.threads == torch.get_num_threads()


def test_headwise_over_bfloat16_caches_is_a_row_of_its_own_reading_two_bytes_a_key(root, monkeypatch):
    """``headwise bf16 cache``: ``generate(cache_dtype=torch.bfloat16)`` at the precisions computed in float32, its step's
    bytes counted with 2-byte keys and values (llama.cpp's f16 cache reads as many); none at bf16 (already bfloat16)."""
    from headwise.models.generate import GenerationMixin

    asked = []
    generate = GenerationMixin.generate
    monkeypatch.setattr(GenerationMixin, "generate", lambda self, *a, **kw: asked.append(kw["cache_dtype"]) or generate(self, *a, **kw))
    rows = tiny(root, engines=("headwise", "headwise bf16 cache"), precisions=("fp32", "bf16"))
    got = {(r.precision, r.engine): r for r in rows}
    assert set(asked) == {None, torch.bfloat16}
    plain, halved = got["fp32", "headwise"], got["fp32", "headwise bf16 cache"]
    assert timed(halved) and halved.agree == 3  # tiny, std 0.2: no near-ties
    kv = 2 * 2 * 64 * (8 + 3 // 2)  # K and V, 2 layers, C = 64, the mean context
    assert plain.read_bytes - halved.read_bytes == 2 * kv
    assert got["bf16", "headwise bf16 cache"].note == "headwise bf16 cache has no bf16 format on the CPU"


def test_the_decode_is_taken_within_each_call_so_a_slow_prompt_pass_or_load_that_comes_and_goes_does_not_skew_it(root, monkeypatch):
    """Prefill 10 ms and 2 ms a step, but the second turn's prompt pass five times as slow, and the whole third turn
    three times: prefills of 10, 50 and 30 ms (median 30), and the median of each call's own steps 2 ms (the prompt
    pass's spread never taken for steps: a 1-token call less an 8-token one could give a negative step)."""
    slow = iter([(1, 1), (5, 1), (3, 3)])  # (prompt pass, steps) of each turn

    def on_the_clock(directory, precision, threads):
        def run(ids, new):
            first, steps = next(slow)
            return made(ids, new, first * 0.010, first * 0.010 + steps * 0.002 * (new - 1))

        return run

    on_a_fake_clock(monkeypatch, on_the_clock)
    (hw,) = tiny(root, engines=("headwise",), new_tokens=8, rounds=3, warmup=0)
    assert hw.decode_ms == pytest.approx(2.0) and hw.prefill_ms == pytest.approx(30.0)


@pytest.mark.slow
def test_each_engine_times_its_first_token_within_its_call(root):
    """Every engine's runner, on a real tiny model: the first token's time is after the call's start and before its end,
    and a one-token call's first token is its end."""
    directory = checkpoint("gpt2", root, tiny=True, init_std=0.2)
    ids = torch.randint(0, 319, (1, 8), generator=torch.Generator().manual_seed(2))  # (1, T)
    names = [n for n in ("headwise", "transformers", "CTranslate2", "llama.cpp") if not engines.ENGINES[n].missing("fp32")]
    assert "headwise" in names
    for name in names:
        run = engines.ENGINES[name].load(directory, "fp32", 1)
        got = run(ids, 4)
        assert got.tokens.shape == (1, 4) and 0 < got.first_s < got.total_s, name
        one = run(ids, 1)
        assert one.tokens.shape == (1, 1) and 0 < one.first_s <= one.total_s, name


def test_agreement_counts_leading_tokens_equal_in_every_row():
    a = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert generation._agree(a, a) == 4
    assert generation._agree(a, torch.tensor([[1, 2, 0, 4], [5, 6, 7, 8]])) == 2
    assert generation._agree(a, torch.tensor([[1, 2, 3, 4], [0, 6, 7, 8]])) == 0


def test_bad_arguments_are_named(root):
    with pytest.raises(ValueError, match=r"engines must be among \['headwise', .*\], got \['vllm'\]"):
        tiny(root, engines=("vllm",))
    with pytest.raises(ValueError, match=r"new_tokens must be an int >= 2, got 1"):
        tiny(root, new_tokens=1)
    with pytest.raises(ValueError, match=r"model must be one of \['gpt2', 'llama'\], got 'gpt3'"):
        tiny(root, models=("gpt3",))
    with pytest.raises(ValueError, match=r"a batch size \(in \(0,\)\) must be a positive int, got 0"):
        tiny(root, batches=(0,))


def test_the_tokenizer_has_exactly_the_models_vocabulary():
    tok = tokenizer(320)
    assert len(tok.get_vocab()) == 320 and tok.eos_token_id == 319
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 258, got 100"):
        tokenizer(100)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("engine", ["transformers", "CTranslate2", "llama.cpp"])
def test_each_engine_generates_headwise_tokens_from_its_own_conversion(root, model, engine):
    """fp32, the same random checkpoint converted by the engine's converter: the greedy tokens equal headwise's."""
    missing = engines.ENGINES[engine].missing("fp32")
    if missing:
        pytest.skip(missing)
    directory = checkpoint(model, root, tiny=True, init_std=0.2)
    ids = torch.randint(0, 319, (1, 12), generator=torch.Generator().manual_seed(1))  # (1, T)
    want = engines.ENGINES["headwise"].load(directory, "fp32", 1)(ids, 6).tokens
    got = engines.ENGINES[engine].load(directory, "fp32", 1)(ids, 6).tokens
    assert got.shape == (1, 6) and got[0, 0] == want[0, 0]
    assert got.tolist() == want.tolist()


def test_each_engine_runs_in_a_process_of_its_own(root):
    """The default: an engine is loaded in a child, not here, and its tokens and times come back."""
    from headwise.bench.isolated import Isolated

    directory = checkpoint("gpt2", root, tiny=True, init_std=0.2)
    run = Isolated("headwise", directory, "fp32", 1)
    try:
        ids = torch.randint(0, 320, (2, 8), generator=torch.Generator().manual_seed(0))
        here = engines.ENGINES["headwise"].load(directory, "fp32", 1)(ids, 3)
        assert run.process.pid != os.getpid() and run.process.is_alive()
        there = run(ids, 3)
        assert torch.equal(there.tokens, here.tokens) and 0 < there.first_s < there.total_s
    finally:
        run.close()
    assert not run.process.is_alive()
    (hw,) = generation.generate_speeds(("gpt2",), ("fp32",), (1,), engines=("headwise",), prompt=8, new_tokens=3, rounds=1, warmup=0,
                                       root=root, tiny=True, init_std=0.2)
    assert timed(hw)


def test_an_engine_that_fails_in_its_process_is_reported_by_its_own_error(root):
    from headwise.bench.isolated import Isolated

    with pytest.raises(FileNotFoundError):
        Isolated("headwise", root / "no-such-checkpoint", "fp32", 1)
