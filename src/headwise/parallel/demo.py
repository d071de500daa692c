"""Shard a GPT-2 across ranks by heads and generate: ``torchrun --nproc-per-node 2 -m headwise.parallel.demo``.

Each rank loads the model (a HuggingFace GPT-2 directory with ``--model``, else GPT-2
small's shape with seeded random weights), ``parallelize`` shards it over all ranks, and
every rank generates from the same prompt. Each rank prints the parameters it holds and
its tokens; rank 0 says whether every rank produced the same ones. ``gloo`` on CPUs,
``nccl`` when every rank has a GPU (one per rank, ``LOCAL_RANK``).

Options: ``--model DIR`` (with a ``tokenizer.json`` and the ``tokenizers`` package, the
prompt is text and the output is decoded), ``--prompt TEXT``, ``--ids 464,2068``,
``--max-new-tokens N``, ``--temperature T --top-k K --seed S`` to sample.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from .. import _argtypes
from ..config import GPT2Config
from ..models import loading
from ..models.gpt2 import GPT2LMHeadModel
from . import parallelize

#: What torchrun sets for each rank and the process group's env:// rendezvous reads.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m headwise.parallel.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a HuggingFace GPT-2 directory (default: GPT-2 small's shape, random weights)")
    p.add_argument("--prompt", default="Heads are independent until the output projection, so", help="prompt text (needs --model with tokenizer.json)")
    p.add_argument("--ids", default="464, 2068, 7586, 21831", help="prompt token ids, comma-separated (used without a tokenizer)")
    p.add_argument("--max-new-tokens", type=_argtypes.integer(1), default=12)
    p.add_argument("--temperature", type=_argtypes.number(0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=_argtypes.integer(1), default=None)
    p.add_argument("--seed", type=_argtypes.integer(0), default=0, help="weights (without --model) and the sampling generator")
    args = p.parse_args(argv)
    try:
        args.ids = [int(i) for i in args.ids.split(",")]
    except ValueError:
        p.error(f"--ids must be comma-separated token ids, got {args.ids!r}")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model must be a HuggingFace GPT-2 directory with config.json, got {args.model}")
    return args


def _tokenizer(model_dir: Path | None):
    """The model directory's tokenizer, or None (token ids are printed instead) when it has no tokenizer.json."""
    if model_dir is None or not (model_dir / loading.TOKENIZER).is_file():
        return None
    return loading.read_tokenizer(model_dir, "the demo")


def _device() -> torch.device:
    """This rank's GPU when every local rank has one (``LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def run(argv: list[str] | argparse.Namespace | None = None) -> list[int]:
    """The demo on an initialised process group: shard, generate, print; returns this rank's tokens. The model goes
    where the group's collectives run: this rank's GPU under nccl, the CPU under gloo."""
    args = argv if isinstance(argv, argparse.Namespace) else _args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.model is not None:
        model = GPT2LMHeadModel.from_pretrained(args.model)
    else:
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(GPT2Config()).eval()
        with torch.no_grad():  # GPT-2's embedding scale (nn.Embedding's N(0, 1) makes every logit row one spike)
            model.transformer.wte.weight.mul_(0.02)
            model.transformer.wpe.weight.mul_(0.02)
    total = sum(p.numel() for p in model.parameters())
    model = parallelize(model.to(device), init_device_mesh(device.type, (world,)))
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    tokenizer = _tokenizer(args.model)
    ids = tokenizer.encode(args.prompt).ids if tokenizer else args.ids
    generator = torch.Generator(device=device).manual_seed(args.seed) if args.temperature > 0 else None
    out = model.generate(
        torch.tensor([ids], device=device), max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_k=args.top_k, generator=generator,
    )[0].tolist()
    heads = model.transformer.h[0].attn.num_heads
    text = f"\n  {tokenizer.decode(out)!r}" if tokenizer else ""
    print(f"rank {rank}/{world} on {device}: {held:,} of {total:,} parameters held here; "
          f"{heads} of {model.config.n_head} heads per layer; tokens {out}{text}", flush=True)
    every = [None] * world
    dist.all_gather_object(every, out)
    if rank == 0:
        print("every rank generated the same tokens" if all(t == out for t in every) else f"ranks disagree: {every}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    """``torchrun`` entry: the arguments checked, then join the process group (nccl on GPUs, gloo on CPUs), run, leave."""
    args = _args(argv)
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:  # env:// rendezvous would fail deep inside torch.distributed, naming one variable
        print(f"headwise.parallel.demo: error: run it under torchrun (torchrun --nproc-per-node 2 -m headwise.parallel.demo), "
              f"which sets {', '.join(missing)}", file=sys.stderr)
        raise SystemExit(2)
    device = _device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
