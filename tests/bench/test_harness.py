"""A seconds-long smoke of the benchmark harness (benchmarks are not tests: no timing asserted)."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from headwise import bench


def tiny(**kw):
    args = {"presets": ("tiny",), "tokens": (16,), "batch": 2, "repeats": 2, "warmup": 1, "ceiling": False}
    return bench.run(**(args | kw))


def test_forward_and_backward_rows_for_every_implementation():
    report = tiny(modes=("forward", "backward"), impls=("headwise GPT2MultiHeadAttention", "nn.Multi"))
    names = {r.impl for r in report.rows}
    assert names == {"headwise GPT2MultiHeadAttention", "headwise GPT2MultiHeadAttention (math)",
                     "nn.MultiheadAttention (bias, mask)", "nn.MultiheadAttention (no bias, is_causal)"}
    assert len(report.rows) == 8
    for row in report.rows:
        assert row.note == "" and row.repeats == 2 and row.load is not None
        assert 0 < row.q1_s <= row.median_s <= row.q3_s
        assert row.gflops == pytest.approx(row.case.flops(row.mode) / row.median_s / 1e9)
    assert bench.fastest_peer(report, "forward", report.rows[0].case).peer
    lines = bench.summary(report).splitlines()
    assert "headwise GPT2MultiHeadAttention" in lines[0] and len(lines) == 4  # header, rule, forward, backward
    text = bench.markdown(report)
    assert "| forward: case |" in text and "| backward: case |" in text and "**headwise GPT2MultiHeadAttention**" in text
    assert "| vs fastest peer | load |" in text and f"| {report.rows[0].load} |" in text


def test_the_summary_is_empty_without_a_peer():
    """Only headwise modules timed: no ratio to show, so no table (its header alone read as a failed run)."""
    assert bench.summary(tiny(modes=("forward",), impls=("headwise GPT2MultiHeadAttention",))) == ""


def test_the_summary_is_empty_without_a_headwise_module():
    """Peers alone: no headwise column to fill (its header had one cell more than its rule)."""
    assert bench.summary(tiny(modes=("forward",), impls=("nn.Multi",))) == ""


def test_a_row_with_a_note_has_as_many_cells_as_its_table_and_one_line():
    """A failed or skipped row fills its table's columns (memory: 4, time: 8), its note on one line (an exception's
    message may hold newlines)."""
    from headwise.bench.cases import Case, Report, Row

    case = Case("tiny", 1, 16)
    report = Report("a CPU", rows=[Row("fused Linear + SDPA + Linear", True, "memory", case, peak_mib=3.0),
                                   Row("headwise GPT2MultiHeadAttention", False, "memory", case, note="skipped: too big"),
                                   Row("headwise GPT2MultiHeadAttention", False, "forward", case, note="failed: line one line two")])
    tables = [[line for line in block.splitlines() if line.startswith("|")] for block in bench.markdown(report).split("\n\n")]
    for lines in (t for t in tables if t):
        assert {line.count("|") for line in lines} == {lines[0].count("|")}, lines


def test_a_failure_note_is_one_line(monkeypatch):
    from headwise.bench import timing

    def fails(*args, **kwargs):
        raise RuntimeError("first line\nsecond line")

    monkeypatch.setattr(timing, "_step", fails)
    rows = tiny(modes=("forward",), impls=("nn.Multi",)).rows
    assert rows and all(r.note == "failed: RuntimeError: first line second line" for r in rows)


def counted_flops(case, *, backward: bool, out_proj: bool = True) -> float:
    """FLOPs torch's own counter sees in a plain layer of the case's shape, written with explicit matmuls,
    the attention matmuls (q k^T and weights v, forward and backward) counted at half: causal."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    B, T, C, H = case.batch, case.tokens, case.width, case.heads
    x = torch.randn(B, T, C, requires_grad=backward)  # (B, T, C)
    qkv, out = torch.nn.Linear(C, 3 * C), torch.nn.Linear(C, C)
    with FlopCounterMode(display=False) as counter:
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in qkv(x).split(C, dim=-1))  # (B, H, T, D) each
        ctx = (q @ k.transpose(-1, -2)).softmax(-1) @ v  # (B, H, T, D)
        y = ctx.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        y = out(y) if out_proj else y
        if backward:
            y.sum().backward()
    counts = counter.get_flop_counts()["Global"]
    attention = counts.get(aten.bmm, 0)
    assert attention and set(counts) <= {aten.bmm, aten.mm, aten.addmm}, counts
    return sum(counts.values()) - attention / 2


