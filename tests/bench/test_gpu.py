"""The benchmark on CUDA: event timing, the GEMM ceiling measured there, CUDA memory (benchmarks are not tests: no timing asserted).

The event loop is checked here on the CPU against a fake CUDA clock; the real run is a smoke
test that needs a GPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from headwise import bench
from headwise.bench import timing
from headwise.bench.cases import Ceiling, Report, Row

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the run itself times kernels on a GPU")
without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error given where torch sees no GPU")


class FakeCuda:
    """torch.cuda's Event and synchronize on a fake clock in ms that the timed steps advance."""

    def __init__(self) -> None:
        self.now = 0.0
        self.synced_at: list[int] = []  # how many events had been recorded at each synchronize
        self.recorded = 0
        self.read_before_sync = False
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t: float | None = None

            def record(self) -> None:
                self.t = fake.now
                fake.recorded += 1

            def elapsed_time(self, end: Event) -> float:
                fake.read_before_sync |= not fake.synced_at or fake.synced_at[-1] < fake.recorded
                return end.t - self.t

        self.Event = Event

    def synchronize(self) -> None:
        self.synced_at.append(self.recorded)


def test_cuda_timing_uses_events_read_after_one_final_sync(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)

    def step(ms: float):
        def call() -> None:
            fake.now += ms

        return call

    times = bench.interleaved({"a": step(5.0), "b": step(2.0)}, repeats=3, warmup=2, device="cuda")
    assert times == {"a": [0.005] * 3, "b": [0.002] * 3}  # seconds, from the events around each call
    assert fake.synced_at == [0, 12]  # after the warm-up (no events yet), then once after all 3 x 2 pairs
    assert not fake.read_before_sync


def test_cpu_timing_is_unchanged_by_the_device_argument(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: pytest.fail("a CPU run must not touch CUDA"))
    times = bench.interleaved({"a": lambda: None}, repeats=2, warmup=1)
    assert len(times["a"]) == 2 and all(t >= 0 for t in times["a"])


def test_the_cuda_ceiling_is_a_gemm_timed_by_events(monkeypatch):
    """Each of the fake GEMMs advances the fake CUDA clock 2 ms: 2 * 8192^3 flops in 2 ms, read from the events."""
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    seen = []

    def paths(dtype, size, device):
        seen.append((dtype, size, device))
        return {"F.linear": lambda: setattr(fake, "now", fake.now + 2.0)}

    monkeypatch.setattr(timing, "_ceiling_paths", paths)
    (ceiling,) = bench.measure_ceiling("bf16", device="cuda", repeats=2)
    assert seen == [("bf16", 8192, "cuda")]  # a GEMM large enough to fill a GPU
    assert ceiling == Ceiling("bf16", "F.linear", pytest.approx(2 * 8192**3 / 2e-3 / 1e9))
    assert not fake.read_before_sync


def test_cuda_rows_report_tflops_and_the_share_of_the_ceiling():
    case = bench.Case("small", 8, 2048, "bf16", "cuda")
    assert case.label == "small B=8 T=2048 bf16 cuda" and bench.Case("small", 8, 2048).label == "small B=8 T=2048 fp32"
    ceiling = Ceiling("bf16", "F.linear", 989.4e3)
    rate = case.flops("forward") / 0.002 / 1e9  # GFLOP/s at 2 ms
    row = Row("headwise GPT2MultiHeadAttention", False, "forward", case, 0.002, 0.0019, 0.0021, 5, rate, 100 * rate / ceiling.gflops)
    text = bench.markdown(Report("test machine", [ceiling], [row]))
    assert "| GEMM ceiling (8192³) | path | TFLOP/s |" in text and "| 989 |" in text
    assert "| forward: case | implementation | median s | IQR s | TFLOP/s | % ceiling | vs fastest peer | load |" in text
    assert f"| {rate / 1e3:.1f} | {row.pct_of_ceiling:.0f}% |" in text
    assert "| 0.002 | 0.0019–0.0021 |" in text  # times under 10 ms keep three significant digits


