"""Whole-model decode on the CPU: one step of GPT-2 small and of a Llama of the same size, and whole generation beside other engines.

A decode step reads every weight once and the KV cache it attends over: its speed limit is
memory bandwidth. ``python -m headwise.bench.model_decode`` prints two tables.

**Steps** (``decode_speeds``), per model, precision, batch B and context:

- ``headwise_ms``: one step as ``generate`` runs it (its flat step, ``forward(..., check=False)`` written out: B new tokens
  through a ``KVCache`` per layer; each repeat appends its token, so the steps see
  ``context - repeats`` .. ``context`` keys, one more each time, as ``generate``'s do), median of
  interleaved repeats; ``checked_ms``: the same step through ``forward`` with its checks, every argument
  checked in every layer; ``compiled_ms``: the step ``generate(..., compile=True)`` runs;
- ``transformers_ms``: transformers' model of the same checkpoint, the same cache contents (a
  ``DynamicCache``), ``logits_to_keep=1``; None for int8 (transformers has no such CPU path);
- ``--cache-dtypes model,bf16,int8``: also (or only) headwise's caches in bfloat16 under a float32 model, or 8-bit rows under a float32 or bfloat16 model
  (``generate(..., cache_dtype=torch.bfloat16)``; the dtype column says so); transformers' caches
  stay in the model's dtype;
- ``read_bytes``: every projection and LM-head weight as stored (int8 + scales for int8), plus
  keys and values of every layer at this context and batch; ``sum_gbps``: the machine's read
  bandwidth in the same interleaved rounds (``host.ReadProbe``), so that the share is taken
  under the same load; ``load``: the load average before and after.

Every step of a model (each precision, batch, context and cache dtype asked for) is timed in the
same interleaved rounds, so the ratios between its rows are taken under one load.

Below it, **batching** (``batch_gains``): each B > 1 row's tokens per second over the B = 1 row of the
same context, eager and compiled, beside the bytes' ratio (B times the bytes one row's step reads
over the bytes the batch's step reads: the weights are read once for all rows, each row's keys and
values for that row), the gain of two steps reading at the same rate: the most a B = 1 step at
the bandwidth leaves room for. Then **precisions** (``precision_gains``): each row's tokens per
second over the fp32 row of the same shape and cache dtype, beside the bytes' ratio.

The caches hold the same random keys and values for both libraries (a step costs the same
whatever they hold), so both libraries' logits can be compared (``max_abs_diff``).

**Generation** (``bench.generation``): the prompt pass and greedy decode of headwise,
transformers, CTranslate2 and llama.cpp (``bench.engines``), each on the same checkpoint converted
by its own converter, interleaved: prefill ms, decode ms per step, GB/s and share of the read
bandwidth, and how many tokens equal headwise's. ``--cache-dtypes model,bf16`` adds headwise's rows over
bfloat16 caches (``headwise bf16 cache``: the bytes llama.cpp's f16 cache reads), ``int8`` over 8-bit ones
(``headwise int8 cache``: the bytes of llama.cpp's q8_0 cache).

The models (``bench.models``) are random checkpoints written by ``save_pretrained`` and read
back as a user reads them (outside ``torch.inference_mode``: inference-mode parameters cannot be
packed or stacked once, ``headwise.linear``), then timed in inference mode.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .. import _argtypes, _checks
from ..models.generate import decode_step
from ..quantize import Int8Linear
from . import generation
from .engines import ENGINES
from .host import Load, ReadProbe, add_busy_flag, busy, command, load_average, loaded, machine
from .models import MODELS, PRECISIONS, cache_keyword, check, checkpoint, default_root, headwise_model, kv_bytes, transformers_model
from .timing import interleaved

#: ``--cache-dtypes``: what headwise's caches hold (None: the model's dtype).
CACHE_DTYPES = {"model": None, "bf16": torch.bfloat16, "int8": torch.int8}
_CACHE_NAMES = {dtype: name for name, dtype in CACHE_DTYPES.items() if dtype is not None}  # a row's label: "<precision>, <name> cache"


@dataclass(frozen=True)
class DecodeSpeed:
    """One decode step of a whole model; milliseconds are medians of interleaved repeats.

    Attributes:
        model, dtype, batch, context: what was run ("gpt2" / "llama", a precision of ``bench.models.PRECISIONS``).
        headwise_ms, transformers_ms: one step (transformers: None for int8 weights).
        checked_ms: headwise's step through ``forward`` with its checks (every layer's checks, every step).
        read_bytes: weights + KV a step reads.
        sum_gbps: the 512 MiB sum's GB/s in the same rounds.
        max_abs_diff: largest |headwise - transformers| over the step's logits (None without transformers).
        compiled_ms: the step as ``generate(..., compile=True)`` runs it (None unless asked for).
        repeats, threads: timed rounds; ``torch.get_num_threads()``.
        load: the load average before and after the rounds.
    """

    model: str
    dtype: str
    batch: int
    context: int
    headwise_ms: float
    transformers_ms: float | None
    read_bytes: int
    sum_gbps: float
    max_abs_diff: float | None
    repeats: int
    threads: int
    checked_ms: float | None = None
    compiled_ms: float | None = None
    load: Load | None = None

    @property
    def gbps(self) -> float:
        """GB/s headwise's step reads."""
        return self.read_bytes / self.headwise_ms / 1e6

    @property
    def share(self) -> float:
        """headwise's GB/s over the measured read bandwidth."""
        return self.gbps / self.sum_gbps

    @property
    def compiled_share(self) -> float | None:
        """The compiled step's GB/s over the measured read bandwidth."""
        return None if self.compiled_ms is None else self.read_bytes / self.compiled_ms / 1e6 / self.sum_gbps

    @property
    def tokens_per_s(self) -> float:
        return 1e3 * self.batch / self.headwise_ms

    @property
    def speedup(self) -> float | None:
        """transformers' step time over headwise's (> 1 = headwise faster)."""
        return None if self.transformers_ms is None else self.transformers_ms / self.headwise_ms