@pytest.mark.parametrize("case", [bench.Case("tiny", 2, 16), bench.Case("tiny", 1, 48)], ids=str)
def test_useful_flops_are_what_torchs_counter_counts_with_causal_attention_at_half(case):
    assert case.flops("forward") == counted_flops(case, backward=False)
    assert case.flops("forward", out_proj=False) == counted_flops(case, backward=False, out_proj=False)
    assert case.flops("backward") == counted_flops(case, backward=True)  # forward + backward


def test_classes_that_would_materialise_huge_scores_are_skipped_with_a_reason():
    rows = bench.time_case(bench.select(["book MultiHeadAttention"]), bench.Case("tiny", 1, 64), "forward", repeats=1, max_scores_gib=1e-9)
    assert rows[0].median_s is None and "scores need" in rows[0].note


def test_default_selection_leaves_out_torch_compile():
    names = [i.name for i in bench.select()]
    assert "headwise MultiHeadAttention" in names and not any("torch.compile" in n for n in names)


def test_ceiling_and_machine(monkeypatch):
    """Each GEMM timed by a clock that ticks 1 ms a read: 2 * 64^3 flops in 1 ms is 0.524288 GFLOP/s,
    whatever the machine's load."""
    from types import SimpleNamespace

    from headwise.bench import timing

    ticks = iter(range(10**6))
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))
    ceilings = bench.measure_ceiling("fp32", size=64, repeats=2)
    assert ceilings and [c.gflops for c in ceilings] == pytest.approx([2 * 64**3 / 1e-3 / 1e9] * len(ceilings))  # GFLOP/s
    assert "cores" in bench.machine() and "torch" in bench.machine()


@pytest.mark.slow
def test_header_names_the_cpu_and_the_linear_path_with_its_share_of_the_ceiling():
    from headwise import linear as hl

    text = bench.markdown(tiny(modes=("forward",), impls=("fused Linear + SDPA + Linear",), ceiling=True))
    facts = hl.cpu()
    assert f"family {facts['family']} model {facts['model']}" in text or not facts["vendor"]
    assert "AVX-512 " in text and "AVX512-bf16 " in text and "AMX " in text
    path, reason = hl.choose()
    assert f"Linear path fp32: {path} ({reason}; its 2048³ GEMM: " in text and "% of the ceiling)" in text
    assert "Linear path bf16" not in text  # only the dtypes the run measured


def test_memory_child_sees_the_scores_a_forward_materialises():
    """The book's class holds (B, H, T, T) float32 scores during its forward: the peak must show them. Measured as the
    benchmark measures it, in a fresh process (``memory_case``): in this one, pages freed by earlier tests may hold
    the scores without touching new ones."""
    from headwise.bench.memory import memory_case
    from headwise.bench.peers import IMPLS

    case = bench.Case("tiny", 1, 1024)
    scores_mib = case.batch * case.heads * case.tokens**2 * 4 / 2**20
    (row,) = memory_case([i for i in IMPLS if i.name == "book MultiHeadAttention"], case)
    # RSS counts pages newly touched: the allocator may put part of the scores on pages already resident (0.7% once)
    assert row.peak_mib is not None and row.peak_mib >= 0.9 * scores_mib, (row, scores_mib)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"modes must be among .*got \['sideways'\]"):
        tiny(modes=("sideways",))
    with pytest.raises(ValueError, match=r"presets must be among"):
        tiny(presets=("huge",))
    with pytest.raises(ValueError, match=r"impls \['nothing-like-this'\] match no implementation"):
        bench.select(["nothing-like-this"])
    with pytest.raises(ValueError, match=r"tokens, batch and repeats must be positive"):
        tiny(tokens=(0,))


@pytest.mark.slow
def test_cli_module_prints_a_table_and_writes_plot_and_json(tmp_path):
    png, js = tmp_path / "b.png", tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, "-m", "headwise.bench", "--preset", "tiny", "--tokens", "16", "--batch", "1", "--repeats", "1",
         "--warmup", "0", "--no-ceiling", "--modes", "forward,memory", "--impls", "headwise GPT2,nn.MultiheadAttention (no bias",
         "--plot", str(png), "--json", str(js)],
        capture_output=True, text=True, timeout=600,  # a hang guard, not a speed check: torch imports in several processes on a busy machine
    )
    assert proc.returncode == 0, proc.stderr
    assert "| forward: case |" in proc.stdout and "| memory: case |" in proc.stdout
    assert png.stat().st_size > 0
    data = json.loads(js.read_text())
    assert {r["mode"] for r in data["rows"]} == {"forward", "memory"}
    assert re.search(r"\[[#.]{24}\] \d+/\d+ ", proc.stderr), proc.stderr  # the progress bar