@without_cuda
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match=r"device='cuda' needs a GPU that torch can see"):
        bench.run(presets=("tiny",), tokens=(16,), device="cuda")
    proc = subprocess.run([sys.executable, "-m", "headwise.bench", "--device", "cuda", "--plot", ""], capture_output=True, text=True)
    assert proc.returncode == 2 and "--device cuda: torch sees no GPU here" in proc.stderr


def test_bad_device_and_decode_on_cuda_are_named():
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda', got 'tpu'"):
        bench.run(presets=("tiny",), tokens=(16,), device="tpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"mode 'decode' runs on the CPU only"):
            bench.run(presets=("tiny",), tokens=(16,), modes=("decode",), device="cuda")


@needs_cuda
def test_a_tiny_cuda_run_times_and_measures_memory():
    report = bench.run(presets=("tiny",), tokens=(64,), batch=2, dtypes=("fp32", "bf16"), modes=("forward", "backward", "memory"),
                       impls=("headwise GPT2MultiHeadAttention", "fused Linear + SDPA + Linear"), repeats=3, warmup=1, device="cuda")
    assert "GPU " in report.machine
    timed = [r for r in report.rows if r.mode != "memory"]
    assert timed and all(r.note == "" and 0 < r.q1_s <= r.median_s <= r.q3_s for r in timed)
    assert all(r.case.device == "cuda" for r in report.rows)
    assert all(r.peak_mib is not None and r.peak_mib > 0 for r in report.rows if r.mode == "memory")
    assert all(r.pct_of_ceiling is not None for r in timed)


@pytest.mark.slow  # whole (tiny) models, transformers' generate
def test_whole_model_generation_times_both_libraries_on_each_device(device, tmp_path):
    """bench.cuda_generate's loop on tiny models (cpu; cuda too where torch sees a GPU): a row per way, the same fp32 tokens."""
    from headwise.bench import cuda_generate

    rows = cuda_generate.generate_speeds(["gpt2", "llama"], ["fp32"], [1, 3], prompt=6, new_tokens=4, rounds=1, device=device,
                                         root=tmp_path, tiny=True, init_std=0.2)
    ways = ("headwise", "transformers") + (("headwise cuda_graph",) if device == "cuda" else ())
    assert [(r["model"], r["batch"], r["way"]) for r in rows] == [(m, b, w) for m in ("gpt2", "llama") for b in (1, 3) for w in ways]
    assert all(r["prefill_ms"] > 0 and r["step_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["agree"] == 4 for r in rows if r["way"] != "headwise")  # greedy tokens equal, all 4 new ones
    text = cuda_generate.markdown(rows)
    assert text.count("\n") == 1 + len(rows) and "| gpt2 | fp32 | 3 | transformers |" in text and "| 1.00x | 4 |" in text


@pytest.mark.slow  # a subprocess
@without_cuda
def test_whole_model_generation_on_cuda_without_a_gpu_is_a_clear_error():
    from headwise.bench import cuda_generate

    with pytest.raises(ValueError, match=r"device='cuda' needs a GPU that torch can see"):
        cuda_generate.generate_speeds(["gpt2"], ["fp32"], [1])
    with pytest.raises(ValueError, match=r"precisions among \['fp32', 'bf16'\], got \['int8'\]"):
        cuda_generate.generate_speeds(["gpt2"], ["int8"], [1], device="cpu")
    with pytest.raises(ValueError, match=r"new_tokens"):
        cuda_generate.generate_speeds(["gpt2"], ["fp32"], [1], new_tokens=1, device="cpu")
    proc = subprocess.run([sys.executable, "-m", "headwise.bench.cuda_generate"], capture_output=True, text=True)
    assert proc.returncode == 2 and "needs a GPU that torch can see" in proc.stderr
