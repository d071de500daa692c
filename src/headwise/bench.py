"""Benchmarks: headwise against the peers, side by side, on this machine.

Every implementation computes the same causal self-attention layer (B, T, C) -> (B, T, C):
Q/K/V projections, attention over H heads of size D = C / H, heads merged, an output
projection (the book's wrapper has none). Fairness rules:

- one case (mode, shape, dtype) builds every implementation, warms each up, then times them
  interleaved, A B C A B C ..., so that noise from other jobs hits all alike; median and
  quartiles are reported;
- forward runs under ``torch.no_grad()`` in eval mode (inference); "backward" times forward +
  ``backward`` of a fixed upstream gradient w.r.t. the input and every parameter;
- ``torch.nn.MultiheadAttention`` gets ``batch_first=True``, the causal mask it needs (bool,
  True = may NOT attend, its convention), ``need_weights=False`` and no projection on top;
- transformers' ``GPT2Attention`` eager gets the additive causal mask its model would build
  (once, outside the timer); its sdpa variant needs none (``is_causal``);
- "memory" runs each case in a fresh subprocess and reports the max RSS during one forward
  minus the RSS just before it (module and input already built);
- the machine's ceiling is measured in the same run: the best GEMM rate torch reaches here
  per dtype (``F.linear``'s BLAS and oneDNN's inner product), so achieved GFLOP/s can be
  read as a share of what the cores can do.

Useful FLOPs of one forward (causal, so QK^T and AV count half):
``2·B·T·C·(3C) + 2·B·T·C·C`` for the projections (no ``C·C`` term without an output
projection) plus ``2·B·T²·C`` for attention; forward + backward counts 3x the forward.

The functions return dataclasses; ``main`` (``headwise bench``, ``python -m headwise.bench``)
parses, prints a Markdown table, and plots.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PRESETS: dict[str, tuple[int, int]] = {"small": (768, 12), "medium": (1024, 16), "tiny": (64, 4)}  # name -> (C, H)
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODES = ("forward", "backward", "memory", "decode")

Progress = Callable[[int, int, str], None]  # (done, total, what is running now)


@dataclass(frozen=True)
class Case:
    """One shape: ``preset`` names (C, H); B sequences of T tokens in ``dtype`` ("fp32" / "bf16")."""

    preset: str
    batch: int
    tokens: int
    dtype: str = "fp32"

    @property
    def width(self) -> int:
        return PRESETS[self.preset][0]

    @property
    def heads(self) -> int:
        return PRESETS[self.preset][1]

    def flops(self, mode: str, out_proj: bool = True) -> float:
        """Useful FLOPs of one call in ``mode`` (causal attention at half)."""
        B, T, C = self.batch, self.tokens, self.width
        forward = 2 * B * T * C * (3 * C + (C if out_proj else 0)) + 2 * B * T * T * C
        return 3 * forward if mode == "backward" else forward


@dataclass(frozen=True)
class Row:
    """One implementation in one case and mode. ``note`` says why a row has no numbers."""

    impl: str
    peer: bool
    mode: str
    case: Case
    median_s: float | None = None
    q1_s: float | None = None
    q3_s: float | None = None
    repeats: int = 0
    gflops: float | None = None
    pct_of_ceiling: float | None = None
    peak_mib: float | None = None
    note: str = ""


@dataclass(frozen=True)
class Ceiling:
    """The rate of a large GEMM (2048^3) in ``dtype`` through one of torch's paths."""

    dtype: str
    path: str
    gflops: float


@dataclass
class Report:
    machine: str
    ceilings: list[Ceiling] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    decode: list = field(default_factory=list)  # rows from headwise.bench_decode, when it exists
    command: str = ""

    def ceiling(self, dtype: str) -> float | None:
        rates = [c.gflops for c in self.ceilings if c.dtype == dtype]
        return max(rates) if rates else None


# ----------------------------------------------------------------------------- implementations