@pytest.mark.slow
def test_cli_decode_honours_tokens_and_batch_and_writes_the_plot_it_names(tmp_path):
    png = tmp_path / "d.png"
    proc = subprocess.run(
        [sys.executable, "-m", "headwise.bench", "--preset", "tiny", "--modes", "decode", "--tokens", "4,6", "--batch", "2",
         "--repeats", "1", "--warmup", "0", "--no-ceiling", "--plot", str(png)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| decode:"))
    assert header.rstrip(" |").endswith("cache_speedup | hf_speedup")  # the speed-up columns
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| decode:")]
    assert [row.split(" | ")[:3] for row in rows] == [["| 64", "2", "4"], ["| 64", "2", "6"]]  # width, batch, the contexts (--tokens)
    assert all(row.rstrip(" |").endswith("x") for row in rows)
    assert f"plot: {png}" in proc.stdout and png.read_bytes().startswith(b"\x89PNG")
    progress = proc.stderr.splitlines()
    assert "decode tiny B=2 context 4" in proc.stderr and "\r" not in proc.stderr  # plain lines into a pipe
    assert any(re.match(r"\[[#.]{24}\] 2/2 decode done", line) for line in progress)


def test_run_passes_tokens_and_batch_to_decode(monkeypatch):
    from headwise.bench import harness

    seen = []
    monkeypatch.setattr(harness, "decode_latency", lambda contexts, **kw: seen.append((contexts, kw["batch_size"])) or [])
    bench.run(presets=("tiny",), tokens=(3, 5), batch=3, modes=("decode",), repeats=1, warmup=0, ceiling=False)
    assert seen == [((3,), 3), ((5,), 3)]


def test_plot_writes_nothing_and_says_so_for_an_empty_report(tmp_path):
    from headwise.bench.cases import Report
    from headwise.bench.report import plot

    assert plot(Report("m"), str(tmp_path / "x.png")) is False and not (tmp_path / "x.png").exists()


def test_busy_runs_the_cases_beside_that_many_spinning_processes(monkeypatch, capsys):
    from contextlib import contextmanager

    from headwise.bench import cli
    from headwise.bench.cases import Report

    seen = []

    @contextmanager
    def spinning(processes):
        seen.append(("start", processes))
        yield
        seen.append(("end", processes))

    monkeypatch.setattr(cli, "busy", spinning)
    monkeypatch.setattr(cli, "run", lambda **kw: seen.append("run") or Report("m"))
    cli.main(["--preset", "tiny", "--tokens", "8", "--batch", "1", "--busy", "2", "--plot", "", "--no-ceiling"])
    assert seen == [("start", 2), "run", ("end", 2)]
    out = capsys.readouterr().out
    assert "Command: `headwise bench --preset tiny --tokens 8 --batch 1 --busy 2 --plot '' --no-ceiling`" in out  # pastes back: '' is the empty --plot
    (line,) = [line for line in out.splitlines() if line.startswith("Command: ")]
    assert shlex.split(line.removeprefix("Command: ").strip("`"))[2:] == ["--preset", "tiny", "--tokens", "8", "--batch", "1", "--busy", "2",
                                                                          "--plot", "", "--no-ceiling"]


def test_the_command_exits_1_when_nothing_was_measured(monkeypatch, capsys):
    """Every implementation failed (absurd sizes, say): the table says why, and the exit code says the run measured
    nothing (it was 0)."""
    from headwise.bench import timing
    from headwise.bench.cli import main

    def fails(*args, **kwargs):
        raise RuntimeError("can't allocate memory")

    monkeypatch.setattr(timing, "_step", fails)
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--modes", "forward", "--tokens", "16", "--batch", "1", "--repeats", "1", "--warmup", "0",
              "--no-ceiling", "--plot", "", "--impls", "fused Linear"])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and "failed: RuntimeError: can't allocate memory" in out
    assert err.endswith("headwise bench: nothing was measured: every implementation failed or was skipped (the notes above say why)\n")


def test_a_write_that_fails_names_its_file(capsys):
    """A full disk fails the write, not the open: the error names the file (it named None)."""
    from headwise.bench.cli import main

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--modes", "forward", "--tokens", "16", "--batch", "1", "--repeats", "1", "--warmup", "0",
              "--no-ceiling", "--plot", "", "--impls", "fused Linear", "--json", "/dev/full"])
    assert e.value.code == 2 and "error: cannot write /dev/full: No space left on device" in capsys.readouterr().err
