"""transformers models on ``attn_implementation="headwise"`` vs its own "sdpa" and "eager".

Three GPT-2-small-wide configs (C = 768, 12 query heads of 64, 4 key/value heads), each a
transformers model of random weights, copied once per attention implementation
(``set_attn_implementation``):

- ``llama``: plain causal attention (the case SDPA serves best);
- ``gemma2``: softcap 50 and sliding-window layers of 512 every other layer (transformers has
  no SDPA path for it: softcap);
- ``gpt_oss``: learned sinks and sliding-window layers of 128 (no SDPA path either: sinks).

B sequences of T tokens (``padded``: row b left-padded by b * T / 2B tokens, as a batch of
prompts of different lengths is), float32, one copy of the base model per implementation (embeddings, layers, final norm: the language
model head is the same matrix product under every attention and is left out), ``forward``
under ``torch.inference_mode``, ``backward`` (forward + backward of the mean square of the
last hidden state) and ``decode`` (``decode_steps`` one-token steps over the cache of the T
tokens' prompt, each row's mask one key longer a step: ms per step; the prompt untimed). Timed
interleaved (``timing.interleaved``; decode: each implementation in turn, the order rotated a
round), medians kept.
``max_abs_diff`` compares headwise's last hidden state with eager's at the real tokens (a padded
query sees no key: eager spreads its weights evenly, headwise gives zeros).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from copy import deepcopy
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _argtypes, _checks
from .._optional import require
from .host import machine
from .timing import interleaved, keeping

IMPLEMENTATIONS = ("headwise", "sdpa", "eager")
MODELS = ("llama", "gemma2", "gpt_oss")
MODES = ("forward", "backward", "decode")
#: GPT-2 small's width and heads, grouped 3 to 1; the depth is the benchmark's ``layers``.
WIDTH = dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, head_dim=64, intermediate_size=2048, vocab_size=32000,
             max_position_embeddings=4096)  # fmt: skip


@dataclass(frozen=True)
class HFTiming:
    """Median milliseconds of one call per attention implementation, for one model and mode.

    Attributes:
        model: "llama", "gemma2" or "gpt_oss".
        mode: "forward", "backward" (forward + backward) or "decode" (ms per one-token step).
        ms: implementation -> median ms; None where transformers refuses that implementation.
        max_abs_diff: largest |headwise - eager| over the last hidden state at the real tokens.
        batch, tokens, layers, repeats, threads: the case and ``torch.get_num_threads()``.
        padded: whether the rows were left-padded (``padding``).
    """

    model: str
    mode: str
    ms: dict[str, float | None]
    max_abs_diff: float
    batch: int
    tokens: int
    layers: int
    repeats: int
    threads: int
    padded: bool = False

    def ratio(self, peer: str) -> float | None:
        """headwise's time over ``peer``'s (< 1 = headwise faster); None where the peer does not run."""
        theirs = self.ms.get(peer)
        return None if theirs is None else self.ms["headwise"] / theirs


def config(model: str, layers: int):
    """The transformers config of ``model`` at GPT-2 small's width, ``layers`` deep."""
    tf = require("transformers", "hf", "the transformers benchmark")
    if model == "llama":
        return tf.LlamaConfig(**WIDTH, num_hidden_layers=layers)
    if model == "gemma2":
        return tf.Gemma2Config(**WIDTH, num_hidden_layers=layers, sliding_window=512, query_pre_attn_scalar=64)
    if model == "gpt_oss":
        return tf.GptOssConfig(**WIDTH, num_hidden_layers=layers, sliding_window=128, num_local_experts=4, num_experts_per_tok=2)
    raise ValueError(f"model must be one of {list(MODELS)}, got {model!r}")


def _copies(model: torch.nn.Module, implementations: Sequence[str]) -> dict[str, torch.nn.Module]:
    """One copy of ``model`` per implementation transformers accepts for it (same weights)."""
    copies = {}
    for implementation in implementations:
        copy = deepcopy(model)
        try:
            copy.set_attn_implementation(implementation)
        except ValueError:  # transformers has no such path for this model (sdpa: softcap, sinks)
            continue
        copies[implementation] = copy
    return copies


