"""``headwise bench`` / ``python -m headwise.bench``: parse, run, print the Markdown table, plot."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from .. import _argtypes
from .._optional import require
from .cases import DTYPES, MODES, PRESETS, Case
from .harness import run
from .host import add_busy_flag, busy, command, machine
from .memory import memory_child
from .peers import IMPLS
from .report import markdown, plot, summary


def _bar(done: int, total: int, what: str) -> None:
    """One progress line: redrawn in place on a terminal, a plain line each into a log or a pipe."""
    width = 24
    filled = width * done // max(total, 1)
    line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {what[:90]}"
    sys.stderr.write(f"\r{line:<120}" if sys.stderr.isatty() else line + "\n")
    sys.stderr.flush()


#: the flags only some modes read, and which; given without any of those modes they are refused, not ignored
USES = {
    "preset": ("forward", "backward", "memory", "decode", "compile"),
    "tokens": ("forward", "backward", "memory", "decode", "hf", "compile"),
    "batch": ("forward", "backward", "memory", "decode", "hf", "compile"),
    "dtype": ("forward", "backward", "memory", "compile"),
    "impls": ("forward", "backward", "memory"),
    "max_scores_gib": ("forward", "backward", "memory"),
    "warmup": ("forward", "backward", "decode", "hf", "compile"),
    "repeats": ("forward", "backward", "decode", "hf", "compile"),
    "markdown": MODES,  # the layer table's files and its GEMM ceiling: hf, serving and model-decode print their own
    "json": MODES,
    "plot": MODES,
    "no_ceiling": MODES,
}
PLOT = "headwise-bench.png"  # --plot's default
DEFAULTS = {"preset": ["small"], "tokens": [1024], "batch": 4, "dtype": ["fp32"], "modes": ["forward", "backward"], "repeats": 5,
            "warmup": 2, "max_scores_gib": 8.0}


def _checked(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse flags that the chosen modes (or --list) would ignore; fill in the defaults of those not given."""
    given = [dest for dest in vars(args) if dest not in ("_memory_child", "device", "plot") and getattr(args, dest) not in (None, False)]
    given += ["plot"] if args.plot not in (PLOT, "") else []  # a plot asked for by name
    if args.list and given != ["list"]:
        p.error(f"--list lists the implementations and runs nothing: it takes no other flags, got {', '.join(_flag(d) for d in given if d != 'list')}")
    if args.variants and set(given) - {"variants", "repeats", "warmup", "busy"}:
        p.error(f"--variants reads --repeats, --warmup and --busy only, got {', '.join(_flag(d) for d in given if d not in ('variants', 'repeats', 'warmup', 'busy'))}")
    modes = args.modes or DEFAULTS["modes"]
    for dest, users in USES.items():
        if dest in given and not set(users) & set(modes) and not args.variants:
            p.error(f"{_flag(dest)} applies to --modes {','.join(users)} only, not to --modes {','.join(modes)}")
    for dest, value in DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if "hf" in modes and args.tokens[0] < 2:  # (before any mode runs: the transformers table comes last)
        p.error(f"--modes hf times a prompt of the first --tokens value, at least 2, got {args.tokens[0]}")
    return args


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _transformers_table(args: argparse.Namespace) -> str:
    """Mode "hf": transformers' Llama, Gemma 2 and gpt-oss on headwise, sdpa and eager (``bench.hf``), at the first T."""
    from .hf import hf_latency, markdown

    return markdown(hf_latency(batch=args.batch, tokens=args.tokens[0], repeats=args.repeats, warmup=args.warmup))