def read_bytes(model: nn.Module, batch: int, context: int, cache_dtype: torch.dtype | None = None) -> int:
    """Bytes a decode step reads: the projections' and LM head's weights as stored, and every layer's K/V."""
    weights = 0
    for m in model.modules():
        if type(m) is Int8Linear:
            weights += m.weight.numel() + m.scales.numel() * 4
        elif type(m) is nn.Linear:
            weights += m.weight.numel() * m.weight.element_size()
    tied = getattr(type(model), "tied_embedding", None)
    if tied is not None and model.lm_head is None:
        w = model.get_submodule(tied).weight
        weights += w.numel() * w.element_size()
    return weights + kv_bytes(model, cache_dtype) * batch * context


def _fill(ours: nn.Module, theirs: nn.Module | None, batch: int, past: int, room: int, gen: torch.Generator, copies: int,
          cache_dtype: torch.dtype | None = None) -> tuple[list, object]:
    """``copies`` sets of headwise caches (room for ``room`` tokens, holding ``cache_dtype``) holding ``past`` random tokens'
    keys and values, and transformers' DynamicCache holding the same (in its model's dtype)."""
    kv = []
    for cache in ours.new_caches(batch, 1, cache_dtype):
        hkv, d = cache.k.shape[1], cache.head_dim
        kv.append(tuple(torch.randn(batch, hkv, past, d, generator=gen).to(cache.dtype) for _ in range(2)))  # (B, Hkv, past, D) each
    sets = []
    for _ in range(copies):
        caches = ours.new_caches(batch, room, cache_dtype)
        for cache, (k, v) in zip(caches, kv, strict=True):
            cache.update(k, v)
        sets.append(caches)
    hf_cache = None
    if theirs is not None:
        from transformers import DynamicCache

        hf_cache = DynamicCache(config=theirs.config)
        for i, (k, v) in enumerate(kv):
            hf_cache.update(k.to(theirs.dtype, copy=True), v.to(theirs.dtype, copy=True), i)
    return sets, hf_cache