def padding(batch: int, tokens: int) -> Tensor:
    """(B, T) long attention mask, 0 = padding: row b's first b * T // 2B tokens (row 0 none, the last about half)."""
    real = torch.ones(batch, tokens, dtype=torch.long)  # (B, T)
    for b in range(batch):
        real[b, : b * tokens // (2 * batch)] = 0
    return real


def _forward(model: torch.nn.Module, ids: Tensor, real: Tensor | None) -> Callable[[], Tensor]:
    def call() -> Tensor:
        with torch.inference_mode():
            return model(input_ids=ids, attention_mask=real, use_cache=False).last_hidden_state  # (B, T, C)

    return call


def _backward(model: torch.nn.Module, ids: Tensor, real: Tensor | None) -> Callable[[], Tensor]:
    def call() -> Tensor:
        model.zero_grad(set_to_none=True)
        hidden = model(input_ids=ids, attention_mask=real, use_cache=False).last_hidden_state  # (B, T, C)
        hidden.square().mean().backward()
        return hidden.detach()

    return call


def _decode(copies: dict[str, torch.nn.Module], ids: Tensor, real: Tensor | None, steps: int, repeats: int,
            warmup: int) -> tuple[dict[str, float], dict[str, Tensor]]:
    """Median ms per one-token step of each copy over its prompt's cache (the prompt ``ids`` (B, T) untimed, the steps'
    tokens the prompt's first ``steps``), and each copy's last step's hidden state (B, 1, C)."""
    names = list(copies)
    times: dict[str, list[float]] = {name: [] for name in names}
    outs: dict[str, Tensor] = {}
    for r in range(warmup + repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            model = copies[name]
            with torch.inference_mode():
                cache = model(input_ids=ids, attention_mask=real, use_cache=True).past_key_values
                mask = real
                start = time.perf_counter()
                for i in range(steps):
                    mask = None if mask is None else torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)  # (B, T + i + 1)
                    out = model(input_ids=ids[:, i : i + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
                    cache = out.past_key_values
                elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed / steps)
            outs[name] = out.last_hidden_state  # (B, 1, C)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}, outs


def hf_latency(
    models: Sequence[str] = MODELS,
    *,
    batch: int = 4,
    tokens: int = 1024,
    layers: int = 2,
    modes: Sequence[str] = ("forward", "backward"),
    repeats: int = 3,
    warmup: int = 1,
    seed: int = 0,
    padded: bool = False,
    decode_steps: int = 16,
) -> list[HFTiming]:
    """Time each model's forward (and forward + backward, and one-token decode steps) under headwise, sdpa and eager.

    Imports transformers (the ``hf`` extra) and registers headwise's attention there. Nothing
    is printed.

    Returns:
        One ``HFTiming`` per (model, mode).
    """
    from ..hf import register

    for name, value, low in (("batch", batch, 1), ("tokens", tokens, 2), ("layers", layers, 1), ("repeats", repeats, 1), ("warmup", warmup, 0),
                             ("decode_steps", decode_steps, 1)):
        _checks.integer(name, value, low=low)
    bad = [m for m in modes if m not in MODES] + [m for m in models if m not in MODELS]
    if bad:
        raise ValueError(f"modes must be among {list(MODES)} and models among {list(MODELS)}, got {bad}")
    if "decode" in modes and decode_steps > tokens:
        raise ValueError(f"decode_steps must be at most tokens ({tokens}: the steps feed the prompt's first tokens), got {decode_steps}")
    tf = require("transformers", "hf", "the transformers benchmark")
    name = register()
    rows = []
    for which in models:
        with torch.random.fork_rng():  # seeded weights without touching the caller's RNG
            torch.manual_seed(seed)
            model = tf.AutoModel.from_config(config(which, layers), attn_implementation="eager", dtype=torch.float32).eval()
        ids = torch.randint(0, WIDTH["vocab_size"], (batch, tokens), generator=torch.Generator().manual_seed(seed))  # (B, T)
        real = padding(batch, tokens) if padded else None  # (B, T) or None
        copies = _copies(model, (name, "sdpa", "eager"))
        for mode in modes:
            ms = {impl: None for impl in IMPLEMENTATIONS}
            if mode == "decode":
                taken, outs = _decode(copies, ids, real, decode_steps, repeats, warmup)
                ms.update({("headwise" if impl == name else impl): t for impl, t in taken.items()})
                tokens_kept = slice(None)  # (B, 1): every row's step token is real
            else:
                step = _forward if mode == "forward" else _backward
                outs = {}
                steps = {impl: keeping(step(copy, ids, real), outs, impl) for impl, copy in copies.items()}
                times = interleaved(steps, repeats=repeats, warmup=warmup)
                ms.update({("headwise" if impl == name else impl): statistics.median(t) * 1e3 for impl, t in times.items()})
                tokens_kept = slice(None) if real is None else real.bool()  # the real tokens' rows
            diff = float((outs[name] - outs["eager"])[tokens_kept].abs().max())
            rows.append(HFTiming(which, mode, ms, diff, batch, tokens, layers, repeats, torch.get_num_threads(), padded))
    return rows


def markdown(rows: Sequence[HFTiming]) -> str:
    """The timings as a Markdown table, the machine named above it."""
    lines = [
        f"transformers models, attention switched (CPU: {machine()}; {rows[0].threads if rows else '?'} threads)",
        "",
        "| model | mode | B | T | padded | layers | headwise ms | sdpa ms | eager ms | headwise / sdpa | headwise / eager | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = [f"{r.ms[i]:.{1 if r.ms[i] < 100 else 0}f}" if r.ms[i] is not None else "n/a" for i in IMPLEMENTATIONS]
        ratios = [f"{x:.2f}x" if x is not None else "n/a" for x in (r.ratio("sdpa"), r.ratio("eager"))]
        lines.append(f"| {r.model} | {r.mode} | {r.batch} | {r.tokens} | {'left' if r.padded else 'no'} | {r.layers} | {' | '.join(ms)} | {' | '.join(ratios)} | {r.max_abs_diff:.1e} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.hf``: print the table."""
    p = argparse.ArgumentParser(prog="python -m headwise.bench.hf", description=__doc__.splitlines()[0])
    positive = _argtypes.integer(1)
    p.add_argument("--models", type=_argtypes.listing(_argtypes.choice(list(MODELS)), "models"), default=list(MODELS),
                   help=f"comma list of {list(MODELS)} (default: all)")
    p.add_argument("--batch", type=positive, default=4)
    p.add_argument("--tokens", type=_argtypes.integer(2), default=1024, help="T (at least 2; default 1024)")
    p.add_argument("--layers", type=positive, default=2)
    p.add_argument("--repeats", type=positive, default=3)
    p.add_argument("--padded", action="store_true", help="left-pad row b by b * T / 2B tokens (a batch of prompts of different lengths)")
    p.add_argument("--modes", type=_argtypes.listing(_argtypes.choice(list(MODES)), "modes"), default=["forward", "backward"],
                   help=f"comma list of {list(MODES)} (default: forward,backward); decode: ms per one-token step over the prompt's cache")
    p.add_argument("--decode-steps", type=positive, default=16, help="decode mode's timed steps a round (default 16)")
    args = p.parse_args(argv)
    if "decode" in args.modes and args.decode_steps > args.tokens:
        p.error(f"--decode-steps must be at most --tokens ({args.tokens}: the steps feed the prompt's first tokens), got {args.decode_steps}")
    rows = hf_latency(args.models, batch=args.batch, tokens=args.tokens, layers=args.layers, repeats=args.repeats, padded=args.padded,
                      modes=tuple(args.modes), decode_steps=args.decode_steps)
    print(markdown(rows))


if __name__ == "__main__":
    main()