@dataclass(frozen=True)
class Impl:
    """A way to build the layer: ``build(case)`` -> (module, call) with ``call(x) -> (B, T, C)``."""

    name: str
    peer: bool
    build: Callable[[Case], tuple[nn.Module, Callable[[Tensor], Tensor]]]
    scores: bool = False  # materialises (B, H, T, T) scores: skipped where they would not fit
    out_proj: bool = True
    needs: str = ""  # a module that must be importable


def _headwise_mha(case: Case):
    from .teaching import MultiHeadAttention

    m = MultiHeadAttention(case.width, case.width, case.tokens, 0.0, case.heads)
    return m, m


def _headwise_gpt2(backend: str):
    def build(case: Case):
        from .config import GPT2Config
        from .fused import GPT2MultiHeadAttention

        cfg = GPT2Config(n_embd=case.width, n_head=case.heads, n_positions=max(case.tokens, 1024), attn_pdrop=0.0, resid_pdrop=0.0)
        m = GPT2MultiHeadAttention(cfg, backend=backend)
        return m, m

    return build


def _book(wrapper: bool):
    def build(case: Case):
        from llms_from_scratch import ch03

        if wrapper:
            m = ch03.MultiHeadAttentionWrapper(case.width, case.width // case.heads, case.tokens, 0.0, case.heads)
        else:
            m = ch03.MultiHeadAttention(case.width, case.width, case.tokens, 0.0, case.heads)
        return m, m

    return build


def _torch_mha(bias: bool, is_causal: bool):
    def build(case: Case):
        m = nn.MultiheadAttention(case.width, case.heads, bias=bias, batch_first=True)
        future = torch.ones(case.tokens, case.tokens, dtype=torch.bool).triu(1)  # (T, T) True = may NOT attend

        def call(x: Tensor) -> Tensor:
            return m(x, x, x, attn_mask=future, need_weights=False, is_causal=is_causal)[0]  # (B, T, C)

        return m, call

    return build


def _transformers(implementation: str):
    def build(case: Case):
        from transformers import GPT2Config as HFConfig
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

        cfg = HFConfig(n_embd=case.width, n_head=case.heads, n_positions=max(case.tokens, 1024), attn_pdrop=0.0, resid_pdrop=0.0,
                       attn_implementation=implementation)
        m = GPT2Attention(cfg, layer_idx=0)
        mask = None
        if implementation == "eager":  # what GPT2Model builds once per forward: additive, finfo.min above the diagonal
            dtype = DTYPES[case.dtype]
            future = torch.ones(case.tokens, case.tokens, dtype=torch.bool).triu(1)  # (T, T)
            mask = torch.zeros(1, 1, case.tokens, case.tokens, dtype=dtype).masked_fill(future, torch.finfo(dtype).min)  # (1, 1, T, T)

        def call(x: Tensor) -> Tensor:
            return m(x, attention_mask=mask)[0]  # (B, T, C)

        return m, call

    return build


class FusedReference(nn.Module):
    """The plain fast layer anyone would write: fused Linear, SDPA(is_causal), Linear."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=-1)  # (B, T, C) x3
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


def _fused_reference(compiled: bool):
    def build(case: Case):
        m = FusedReference(case.width, case.heads)
        return m, (torch.compile(m) if compiled else m)

    return build


IMPLS: list[Impl] = [
    Impl("headwise MultiHeadAttention", False, _headwise_mha),
    Impl("headwise GPT2MultiHeadAttention", False, _headwise_gpt2("auto")),
    Impl("headwise GPT2MultiHeadAttention (math)", False, _headwise_gpt2("math"), scores=True),
    Impl("book MultiHeadAttention", True, _book(False), scores=True, needs="llms_from_scratch"),
    Impl("book MultiHeadAttentionWrapper", True, _book(True), out_proj=False, needs="llms_from_scratch"),  # one head's scores at a time
    Impl("nn.MultiheadAttention (bias, mask)", True, _torch_mha(True, False)),
    Impl("nn.MultiheadAttention (no bias, is_causal)", True, _torch_mha(False, True)),
    Impl("transformers GPT2Attention eager", True, _transformers("eager"), scores=True, needs="transformers"),
    Impl("transformers GPT2Attention sdpa", True, _transformers("sdpa"), needs="transformers"),
    Impl("fused Linear + SDPA + Linear", True, _fused_reference(False)),
    Impl("fused Linear + SDPA + Linear, torch.compile", True, _fused_reference(True)),
]
DEFAULT_SKIP = ("torch.compile",)  # minutes of compiling on a small CPU: ask for it with --impls


def select(patterns: Sequence[str] | None = None) -> list[Impl]:
    """The implementations whose name contains any of ``patterns`` (default: all but torch.compile)."""
    if not patterns:
        return [i for i in IMPLS if not any(s in i.name for s in DEFAULT_SKIP)]
    chosen = [i for i in IMPLS if any(p.lower() in i.name.lower() for p in patterns)]
    if not chosen:
        raise ValueError(f"impls {list(patterns)} match no implementation; the names are {[i.name for i in IMPLS]}")
    return chosen


def _missing(impl: Impl) -> str:
    if not impl.needs:
        return ""
    try:
        __import__(impl.needs)
    except ImportError:
        return f"{impl.needs} is not installed"
    return ""


def _too_big(impl: Impl, case: Case, max_scores_gib: float) -> str:
    if not impl.scores:
        return ""
    gib = 3 * case.batch * case.heads * case.tokens**2 * torch.finfo(DTYPES[case.dtype]).bits / 8 / 2**30  # scores, masked, softmax
    return f"skipped: its (B, H, T, T) scores need ~{gib:.1f} GiB (> --max-scores-gib {max_scores_gib:g})" if gib > max_scores_gib else ""


def _prepare(impl: Impl, case: Case, seed: int = 0) -> tuple[nn.Module, Callable[[Tensor], Tensor], Tensor]:
    with torch.random.fork_rng():  # seeded weights without touching the caller's RNG
        torch.manual_seed(seed)
        module, call = impl.build(case)
    module.to(DTYPES[case.dtype]).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(case.batch, case.tokens, case.width, generator=gen).to(DTYPES[case.dtype])  # (B, T, C)
    return module, call, x


# ----------------------------------------------------------------------------- timing


def _step(mode: str, module: nn.Module, call: Callable[[Tensor], Tensor], x: Tensor, grad: Tensor | None) -> Callable[[], None]:
    if mode == "forward":

        def forward() -> None:
            with torch.no_grad():
                call(x)

        return forward
    params = [p for p in module.parameters() if p.requires_grad]
    xg = x.detach().requires_grad_(True)

    def forward_backward() -> None:
        for p in params:
            p.grad = None
        xg.grad = None
        call(xg).backward(grad)

    return forward_backward


def _quartiles(ts: list[float]) -> tuple[float, float, float]:
    if len(ts) < 2:
        return ts[0], ts[0], ts[0]
    q1, q2, q3 = statistics.quantiles(ts, n=4, method="inclusive")
    return q2, q1, q3


def time_case(
    impls: Sequence[Impl],
    case: Case,
    mode: str,
    *,
    repeats: int = 5,
    warmup: int = 2,
    max_scores_gib: float = 8.0,
    ceiling: float | None = None,
    progress: Progress | None = None,
) -> list[Row]:
    """Time every implementation on one case, interleaved; one Row each (in ``impls`` order)."""
    if mode not in ("forward", "backward"):
        raise ValueError(f"mode must be 'forward' or 'backward' here, got {mode!r}")
    steps: dict[str, Callable[[], None]] = {}
    notes: dict[str, str] = {}
    for impl in impls:
        note = _missing(impl) or _too_big(impl, case, max_scores_gib)
        if note:
            notes[impl.name] = note
            continue
        try:
            module, call, x = _prepare(impl, case)
            grad = torch.randn(case.batch, case.tokens, case.width).to(x.dtype) if mode == "backward" else None  # (B, T, C)
            step = _step(mode, module, call, x, grad)
            for _ in range(warmup):
                step()
            steps[impl.name] = step
        except Exception as e:  # a peer that cannot run this case is reported, not fatal
            notes[impl.name] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    times: dict[str, list[float]] = {name: [] for name in steps}
    done, total = 0, repeats * len(steps)
    for _ in range(repeats):
        for name, step in steps.items():
            if progress:
                progress(done, total, f"{mode} {case.preset} B={case.batch} T={case.tokens} {case.dtype}: {name}")
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
            done += 1
    rows = []
    for impl in impls:
        if impl.name not in times:
            rows.append(Row(impl.name, impl.peer, mode, case, note=notes.get(impl.name, "")))
            continue
        med, q1, q3 = _quartiles(times[impl.name])
        rate = case.flops(mode, impl.out_proj) / med / 1e9
        pct = 100 * rate / ceiling if ceiling else None
        rows.append(Row(impl.name, impl.peer, mode, case, med, q1, q3, repeats, rate, pct))
    return rows


def measure_ceiling(dtype: str, *, size: int = 2048, repeats: int = 3) -> list[Ceiling]:
    """The best rate of a size^3 GEMM through ``F.linear`` (torch's BLAS) and oneDNN, interleaved."""
    from .linear import _lp, _onednn_available

    t = DTYPES[dtype]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(t)
    b = torch.randn(size, size, generator=gen).to(t)
    paths: dict[str, Callable[[], Tensor]] = {"F.linear": lambda: F.linear(a, b)}
    if _onednn_available():
        paths["oneDNN inner product"] = lambda: _lp(a, b, None)
    best = {}
    with torch.no_grad():
        for name, fn in list(paths.items()):
            try:
                fn()
            except RuntimeError:
                del paths[name]
        best = dict.fromkeys(paths, math.inf)
        for _ in range(repeats):
            for name, fn in paths.items():
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return [Ceiling(dtype, name, 2 * size**3 / s / 1e9) for name, s in best.items()]


# ----------------------------------------------------------------------------- memory


def _status_mib(field_name: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Linux: make VmHWM (max RSS) start again from the current RSS; False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_mib("VmHWM") is not None


def _memory_child(name: str, case: Case) -> dict:
    """Runs in the subprocess: build, then one forward; max RSS during it minus RSS before.

    Linux resets the max-RSS mark just before the forward (imports and construction may have
    peaked higher than the forward itself); elsewhere ``ru_maxrss`` after minus before.
    """
    impl = next(i for i in IMPLS if i.name == name)
    _module, call, x = _prepare(impl, case)
    gc.collect()
    if _reset_peak():
        before, peak = _status_mib("VmRSS") or 0.0, lambda: _status_mib("VmHWM") or 0.0
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux (bytes on macOS)
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # noqa: E731
    with torch.no_grad():
        call(x)
    return {"peak_mib": peak() - before}


def memory_case(impls: Sequence[Impl], case: Case, *, max_scores_gib: float = 8.0, progress: Progress | None = None) -> list[Row]:
    """Peak forward memory of each implementation, each in its own fresh Python process."""
    rows = []
    for n, impl in enumerate(impls):
        if progress:
            progress(n, len(impls), f"memory {case.preset} B={case.batch} T={case.tokens} {case.dtype}: {impl.name}")
        note = _missing(impl) or _too_big(impl, case, max_scores_gib)
        if note:
            rows.append(Row(impl.name, impl.peer, "memory", case, note=note))
            continue
        spec = json.dumps({"impl": impl.name, "case": asdict(case)})
        proc = subprocess.run([sys.executable, "-m", "headwise.bench", "--_memory-child", spec], capture_output=True, text=True)
        try:
            peak = json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]
            rows.append(Row(impl.name, impl.peer, "memory", case, peak_mib=peak))
        except (IndexError, KeyError, json.JSONDecodeError):
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append(Row(impl.name, impl.peer, "memory", case, note=f"failed: {tail[:120]}"))
    return rows


# ----------------------------------------------------------------------------- the run


def machine() -> str:
    """CPU model, cores, torch threads, vector ISA and the bf16 instructions, torch version."""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    extras = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    isa = torch.backends.cpu.get_cpu_capability()
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads, {isa}"
            f"{', ' + ', '.join(extras) if extras else ''}), Python {platform.python_version()}")


def run(
    *,
    presets: Sequence[str] = ("small",),
    tokens: Sequence[int] = (1024,),
    batch: int = 4,
    dtypes: Sequence[str] = ("fp32",),
    modes: Sequence[str] = ("forward", "backward"),
    impls: Sequence[str] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    max_scores_gib: float = 8.0,
    ceiling: bool = True,
    progress: Progress | None = None,
) -> Report:
    """Run every requested (mode, preset, tokens, dtype) case; see the module docstring.

    Args:
        presets: names in ``PRESETS`` ("small" = GPT-2 small's C=768, H=12; "medium" = 1024, 16).
        tokens: T values; each case has ``batch`` sequences of T tokens.
        dtypes: "fp32", "bf16".
        modes: any of "forward", "backward" (forward + backward), "memory", "decode".
        impls: substrings of implementation names (default: all but torch.compile).
        repeats, warmup: timed and untimed calls per implementation and case.
        max_scores_gib: skip implementations whose (B, H, T, T) scores need more.
        ceiling: measure the machine's GEMM ceiling per dtype first.

    Returns:
        A ``Report``.
    """
    for name, values, valid in (("presets", presets, PRESETS), ("dtypes", dtypes, DTYPES), ("modes", modes, MODES)):
        bad = [v for v in values if v not in valid]
        if bad:
            raise ValueError(f"{name} must be among {list(valid)}, got {bad}")
    if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in tokens) or batch < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"tokens, batch and repeats must be positive ints and warmup >= 0, got {list(tokens)}, {batch}, {repeats}, {warmup}")
    chosen = select(impls)
    report = Report(machine())
    if ceiling:
        for dtype in dtypes:
            report.ceilings += measure_ceiling(dtype)
    for mode in modes:
        if mode == "decode":
            report.decode += _decode(presets, repeats)
            continue
        for preset in presets:
            for dtype in dtypes:
                for t in tokens:
                    case = Case(preset, batch, t, dtype)
                    if mode == "memory":
                        report.rows += memory_case(chosen, case, max_scores_gib=max_scores_gib, progress=progress)
                    else:
                        report.rows += time_case(chosen, case, mode, repeats=repeats, warmup=warmup, max_scores_gib=max_scores_gib,
                                                 ceiling=report.ceiling(dtype), progress=progress)
    return report


