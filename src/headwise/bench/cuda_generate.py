"""Whole-model generation on a GPU: headwise beside transformers, one checkpoint, one prompt.

``python -m headwise.bench.cuda_generate`` loads the decode benchmark's random checkpoints
(``bench.models``: GPT-2 small and a Llama of the same size) onto ``cuda`` at fp32 and bf16, each
library's own copy as a user loads it (``headwise.models.load``; transformers'
``AutoModelForCausalLM`` with SDPA attention), and times greedy generation from the same token ids
at each batch size, the ways interleaved in rounds: prefill ms (a one-token ``generate``) and decode
ms per step (a ``--new-tokens`` ``generate`` less the prefill, over the steps after the first),
with the device synchronized before and after each call (a token's arrival on the host is not when
the device computed it). On the CPU both times come from one call, as in ``bench.model_decode``:
the first token's arrival and the call's end (two calls' difference can be below zero for small
models on a busy host). ``agree`` counts the leading new tokens
every row shares with headwise's. On ``cuda`` headwise's ``generate(cuda_graph=True)`` runs too (its
capture counted in each call's decode time); ``--compile`` adds headwise's ``generate(compile=True)``.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter

import torch
from torch import Tensor

from .. import _argtypes, _checks
from .engines import Runner, _Streamer, _torch_runner
from .generation import _agree
from .host import gpu, machine
from .models import MODELS, checkpoint, headwise_model, transformers_model

PRECISIONS = ("fp32", "bf16")


def _runners(directory: Path, precision: str, compiled: bool, device: str) -> tuple[dict[str, Runner], int]:
    """Each way's ``run(ids (B, T), new) -> Generated`` on ``device`` (its tokens and, on the CPU, its times), and the vocabulary's size."""
    ours = headwise_model(directory, precision).to(device)
    theirs = transformers_model(directory, precision).to(device)
    runners = {
        "headwise": lambda ids, new, clock: ours.generate(ids, max_new_tokens=new, on_token=clock.first),
        "transformers": lambda ids, new, clock: theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                             do_sample=False, pad_token_id=0, streamer=_Streamer(clock)),
    }
    if torch.device(device).type == "cuda":
        runners["headwise cuda_graph"] = lambda ids, new, clock: ours.generate(ids, max_new_tokens=new, cuda_graph=True,
                                                                              on_token=clock.first)
    if compiled:
        runners["headwise compiled"] = lambda ids, new, clock: ours.generate(ids, max_new_tokens=new, compile=True, on_token=clock.first)
    return {name: _torch_runner(run) for name, run in runners.items()}, ours.vocab_size  # (B, new) tokens, no prompt


def _timed(run: Runner, ids: Tensor, new: int) -> tuple[float, float, Tensor]:
    """(prefill ms, whole generate ms, (B, new) tokens): on a GPU two calls (one token, then ``new``), the device
    idle before and after each; on the CPU one call, the first token's arrival and its end."""
    if not ids.is_cuda:
        out = run(ids, new)
        return 1e3 * out.first_s, 1e3 * out.total_s, out.tokens
    torch.cuda.synchronize()
    start = perf_counter()
    run(ids, 1)
    torch.cuda.synchronize()
    middle = perf_counter()
    out = run(ids, new).tokens
    torch.cuda.synchronize()
    return 1e3 * (middle - start), 1e3 * (perf_counter() - middle), out


def generate_speeds(models: Sequence[str] = MODELS, precisions: Sequence[str] = PRECISIONS, batches: Sequence[int] = (1, 8), *,
                    prompt: int = 512, new_tokens: int = 64, rounds: int = 5, compiled: bool = False, device: str = "cuda",
                    root: Path | None = None, tiny: bool = False, init_std: float = 0.02) -> list[dict]:
    """One row per model, precision, batch and way: prefill ms, decode ms per step, tokens/s, agreement with headwise.

    ``device="cpu"`` with ``tiny=True`` (two-layer models) is for tests: the CPU's own table is
    ``bench.model_decode``'s. Checkpoints (weights drawn with ``init_std``) are written under ``root``
    once (``bench.models.default_root()``).
    """
    for name, value, low in (("prompt", prompt, 1), ("new_tokens", new_tokens, 2), ("rounds", rounds, 1)):
        _checks.integer(name, value, low=low)
    for b in batches:
        _checks.integer(f"a batch size (in {tuple(batches)!r})", b, low=1)
    unknown = [p for p in precisions if p not in PRECISIONS] + [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"models must be among {list(MODELS)} and precisions among {list(PRECISIONS)}, got {unknown}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' needs a GPU that torch can see; torch.cuda.is_available() is False here")
    rows = []
    for model in models:
        directory = checkpoint(model, root, tiny=tiny, init_std=init_std, positions=prompt + new_tokens)
        for precision in precisions:
            runners, vocab = _runners(directory, precision, compiled, device)
            for batch in batches:
                ids = torch.randint(0, vocab, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device)  # (B, T)
                times: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
                outs: dict[str, Tensor] = {}
                for _ in range(rounds + 1):  # the first round warms up (kernels chosen, compiled)
                    for name, run in runners.items():
                        prefill, whole, outs[name] = _timed(run, ids, new_tokens)
                        times[name].append((prefill, whole))
                for name, pairs in times.items():
                    prefill = statistics.median(p for p, _ in pairs[1:])
                    step = statistics.median(w - p for p, w in pairs[1:]) / (new_tokens - 1)
                    agree = _agree(outs[name], outs["headwise"]) if name != "headwise" else None
                    rows.append({"model": model, "precision": precision, "batch": batch, "way": name, "prefill_ms": prefill,
                                 "step_ms": step, "tokens_per_s": 1e3 * batch / step, "agree": agree})
            del runners
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def markdown(rows: Sequence[dict]) -> str:
    """The rows as a table, with each way's decode speed over transformers' in the same case."""
    base = {(r["model"], r["precision"], r["batch"]): r["step_ms"] for r in rows if r["way"] == "transformers"}
    lines = ["| model | precision | B | way | prefill ms | decode ms/step | tokens/s | vs transformers | agree |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        speed = base[(r["model"], r["precision"], r["batch"])] / r["step_ms"]
        agree = "" if r["agree"] is None else str(r["agree"])
        lines.append(f"| {r['model']} | {r['precision']} | {r['batch']} | {r['way']} | {r['prefill_ms']:.1f} | {r['step_ms']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {speed:.2f}x | {agree} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    positive = _argtypes.integer(1)
    p = argparse.ArgumentParser(prog="python -m headwise.bench.cuda_generate", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=_argtypes.listing(_argtypes.choice(MODELS), "models"), default=list(MODELS), help="comma list (default gpt2,llama)")
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(PRECISIONS), "dtypes"), default=list(PRECISIONS), help="comma list (default fp32,bf16)")
    p.add_argument("--batches", type=_argtypes.listing(positive, "positive ints"), default=[1, 8], help="comma list (default 1,8)")
    p.add_argument("--prompt", type=positive, default=512, help="prompt tokens (default 512)")
    p.add_argument("--new-tokens", type=_argtypes.integer(2), default=64, help="greedy tokens (default 64)")
    p.add_argument("--rounds", type=positive, default=5, help="timed rounds after one warm-up round (default 5)")
    p.add_argument("--compile", action="store_true", help="also headwise's generate(compile=True)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a GPU that torch can see; torch.cuda.is_available() is False here")
    rows = generate_speeds(args.models, args.dtypes, args.batches, prompt=args.prompt, new_tokens=args.new_tokens, rounds=args.rounds,
                           compiled=args.compile)
    print(f"Machine: {machine()}; {gpu()}\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
