"""The ``headwise`` command: ``demo``, ``explain``, ``bench``. It only parses, prints and plots."""

from __future__ import annotations

import argparse
import sys

import torch


def _explain(args: argparse.Namespace) -> None:
    from .explain import explain

    torch.set_printoptions(precision=4, sci_mode=False)
    mha, steps = explain(
        d_in=args.d_in, d_out=args.d_out, num_heads=args.heads, num_tokens=args.tokens,
        batch_size=args.batch, seed=args.seed, causal=not args.bidirectional,
    )
    print(f"MultiHeadAttention(d_in={args.d_in}, d_out={args.d_out}, context_length={args.tokens}, dropout=0.0, "
          f"num_heads={args.heads}), seed {args.seed}: head_dim = {mha.head_dim}")
    for step in steps:
        print(f"\n## Step {step.number}: {step.title}\n   {step.code}")
        if step.number == 2:
            print(f"   d_out = {mha.d_out}, num_heads = {mha.num_heads}, head_dim = {mha.head_dim}")
        for name, t in step.tensors.items():
            print(f"-- {name}: shape {tuple(t.shape)}\n{t}")


def _demo(args: argparse.Namespace) -> None:
    from . import demo

    torch.set_printoptions(precision=4, sci_mode=False)
    demo.run()


def _bench(args: argparse.Namespace, rest: list[str]) -> None:
    from . import bench

    bench.main(rest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="headwise", description="Multi-head attention, explained and fast.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the book's walkthrough end to end (~20 s)")
    ex = sub.add_parser("explain", help="Steps 1-10 of multi-head attention, read off a real forward pass")
    ex.add_argument("--d-in", type=int, default=3)
    ex.add_argument("--d-out", type=int, default=2)
    ex.add_argument("--heads", type=int, default=2)
    ex.add_argument("--tokens", type=int, default=3)
    ex.add_argument("--batch", type=int, default=1)
    ex.add_argument("--seed", type=int, default=123)
    ex.add_argument("--bidirectional", action="store_true", help="no causal mask (encoder style)")
    sub.add_parser("bench", help="benchmarks against the peers (see `headwise bench --help`)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "bench":
            _bench(args, rest)
        elif rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        elif args.command == "demo":
            _demo(args)
        else:
            _explain(args)
    except ValueError as e:  # the library's clear errors, shown without a traceback
        print(f"headwise {args.command}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