def _decode(presets: Sequence[str], repeats: int) -> list:
    try:
        from .bench_decode import decode_latency
    except ImportError:
        return []
    rows = []
    for preset in presets:
        width, heads = PRESETS[preset]
        rows += decode_latency(n_embd=width, n_head=heads, repeats=repeats)
    return rows


def fastest_peer(report: Report, mode: str, case: Case) -> Row | None:
    """The peer with the lowest median time (or peak memory) in one case."""
    key = "peak_mib" if mode == "memory" else "median_s"
    peers = [r for r in report.rows if r.peer and r.mode == mode and r.case == case and getattr(r, key) is not None]
    return min(peers, key=lambda r: getattr(r, key), default=None)


# ----------------------------------------------------------------------------- output (CLI only)


def markdown(report: Report) -> str:
    """The report as Markdown: ceilings, one table per mode, decode rows."""
    out = [f"Machine: {report.machine}", ""]
    if report.command:
        out += [f"Command: `{report.command}`", ""]
    if report.ceilings:
        out += ["| GEMM ceiling (2048³) | path | GFLOP/s |", "|---|---|---:|"]
        out += [f"| {c.dtype} | {c.path} | {c.gflops:.0f} |" for c in report.ceilings] + [""]
    for mode in MODES[:3]:
        rows = [r for r in report.rows if r.mode == mode]
        if not rows:
            continue
        if mode == "memory":
            out += ["| memory: case | implementation | peak MiB | vs fused reference |", "|---|---|---:|---:|"]
        else:
            out += [f"| {mode}: case | implementation | median s | IQR s | GFLOP/s | % ceiling | vs fastest peer |",
                    "|---|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            c = r.case
            label = f"{c.preset} B={c.batch} T={c.tokens} {c.dtype}"
            name = r.impl if r.peer else f"**{r.impl}**"
            if r.note:
                out.append(f"| {label} | {name} | {r.note} |" + " |" * (2 if mode == "memory" else 4))
            elif mode == "memory":
                ref = next((x for x in rows if x.case == c and x.impl.startswith("fused Linear") and x.peak_mib), None)
                ratio = f"{r.peak_mib / ref.peak_mib:.2f}x" if ref else ""
                out.append(f"| {label} | {name} | {r.peak_mib:.0f} | {ratio} |")
            else:
                best = fastest_peer(report, mode, c)
                ratio = f"{r.median_s / best.median_s:.2f}x" if best else ""
                pct = f"{r.pct_of_ceiling:.0f}%" if r.pct_of_ceiling is not None else ""
                out.append(f"| {label} | {name} | {r.median_s:.4f} | {r.q1_s:.4f}–{r.q3_s:.4f} | {r.gflops:.0f} | {pct} | {ratio} |")
        out.append("")
    if report.decode:
        fields = list(asdict(report.decode[0]))
        out += ["| decode: " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
        for d in report.decode:
            vals = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in asdict(d).values()]
            out.append("| " + " | ".join(vals) + " |")
        out.append("")
    return "\n".join(out)


def summary(report: Report) -> str:
    """One line per (mode, case): each headwise module against the fastest peer, as a ratio."""
    ours = [name for name in dict.fromkeys(r.impl for r in report.rows if not r.peer) if "(" not in name]  # default backends
    out = ["| mode | case | fastest peer | its value | " + " | ".join(f"{n}" for n in ours) + " |",
           "|---|---|---|---:|" + "---:|" * len(ours)]
    for mode in MODES[:3]:
        key = "peak_mib" if mode == "memory" else "median_s"
        cases = list(dict.fromkeys(r.case for r in report.rows if r.mode == mode))
        for case in cases:
            best = fastest_peer(report, mode, case)
            if best is None:
                continue
            if mode == "memory":  # the memory target compares with the fused reference, not the leanest peer
                best = next((r for r in report.rows if r.mode == mode and r.case == case and r.impl.startswith("fused Linear")
                             and r.peak_mib is not None), best)
            cells = []
            for name in ours:
                row = next((r for r in report.rows if r.mode == mode and r.case == case and r.impl == name), None)
                value = getattr(row, key) if row else None
                cells.append(f"{value / getattr(best, key):.2f}x" if value is not None else "")
            unit = f"{best.peak_mib:.0f} MiB" if mode == "memory" else f"{best.median_s:.4f} s"
            label = f"{case.preset} B={case.batch} T={case.tokens} {case.dtype}"
            out.append(f"| {mode} | {label} | {best.impl} | {unit} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(report: Report, path: str) -> None:
    """One panel per timed mode: median seconds per implementation (lines over T, or bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES[:3] if any(r.mode == m and (r.median_s or r.peak_mib) for r in report.rows)]
    if not modes:
        return
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 5), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        rows = [r for r in report.rows if r.mode == mode and (r.median_s or r.peak_mib)]
        value = (lambda r: r.peak_mib) if mode == "memory" else (lambda r: r.median_s)
        unit = "peak MiB" if mode == "memory" else "median seconds"
        series: dict[str, list[Row]] = {}
        for r in rows:
            series.setdefault(f"{r.impl} [{r.case.preset} {r.case.dtype}]", []).append(r)
        if len({r.case.tokens for r in rows}) > 1:
            for label, rs in series.items():
                ax.plot([r.case.tokens for r in rs], [value(r) for r in rs], marker="o", lw=2.5 if not rs[0].peer else 1.2, label=label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens T")
        else:
            labels = list(series)
            ax.barh(labels, [value(series[k][0]) for k in labels], color=["C3" if not series[k][0].peer else "C0" for k in labels])
            ax.invert_yaxis()
        ax.set_title(f"{mode} (B={rows[0].case.batch})")
        ax.set_ylabel(unit) if len({r.case.tokens for r in rows}) > 1 else ax.set_xlabel(unit)
        if len({r.case.tokens for r in rows}) > 1:
            ax.legend(fontsize=7)
    fig.suptitle(report.machine, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bar(done: int, total: int, what: str) -> None:
    width = 24
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:90]:<90}")
    sys.stderr.flush()


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    """``headwise bench``: parse, run, print the Markdown table, write the plot (and JSON)."""
    p = argparse.ArgumentParser(prog="headwise bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", type=_names, default=["small"], help=f"comma list of {list(PRESETS)} (default small)")
    p.add_argument("--tokens", type=_ints, default=[1024], help="comma list of T, e.g. 128,512,1024,2048,4096,8192 (default 1024)")
    p.add_argument("--batch", type=int, default=4, help="B (default 4)")
    p.add_argument("--dtype", type=_names, default=["fp32"], help="comma list of fp32,bf16 (default fp32)")
    p.add_argument("--modes", type=_names, default=["forward", "backward"], help=f"comma list of {list(MODES)} (default forward,backward)")
    p.add_argument("--impls", type=_names, default=None, help="comma list of name substrings (default: all but torch.compile)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-scores-gib", type=float, default=8.0, help="skip classes whose (B, H, T, T) scores need more")
    p.add_argument("--no-ceiling", action="store_true", help="skip measuring the GEMM ceiling")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument("--plot", default="headwise-bench.png", help="PNG path ('' for none; default headwise-bench.png)")
    p.add_argument("--json", help="write the raw report here")
    p.add_argument("--list", action="store_true", help="list the implementations and exit")
    p.add_argument("--_memory-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._memory_child:
        spec = json.loads(args._memory_child)
        print(json.dumps(_memory_child(spec["impl"], Case(**spec["case"]))))
        return
    if args.list:
        print("\n".join(f"{'peer    ' if i.peer else 'headwise'} {i.name}" for i in IMPLS))
        return
    report = run(presets=args.preset, tokens=args.tokens, batch=args.batch, dtypes=args.dtype, modes=args.modes, impls=args.impls,
                 repeats=args.repeats, warmup=args.warmup, max_scores_gib=args.max_scores_gib, ceiling=not args.no_ceiling,
                 progress=_bar)
    sys.stderr.write("\n")
    report.command = "headwise bench " + " ".join(sys.argv[1:] if argv is None else argv)
    text = markdown(report)
    if report.rows:
        text += "\nSummary (time or memory of each headwise module / the fastest peer's; memory: / the fused reference's):\n\n"
        text += summary(report) + "\n"
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": report.machine, "command": report.command, "ceilings": [asdict(c) for c in report.ceilings],
                       "rows": [asdict(r) for r in report.rows], "decode": [asdict(d) for d in report.decode]}, f, indent=1)
    if args.plot:
        plot(report, args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