def _steps(ours: nn.Module, theirs: nn.Module | None, batch: int, context: int, rounds: int, gen: torch.Generator,
           compile: bool = False, cache_dtype: torch.dtype | None = None) -> tuple[dict[str, Callable[[], Tensor]], dict[str, Tensor]]:
    """One decode step of each kind, each on caches of its own, and each kind's logits from one step on the same contents.

    Every call appends its token, as ``generate``'s steps do, so each sees one more key than the
    last (a kernel built for one key count is not reused for the next; the CPU's bfloat16 matmul
    builds one per shape): ``rounds`` calls take the caches from ``context - rounds`` keys to ``context``.
    """
    past = max(2, context - rounds)  # keys the first timed step sees
    (mine, checked_caches, compiled_caches), hf_cache = _fill(ours, theirs, batch, past - 1, past + rounds, gen, 3, cache_dtype)
    token = torch.randint(0, ours.vocab_size, (batch, 1), generator=gen)  # (B, 1)
    step = decode_step(ours, compile=True) if compile else None  # generate(..., compile=True)'s step
    eager = decode_step(ours, compile=False, check=False)  # generate's eager step: the flat step, its decisions kept across calls
    steps = {
        "headwise": lambda: eager(token, None, mine),  # (B, vocab)
        "checked": lambda: ours(token, cache=checked_caches, logits_to_keep=1)[:, 0],  # every argument checked in every layer
        **({"compiled": lambda: step(token, None, compiled_caches)} if compile else {}),
    }
    if theirs is not None:
        cached = {cache_keyword(theirs.forward): hf_cache}
        steps["transformers"] = lambda: theirs(token, **cached, use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, vocab)
    first = {name: run() for name, run in steps.items()}  # one step each on the same contents (and the compile), then back
    for caches in (mine, checked_caches, compiled_caches):
        for cache in caches:
            cache.crop(past - 1)
    if hf_cache is not None:
        hf_cache.crop(-1)  # a negative count of tokens to drop
    return steps, first



class _Case(NamedTuple):
    """One row's step of a model: what it runs (``label``: the precision, ", bf16 cache" or ", int8 cache" where the cache differs), the
    bytes it reads (``read_bytes``), its steps (``_steps``) and the largest |headwise - transformers| of their logits."""

    label: str
    batch: int
    context: int
    read_bytes: int
    steps: dict[str, Callable[[], Tensor]]
    diff: float | None