def main(argv: Sequence[str] | None = None) -> None:
    """``headwise bench``: parse, run, print the Markdown table, write the plot (and JSON)."""
    p = argparse.ArgumentParser(prog="headwise bench", description="Benchmarks: headwise against the peers, side by side, on this machine.")
    positive, path = _argtypes.integer(1), _argtypes.output("a file name")
    p.add_argument("--preset", type=_argtypes.listing(_argtypes.choice(list(PRESETS)), "presets"), help=f"comma list of {list(PRESETS)} (default small)")
    p.add_argument("--tokens", type=_argtypes.listing(positive, "positive ints"),
                   help="comma list of T, e.g. 128,512,1024,2048,4096,8192 (default 1024); for decode: the contexts, each <= 1024; "
                        "for hf: the first alone")
    p.add_argument("--batch", type=positive, help="B (default 4; decode too)")
    p.add_argument("--dtype", type=_argtypes.listing(_argtypes.choice(list(DTYPES)), "dtypes"), help="comma list of fp32,bf16 (default fp32)")
    p.add_argument("--modes", type=_argtypes.listing(_argtypes.choice((*MODES, "hf", "serving", "model-decode")), "modes"),
                   help=f"comma list of {[*MODES, 'hf', 'serving', 'model-decode']} (default forward,backward; hf: transformers models on headwise / "
                   "sdpa / eager; serving: many requests through GPT-2 small, bench/serving.py; model-decode: whole GPT-2 small and Llama, decode "
                   "steps against transformers and generation beside transformers, CTranslate2 and llama.cpp, bench/model_decode.py with its defaults)")
    p.add_argument("--impls", type=_argtypes.listing(str, "name substrings"), help="comma list of name substrings (default: all but torch.compile)")
    p.add_argument("--repeats", type=positive, help="timed calls per implementation and case (default 5)")
    p.add_argument("--warmup", type=_argtypes.integer(0), help="untimed calls first (default 2; with 0 the timed calls include one-time costs: packing weights, compiling)")
    p.add_argument("--max-scores-gib", type=_argtypes.number(0.0, low_open=True),
                   help="skip classes whose (B, H, T, T) scores need more (default 8)")
    p.add_argument("--no-ceiling", action="store_true", help="skip measuring the GEMM ceiling")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (default; wall clock) or cuda (CUDA events, TFLOP/s against the GEMM ceiling measured there, CUDA memory)")
    p.add_argument("--markdown", type=path, help="also write the table to this file")
    p.add_argument("--plot", default=PLOT, type=_argtypes.output("a PNG file name", none=""), help=f"PNG path ('' for none; default {PLOT})")
    p.add_argument("--json", type=path, help="write the raw report here")
    p.add_argument("--list", action="store_true", help="list the implementations and exit")
    p.add_argument("--variants", action="store_true", help="packed documents, softcap, sinks, ALiBi against the other ways (headwise.bench.variants)")
    add_busy_flag(p)
    p.add_argument("--_memory-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._memory_child:
        spec = json.loads(args._memory_child)
        print(json.dumps(memory_child(spec["impl"], Case(**spec["case"]))))
        return
    args = _checked(p, args)
    if args.list:
        print("\n".join(f"{'peer    ' if i.peer else 'headwise'} {i.name}" for i in IMPLS))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no GPU here (torch.cuda.is_available() is False)")
    if {"decode", "hf"} & set(args.modes):  # timed beside transformers: named before any table is measured
        try:
            require("transformers", "hf", f"headwise bench --modes {','.join(m for m in args.modes if m in ('decode', 'hf'))}")
        except ModuleNotFoundError as e:
            p.error(str(e))
    with busy(args.busy):
        _run(p, args, argv)


def _run(p: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None) -> None:
    """Every table the flags ask for, in order: variants, serving, model decode, then the layer cases."""
    if args.variants:
        from .variants import main as variants_main  # here: `python -m headwise.bench.variants` must not find it imported

        variants_main(["--repeats", str(args.repeats), "--warmup", str(args.warmup)])
        return
    if "serving" in args.modes:  # a whole-model benchmark of its own: many requests, three ways (bench/serving.py)
        from . import serving

        print(serving.markdown(serving.serving(), machine()) + "\n")
    if "model-decode" in args.modes:  # whole models, one decode step and generate against transformers (bench/model_decode.py)
        from . import model_decode

        model_decode.main([])
        print()
    args.modes = [m for m in args.modes if m not in ("serving", "model-decode")]
    if not args.modes:
        return
    if args.plot:
        try:
            require("matplotlib", "bench", "headwise bench's plot (--plot '' for none)")
            _argtypes.check_drawable(args.plot, "--plot")
        except (ModuleNotFoundError, ValueError) as e:
            p.error(str(e))
    transformers_too = "hf" in args.modes
    args.modes = [m for m in args.modes if m != "hf"]
    if transformers_too and not args.modes:  # only the transformers table
        print(_transformers_table(args))
        return
    try:
        report = run(presets=args.preset, tokens=args.tokens, batch=args.batch, dtypes=args.dtype, modes=args.modes, impls=args.impls,
                     repeats=args.repeats, warmup=args.warmup, max_scores_gib=args.max_scores_gib, ceiling=not args.no_ceiling,
                     progress=_bar, device=args.device)
    except ValueError as e:  # what only the run can tell (impls that match nothing, a decode context past 1024): one line
        p.error(str(e))
    if sys.stderr.isatty():
        sys.stderr.write("\n")  # end the redrawn line
    report.command = command("headwise bench", argv)
    text = markdown(report)
    if report.rows and (ratios := summary(report)):
        text += "\nSummary (time or memory of each headwise module / the fastest peer's; memory: / the fused reference's):\n\n"
        text += ratios + "\n"
    print(text)
    try:
        _write(args, report, text)
    except OSError as e:  # a directory that does not exist, no permission, a full disk: the table is printed above
        p.error(f"cannot write {e.filename}: {e.strerror}")
    if transformers_too:
        print("\n" + _transformers_table(args))
    if report.rows and all(r.note for r in report.rows) and not report.decode and not report.compiled:
        p.exit(1, "headwise bench: nothing was measured: every implementation failed or was skipped (the notes above say why)\n")


def _write(args: argparse.Namespace, report, text: str) -> None:
    """The table (--markdown), the raw report (--json) and the plot (--plot), where asked for."""
    data = {"machine": report.machine, "linear": report.linear, "command": report.command, "ceilings": [asdict(c) for c in report.ceilings],
            "rows": [asdict(r) for r in report.rows], "decode": [asdict(d) for d in report.decode],
            "compiled": [asdict(c) for c in report.compiled]}
    for name, content in ((args.markdown, lambda: text + "\n"), (args.json, lambda: json.dumps(data, indent=1))):
        if name:
            try:
                with open(name, "w") as f:
                    f.write(content())
            except OSError as e:  # (a failed write or close names no file: this one)
                raise OSError(e.errno, e.strerror, name) from None
    if args.plot and plot(report, args.plot):
        print(f"\nplot: {args.plot}")
