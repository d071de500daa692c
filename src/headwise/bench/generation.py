"""Prefill and greedy decode of whole models, every engine (``bench.engines``) on the same checkpoint, interleaved.

For each model, precision and batch B: one seeded prompt of ``prompt`` token ids per row; each
engine generates ``new_tokens`` tokens a turn, every engine one turn a round, the order rotated
each round (``timing.interleaved``), medians kept. Each turn is timed where the engine runs it
(``engines.Generated``): ``prefill`` from the call to its first token (the prompt pass and one
token), a decode step the rest of the call over its ``new_tokens - 1`` steps, so the prompt pass's
spread never lands on the steps. The 512 MiB ``sum`` (``host.ReadProbe``) runs in the same rounds.
Each engine runs in a process of its own (``bench.isolated``).

Bytes a step reads: every weight matrix once in the engine's format, and the cached keys and
values at the mean context of the decode (``prompt + new_tokens / 2``) in its cache's type
(``Engine.weight_bytes`` / ``kv_bytes``). ``agree`` counts the first generated tokens equal to
headwise's in every row: evidence the engines run the same model (a near tie of random
weights can part them later, sooner in 8-bit and 16-bit formats).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from time import sleep

import torch
from torch import Tensor

from .. import _checks
from .engines import ENGINES, Runner
from .host import Load, ReadProbe, loaded
from .isolated import Isolated
from .models import check, checkpoint, headwise_model, kv_bytes, matrix_elements
from .timing import interleaved


@dataclass(frozen=True)
class GenerateSpeed:
    """One engine at one model, precision and batch; milliseconds are medians of interleaved rounds.

    Attributes:
        engine, format: the engine and its own name for the precision.
        prefill_ms: the prompt pass and the first token; decode_ms: one step after it (B tokens).
        read_bytes: what a decode step reads (weights in the engine's format, K/V at the mean context).
        sum_gbps: the 512 MiB ``sum`` in the same rounds.
        agree: leading generated tokens equal to headwise's in every row (None for headwise itself).
        note: why there are no numbers (a missing engine, a format it lacks, an engine that failed; then they are None).
    """

    model: str
    precision: str
    batch: int
    engine: str
    format: str = ""
    prefill_ms: float | None = None
    decode_ms: float | None = None
    read_bytes: int = 0
    sum_gbps: float | None = None
    agree: int | None = None
    prompt: int = 0
    new_tokens: int = 0
    rounds: int = 0
    threads: int = 0
    load: Load | None = None
    note: str = ""

    @property
    def gbps(self) -> float | None:
        return None if self.decode_ms is None else self.read_bytes / self.decode_ms / 1e6

    @property
    def share(self) -> float | None:
        """GB/s over the measured read bandwidth."""
        return None if self.gbps is None or not self.sum_gbps else self.gbps / self.sum_gbps

    @property
    def tokens_per_s(self) -> float | None:
        return None if self.decode_ms is None else 1e3 * self.batch / self.decode_ms


def _agree(tokens: Tensor, reference: Tensor) -> int:
    """(B, n) x2 -> how many leading columns are equal in every row."""
    same = (tokens == reference).all(dim=0).tolist()  # (n,)
    return same.index(False) if False in same else len(same)


#: Untimed seconds before each engine's turn: the threads of the engine before it stop spinning
#: (an OpenMP runtime keeps its workers spinning a while after a parallel region) and leave the cores.
SETTLE_S = 0.25


def _timed(runners: dict[str, Runner], ids: Tensor, new_tokens: int, probe: ReadProbe, rounds: int,
           warmup: int) -> tuple[dict[str, tuple[float, float]], float, dict[str, Tensor], Load, dict[str, str]]:
    """Each runner's median prefill ms and decode ms per step, the probe's median seconds, each runner's tokens,
    the load, and why each runner that failed while running stopped.

    A runner's turn in a round is one generate call, which times its own first token and end: the
    decode is their difference within the call, so that neither a change of load between rounds
    nor the prompt pass's spread lands on it. A runner that raises (an engine's process that died
    in its native code, say) takes no more turns; the others go on.
    """
    outs: dict[str, Tensor] = {}
    splits: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    failed: dict[str, str] = {}

    def turn(name: str, run: Runner) -> Callable[[], None]:
        def call() -> None:
            if name in failed:
                return
            sleep(SETTLE_S)
            try:
                got = run(ids, new_tokens)
            except Exception as e:
                failed[name] = f"failed while running: {type(e).__name__}: {_last_line(e)}"
                return
            outs[name] = got.tokens
            splits[name].append((got.first_s, (got.total_s - got.first_s) / (new_tokens - 1)))

        return call

    steps: dict[str, Callable[[], object]] = {"sum": probe, **{name: turn(name, run) for name, run in runners.items()}}
    times, load = loaded(lambda: interleaved(steps, repeats=rounds, warmup=warmup))
    timed = {name: (1e3 * statistics.median(p for p, _ in pairs[warmup:]), 1e3 * statistics.median(d for _, d in pairs[warmup:]))
             for name, pairs in splits.items() if name not in failed}
    return timed, statistics.median(times["sum"]), {n: t for n, t in outs.items() if n not in failed}, load, failed


def _last_line(error: Exception) -> str:
    """An error's last line, at most 160 characters (an engine's converter may print pages)."""
    text = str(error).strip()
    return text.splitlines()[-1][:160] if text else ""


def generate_speeds(
    models: Sequence[str] = ("gpt2", "llama"),
    precisions: Sequence[str] = ("fp32", "bf16", "int8"),
    batches: Sequence[int] = (1,),
    *,
    engines: Sequence[str] = ("headwise", "transformers", "CTranslate2", "llama.cpp"),
    prompt: int = 512,
    new_tokens: int = 64,
    rounds: int = 3,
    warmup: int = 1,
    root: Path | None = None,
    tiny: bool = False,
    init_std: float = 0.02,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    isolated: bool = True,
) -> list[GenerateSpeed]:
    """Time every engine's prefill and decode at each model, precision and batch (see the module docstring).

    Threads: torch's count (``torch.set_num_threads``), given to CTranslate2 and llama.cpp too.
    ``isolated``: each engine loaded and run in a process of its own (``bench.isolated``), so that
    no engine's runtime slows another's turns; False loads them all in this process.
    Checkpoints and conversions are written under ``root`` once (``bench.models.default_root()``).
    An engine that is not installed, lacks a format, fails to load or fails while running gets a row with a
    note, not an error: the other engines go on.
    """
    for name, value, low in (("prompt", prompt, 1), ("new_tokens", new_tokens, 2), ("rounds", rounds, 1), ("warmup", warmup, 0)):
        _checks.integer(name, value, low=low)
    for b in batches:
        _checks.integer(f"a batch size (in {tuple(batches)!r})", b, low=1)
    for model in models:
        for precision in precisions:
            check(model, precision)
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise ValueError(f"engines must be among {list(ENGINES)}, got {unknown}")
    threads = torch.get_num_threads()
    probe = ReadProbe(repeats=4)
    rows = []
    for model in models:
        directory = checkpoint(model, root, tiny=tiny, seed=seed, init_std=init_std, positions=prompt + new_tokens)
        reference = headwise_model(directory, "fp32")
        weights, kv = matrix_elements(reference), kv_bytes(reference, torch.float32) // 4  # elements one token adds to the caches
        vocab = reference.vocab_size
        del reference
        ran: dict[tuple[str, str], str] = {}  # (engine, format) -> the precision that ran it for this model
        for precision in precisions:
            runners: dict[str, Runner] = {}
            here: dict[str, Runner] = {}
            notes: dict[str, str] = {}
            for name in engines:
                engine = ENGINES[name]
                notes[name] = engine.missing(precision)
                if not engine.batches and 1 not in batches:
                    notes[name] = notes[name] or f"{name} runs one sequence at a time here"
                fmt = engine.formats.get(precision, "")
                if not notes[name] and (name, fmt) in ran:  # e.g. int8 and int8-a8 are both CTranslate2's int8_float32
                    notes[name] = f"the same {fmt} as its {ran[name, fmt]} row"
                ran.setdefault((name, fmt), precision)
                if not notes[name]:
                    if progress:
                        progress(f"{model} {precision}: loading {name}")
                    try:
                        runners[name] = Isolated(name, directory, precision, threads) if isolated else engine.load(directory, precision, threads)
                    except Exception as e:  # a conversion or a load that fails is reported in its row
                        notes[name] = f"failed: {type(e).__name__}: {_last_line(e)}"
            for batch in batches:
                here = {n: r for n, r in runners.items() if batch == 1 or ENGINES[n].batches}
                if progress:
                    progress(f"{model} {precision} B={batch}: {', '.join(here)}")
                ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(seed))  # (B, T)
                timed, probe_s, outs, load, failed = _timed(here, ids, new_tokens, probe, rounds, warmup)
                gbps = probe.gbps(probe_s)
                context = prompt + new_tokens // 2
                for name in engines:
                    engine = ENGINES[name]
                    fmt = engine.formats.get(precision, "")
                    if name not in here or name in failed:
                        note = failed.get(name) or notes[name] or f"{name} runs one sequence at a time here"
                        rows.append(GenerateSpeed(model, precision, batch, name, fmt, note=note))
                        continue
                    step_bytes = weights * engine.weight_bytes[precision] + kv * batch * context * engine.kv_bytes[precision]
                    agree = _agree(outs[name], outs["headwise"]) if "headwise" in outs and name != "headwise" else None
                    rows.append(GenerateSpeed(model, precision, batch, name, fmt, *timed[name], int(step_bytes), gbps, agree, prompt,
                                              new_tokens, rounds, threads, load))
            for run in runners.values():
                if isinstance(run, Isolated):
                    run.close()
            runners.clear()  # the next precision's engines load into the memory these held
            here.clear()
            gc.collect()
    return rows


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def markdown(rows: Sequence[GenerateSpeed]) -> str:
    """Every row, then decode ms per step side by side per (model, precision, B) with each engine's ratio to headwise."""
    out = ["| model | precision | B | engine | format | prefill ms | decode ms/step | tok/s | MB read/step | GB/s | share of sum | sum GB/s "
           "| tokens = headwise | load |", "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.note:
            out.append(f"| {r.model} | {r.precision} | {r.batch} | {r.engine} | {r.format or '—'} | {r.note} |" + " |" * 8)
            continue
        agree = "—" if r.agree is None else f"{r.agree}/{r.new_tokens}"
        out.append(f"| {r.model} | {r.precision} | {r.batch} | {r.engine} | {r.format} | {r.prefill_ms:.1f} | {r.decode_ms:.2f} | "
                   f"{r.tokens_per_s:.0f} | {r.read_bytes / 1e6:.0f} | {r.gbps:.1f} | {r.share:.2f} | {r.sum_gbps:.1f} | {agree} | {r.load} |")
    engines = list(dict.fromkeys(r.engine for r in rows))
    groups = list(dict.fromkeys((r.model, r.precision, r.batch) for r in rows))
    out += ["", "decode ms per step (x headwise's time):", "", "| model | precision | B | " + " | ".join(engines) + " |",
            "|---|---|---:|" + "---:|" * len(engines)]
    for model, precision, batch in groups:
        got = {r.engine: r.decode_ms for r in rows if (r.model, r.precision, r.batch) == (model, precision, batch)}
        base = got.get("headwise")
        cells = [_cell(got.get(e), ".1f") + ("" if got.get(e) is None or not base else f" ({got[e] / base:.2f}x)") for e in engines]
        out.append(f"| {model} | {precision} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(out)