def _rel(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in float32."""
    return float((got.float() - want.float()).norm() / want.float().norm())



def _held(model: nn.Module, cache_dtypes: Sequence[torch.dtype | None]) -> list[torch.dtype]:
    """What ``model``'s caches hold for each of ``cache_dtypes``, each once (a bf16 model's caches hold bf16 for None and
    for bfloat16: one row, not two alike); 8-bit rows are a float32 or bfloat16 model's (``cache_dtype`` refuses them
    for any other)."""
    computed = model.cache_dtype(None)
    wide = (torch.float32, torch.bfloat16)
    return list(dict.fromkeys(model.cache_dtype(c) for c in cache_dtypes if c != torch.int8 or computed in wide))


def decode_speeds(
    models: Sequence[str] = MODELS,
    dtypes: Sequence[str] = PRECISIONS,
    shapes: Sequence[tuple[int, int]] = ((1, 512), (8, 512)),
    *,
    repeats: int = 10,
    warmup: int = 2,
    hf: bool = True,
    seed: int = 0,
    tiny: bool = False,
    compile: bool = False,
    cache_dtypes: Sequence[torch.dtype | None] = (None,),
    root: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[DecodeSpeed]:
    """Time one decode step of each model and precision at each (batch, context) of ``shapes`` (see the module docstring).

    With ``compile``, also the step ``generate(..., compile=True)`` runs (compiled during the warm-up rounds); with
    ``cache_dtypes``, a row for each dtype headwise's caches hold (None: the model's; bfloat16 or int8, 8-bit rows, for
    the float32 models: fp32, int8, int8-a8).
    Checkpoints are written under ``root`` once (``bench.models.default_root()``).

    Imports transformers (unless ``hf=False``). Nothing is printed (``progress`` is told what runs).
    Under ``torch.inference_mode``, with the thread count torch already has.
    """
    _checks.integer("repeats", repeats, low=1)
    _checks.integer("warmup", warmup, low=0)
    for b, n in shapes:
        _checks.integer(f"a batch size (in shapes {tuple(shapes)!r})", b, low=1)
        _checks.integer(f"a context (in shapes {tuple(shapes)!r})", n, low=2)
    for name in models:
        for dtype in dtypes:
            check(name, dtype)
    gen = torch.Generator().manual_seed(seed)
    probe = ReadProbe()
    rows = []
    for name in models:
        directory = checkpoint(name, root, tiny=tiny, seed=seed, positions=max(n for _, n in shapes))
        cases: list[_Case] = []  # every step of this model, all timed in the same rounds
        for dtype in dtypes:
            ours = headwise_model(directory, dtype)  # as a user builds them
            theirs = transformers_model(directory, dtype) if hf else None
            with torch.inference_mode():
                for (batch, context), cache_dtype in itertools.product(shapes, _held(ours, cache_dtypes)):
                    label = dtype if cache_dtype == ours.cache_dtype(None) else f"{dtype}, {_CACHE_NAMES[cache_dtype]} cache"  # as the model resolves it
                    if progress:
                        progress(f"{name} {label} B={batch} context {context}")
                    steps, outs = _steps(ours, theirs, batch, context, repeats + warmup, gen, compile, cache_dtype)
                    _check_steps(f"{name} {label}", outs, compile, dtype == "fp32" and cache_dtype is None)
                    diff = None if theirs is None else float((outs["headwise"].float() - outs["transformers"].float()).abs().max())
                    cases.append(_Case(label, batch, context, read_bytes(ours, batch, context, cache_dtype), steps, diff))
        if progress:
            progress(f"{name}: {len(cases)} cases, timed in the same rounds")
        timed = {f"{i} {kind}": run for i, case in enumerate(cases) for kind, run in case.steps.items()} | {"sum": probe}
        with torch.inference_mode():
            times, load = loaded(lambda timed=timed: interleaved(timed, repeats=repeats, warmup=warmup))
        med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        for i, c in enumerate(cases):
            rows.append(DecodeSpeed(name, c.label, c.batch, c.context, med[f"{i} headwise"], med.get(f"{i} transformers"),
                                    c.read_bytes, probe.gbps(med["sum"] / 1e3), c.diff, repeats,
                                    torch.get_num_threads(), med[f"{i} checked"], med.get(f"{i} compiled"), load))
    return rows


def _check_steps(what: str, outs: dict[str, Tensor], compile: bool, exact: bool) -> None:
    """RuntimeError unless the unchecked step's logits equal the checked step's, and the compiled step's are near them
    (``exact``: float32 throughout, 1e-4; else bf16 rounding that fused code does in another order, 0.05)."""
    if not torch.equal(outs["headwise"], outs["checked"]):
        raise RuntimeError(f"{what}: generate's unchecked step and the checked step gave different logits")
    if compile and _rel(outs["compiled"], outs["headwise"]) > (1e-4 if exact else 0.05):
        raise RuntimeError(f"{what}: the compiled step's logits are {_rel(outs['compiled'], outs['headwise']):.2g} from the eager step's")


@dataclass(frozen=True)
class Gain:
    """What a row gains in tokens per second over another row of the same model, timed in the same rounds: a batch of
    B rows over one row (``batch_gains``), or a precision over float32 (``precision_gains``).

    Attributes:
        model, dtype, batch, context: the row, as in ``DecodeSpeed``.
        over: the row it is compared with ("B = 1", or "fp32" for the same cache dtype).
        eager, compiled: its tokens per second over the other row's, eager and compiled (None when not timed).
        bytes_ratio: the same ratio for two steps that read at the same rate: the other row's bytes a token over this
            row's. For a batch, the weights are read once for all rows and each row's keys and values for that row, so
            it is the most a B = 1 step at the bandwidth leaves room for (a B = 1 step below it can gain more).
    """

    model: str
    dtype: str
    batch: int
    context: int
    over: str
    eager: float
    compiled: float | None
    bytes_ratio: float


def _gain(row: DecodeSpeed, base: DecodeSpeed, over: str) -> Gain:
    """``row``'s tokens per second over ``base``'s: each time (or bytes) of ``base``'s over ``row``'s, times the tokens a
    step of ``row`` makes over a step of ``base``."""
    tokens = row.batch / base.batch
    compiled = None if row.compiled_ms is None or base.compiled_ms is None else tokens * base.compiled_ms / row.compiled_ms
    return Gain(row.model, row.dtype, row.batch, row.context, over, tokens * base.headwise_ms / row.headwise_ms, compiled,
                tokens * base.read_bytes / row.read_bytes)


def batch_gains(speeds: Sequence[DecodeSpeed]) -> list[Gain]:
    """Each row with B > 1 over the B = 1 row of the same model, dtype (cache dtype included) and context."""
    one = {(r.model, r.dtype, r.context): r for r in speeds if r.batch == 1}
    return [_gain(r, one[r.model, r.dtype, r.context], "B = 1") for r in speeds if r.batch > 1 and (r.model, r.dtype, r.context) in one]


def precision_gains(speeds: Sequence[DecodeSpeed]) -> list[Gain]:
    """Each row of another precision over the fp32 row of the same model, batch, context and cache dtype."""
    key = lambda r: (r.model, r.batch, r.context, r.dtype.partition(",")[2])  # noqa: E731  (", bf16 cache", ", int8 cache" or "")
    fp32 = {key(r): r for r in speeds if r.dtype.partition(",")[0] == "fp32"}
    return [_gain(r, fp32[key(r)], "fp32") for r in speeds if r.dtype.partition(",")[0] != "fp32" and key(r) in fp32]


def gains_markdown(gains: Sequence[Gain]) -> str:
    """A gains table: tokens per second over the other row, measured, beside the bytes' ratio."""
    out = ["| model | dtype | B | context | over | eager | compiled | bytes' ratio |", "|---|---|---:|---:|---|---:|---:|---:|"]
    for g in gains:
        compiled = "—" if g.compiled is None else f"{g.compiled:.2f}x"
        out.append(f"| {g.model} | {g.dtype} | {g.batch} | {g.context} | {g.over} | {g.eager:.2f}x | {compiled} | {g.bytes_ratio:.2f}x |")
    return "\n".join(out)


def markdown(speeds: Sequence[DecodeSpeed]) -> str:
    """The steps table."""
    compiled = any(r.compiled_ms is not None for r in speeds)
    extra = " compiled ms | compiled share |" if compiled else ""
    out = ["| model | dtype | B | context | headwise ms | checked ms | tok/s | MB read | GB/s | share of sum GB/s | sum GB/s |" + extra
           + " transformers ms | speed-up | load |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * (1 + compiled) + "---|"]
    for r in speeds:
        hf = "—" if r.transformers_ms is None else f"{r.transformers_ms:.1f}"
        up = "—" if r.speedup is None else f"{r.speedup:.2f}x"
        checked = "—" if r.checked_ms is None else f"{r.checked_ms:.1f}"
        cells = "" if not compiled else (" — | — |" if r.compiled_ms is None else f" {r.compiled_ms:.1f} | {r.compiled_share:.2f} |")
        out.append(f"| {r.model} | {r.dtype} | {r.batch} | {r.context} | {r.headwise_ms:.1f} | {checked} | {r.tokens_per_s:.0f} | {r.read_bytes / 1e6:.0f} | "
                   f"{r.gbps:.1f} | {r.share:.2f} | {r.sum_gbps:.1f} |{cells} {hf} | {up} | {r.load} |")
    return "\n".join(out)


def generation_engines(names: Sequence[str], compile: bool, hf_compile: bool, cache_dtypes: Sequence[str]) -> list[str]:
    """The engines the generation table runs: ``names``, their compiled variants when asked for, and headwise's rows
    over each cache dtype asked for (``model``: the model's dtype; ``bf16``: ``headwise bf16 cache``; ``int8``: ``headwise
    int8 cache`` and its compiled variant)."""
    engines = [*names, *(["headwise compiled"] if compile else []), *(["transformers compiled"] if hf_compile else [])]
    ours = [e for e in engines if e.startswith("headwise")]
    bf16 = [f"{e} bf16 cache" for e in ours] if "bf16" in cache_dtypes else []
    int8 = [f"{e} int8 cache" for e in ours] if "int8" in cache_dtypes else []
    return [e for e in engines if e not in ours or "model" in cache_dtypes] + bf16 + int8


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.model_decode``: print the steps table and the generation table (progress on stderr)."""
    p = argparse.ArgumentParser(prog="python -m headwise.bench.model_decode", description=__doc__.splitlines()[0])
    positive = _argtypes.integer(1)
    p.add_argument("--models", type=_argtypes.listing(_argtypes.choice(MODELS), "models"), default=list(MODELS), help="comma list (default gpt2,llama)")
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(PRECISIONS), "dtypes"), default=list(PRECISIONS),
                   help="comma list (default fp32,bf16,int8,int8-bf16,int8-a8)")
    p.add_argument("--batches", type=_argtypes.listing(positive, "positive ints"), default=[1, 8], help="comma list (default 1,8)")
    p.add_argument("--contexts", type=_argtypes.listing(_argtypes.integer(2), "ints >= 2"), default=[128, 512, 1024],
                   help="steps: comma list (default 128,512,1024)")
    p.add_argument("--long", action="store_true", help="steps: also contexts 2048 and 4096 (B=1)")
    p.add_argument("--repeats", type=positive, default=10, help="steps: timed rounds (default 10)")
    p.add_argument("--no-steps", action="store_true", help="skip the steps table")
    p.add_argument("--no-generate", action="store_true", help="skip the generation table")
    names = [n for n, e in ENGINES.items() if not e.variant]
    p.add_argument("--engines", type=_argtypes.listing(_argtypes.choice(names), "engines"), default=names,
                   help=f"generation: comma list (default {','.join(names)}; one not installed gets a row saying so)")
    p.add_argument("--prompt", type=positive, default=512, help="generation: prompt tokens (default 512)")
    p.add_argument("--new-tokens", type=_argtypes.integer(2), default=64, help="generation: greedy tokens (default 64)")
    p.add_argument("--rounds", type=positive, default=3, help="generation: timed rounds (default 3)")
    p.add_argument("--compile", action="store_true",
                   help="also generate(compile=True)'s step and generation, and transformers' static cache under torch.compile (slow to compile)")
    p.add_argument("--no-hf-compile", action="store_true", help="with --compile: leave out transformers under torch.compile")
    p.add_argument("--cache-dtypes", type=_argtypes.listing(_argtypes.choice(CACHE_DTYPES), "cache dtypes"), default=["model"],
                   help="comma list of what headwise's caches hold: model (the model's dtype, the default), bf16 (fp32, int8, int8-a8); "
                        "generation: bf16 adds headwise's rows over bfloat16 caches")
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch.set_num_threads, and the threads of the other engines (default: torch's)")
    p.add_argument("--root", type=_argtypes.folder("a directory"), default=None,
                   help="where checkpoints and conversions are kept (default $HEADWISE_BENCH_DIR or ~/.cache/headwise/bench)")
    p.add_argument("--llama-cpp", type=_argtypes.text("a directory"), default=None,
                   help="llama.cpp's sources, holding convert_hf_to_gguf.py (default $HEADWISE_LLAMA_CPP)")
    p.add_argument("--same-process", action="store_true",
                   help="generation: load every engine in this process (default: each in a process of its own)")
    add_busy_flag(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.llama_cpp:
        os.environ["HEADWISE_LLAMA_CPP"] = args.llama_cpp
    if args.root is None:  # $HEADWISE_BENCH_DIR or the default, checked as --root is
        try:
            _argtypes.folder("a directory")(str(default_root()))
        except argparse.ArgumentTypeError as e:
            p.error(f"the checkpoints' folder ($HEADWISE_BENCH_DIR or ~/.cache/headwise/bench): {e}")
    root = Path(args.root) if args.root else None
    say = lambda what: print(what, file=sys.stderr, flush=True)  # noqa: E731
    shapes = [(1, c) for c in args.contexts] + [(b, 512) for b in args.batches if b != 1]  # B = 1 at every context, larger batches at 512
    shapes += [(1, 2048), (1, 4096)] if args.long else []
    engines = generation_engines(args.engines, args.compile, args.compile and not args.no_hf_compile, args.cache_dtypes)
    print(f"{machine()}; load average {load_average():.1f}" + (f"; {args.busy} busy processes beside it" if args.busy else "")
          + f"\nCommand: {command('python -m headwise.bench.model_decode', argv)}\n")
    with busy(args.busy):
        if not args.no_steps:
            cache_dtypes = [CACHE_DTYPES[c] for c in args.cache_dtypes]
            speeds = decode_speeds(args.models, args.dtypes, shapes, repeats=args.repeats, compile=args.compile, cache_dtypes=cache_dtypes,
                                   root=root, progress=say)
            print(markdown(speeds) + "\n", flush=True)
            for what, gains in (("B = 1", batch_gains(speeds)), ("fp32", precision_gains(speeds))):
                if gains:
                    print(f"tokens per second over {what} (timed in the same rounds):\n\n" + gains_markdown(gains) + "\n", flush=True)
        if not args.no_generate:
            rows = generation.generate_speeds(args.models, args.dtypes, args.batches, engines=engines, prompt=args.prompt,
                                              new_tokens=args.new_tokens, rounds=args.rounds, root=root, progress=say,
                                              isolated=not args.same_process)
            print(generation.markdown(rows))


if __name__ == "__main__":
    main()
