"""A Llama-style model of GPT-2-small size on headwise vs transformers: one decode step, and the prefill.

Both models hold the same weights (transformers' ``LlamaForCausalLM`` gets headwise's state
dict: the key names are the same). Float32 on the CPU, under ``torch.inference_mode``, with
the thread count torch already has. Timed interleaved (one of each per repeat, in rotating
order, so noise from other jobs hits both alike), medians kept:

- ``decode``: the step that takes the cache from ``context - 1`` tokens to ``context`` and
  returns the new token's logits: headwise with its ``KVCache`` per layer
  (``LlamaForCausalLM.next_logits``), transformers with its ``DynamicCache``
  (``logits_to_keep=1``, SDPA attention). Both caches are cropped back after every step;
- ``prefill``: the whole prompt of ``context`` tokens without a cache, logits for every
  position: headwise's ``forward`` vs transformers' with ``attn_implementation="sdpa"``.

``max_abs_diff`` compares the two models' logits of each measured call.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import _argtypes, _checks
from ..models.llama import LlamaForCausalLM
from ..models.llama_config import LlamaConfig
from .timing import interleaved, keeping

#: GPT-2 small's width and depth, Llama's parts: 4 KV heads (GQA 3), SwiGLU of 8/3 C, Llama 2's vocabulary.
GPT2_SMALL_LLAMA = LlamaConfig(
    vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5,
)


@dataclass(frozen=True)
class LlamaTiming:
    """Median wall-clock milliseconds of one call, headwise and transformers, and how far their logits differ.

    Attributes:
        what: "decode" (one cached step at ``context``) or "prefill" (``context`` tokens, no cache).
        context: tokens the step attends over / the prompt length.
        headwise_ms, transformers_ms: medians over ``repeats`` calls.
        max_abs_diff: largest |headwise - transformers| over the logits.
        repeats, threads: timed calls behind each median; ``torch.get_num_threads()``.
    """

    what: str
    context: int
    headwise_ms: float
    transformers_ms: float
    max_abs_diff: float
    repeats: int
    threads: int

    @property
    def speedup(self) -> float:
        """transformers' time over headwise's (> 1 = headwise faster)."""
        return self.transformers_ms / self.headwise_ms


def _models(config: LlamaConfig, seed: int) -> tuple[LlamaForCausalLM, torch.nn.Module]:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM as HFModel

    with torch.random.fork_rng():  # seeded weights without touching the caller's RNG
        torch.manual_seed(seed)
        ours = LlamaForCausalLM(config).eval()
        for p in ours.parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=0.02)
    hf_config = HFConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
    )
    hf_config._attn_implementation = "sdpa"
    theirs = HFModel(hf_config).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def _timed(calls: dict[str, Callable[[], Tensor]], repeats: int, warmup: int) -> tuple[dict[str, float], dict[str, Tensor]]:
    """Median milliseconds of each call, timed interleaved (``timing.interleaved``), and each one's last output."""
    outs: dict[str, Tensor] = {}
    times = interleaved({name: keeping(call, outs, name) for name, call in calls.items()}, repeats=repeats, warmup=warmup)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}, outs


def llama_latency(
    context: int = 1024,
    *,
    config: LlamaConfig = GPT2_SMALL_LLAMA,
    decode_repeats: int = 20,
    prefill_repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> list[LlamaTiming]:
    """Time a decode step at ``context`` and a prefill of ``context`` tokens, headwise vs transformers.

    Imports transformers. Nothing is printed. The default model (12 layers, C=768, 12 query
    heads, 4 KV heads) takes about a minute on 2 cores at context 1024.

    Returns:
        ``[decode, prefill]`` timings (a repeats count of 0 skips that one).
    """
    _checks.integer("context", context, low=2, high=config.max_position_embeddings)
    for name, value in [("decode_repeats", decode_repeats), ("prefill_repeats", prefill_repeats), ("warmup", warmup)]:
        _checks.integer(name, value, low=0)
    ours, theirs = _models(config, seed)
    from transformers import DynamicCache

    ids = torch.randint(0, config.vocab_size, (1, context), generator=torch.Generator().manual_seed(seed))  # (1, n)
    rows = []
    with torch.inference_mode():
        if decode_repeats:
            caches = ours.new_caches(1, context)
            ours.next_logits(ids[:, :-1], None, None, caches)
            hf_cache = DynamicCache(config=theirs.config)
            theirs(ids[:, :-1], past_key_values=hf_cache, use_cache=True, logits_to_keep=1)
            token, position = ids[:, -1:], torch.tensor([[context - 1]])  # (1, 1) each

            def headwise_step() -> Tensor:
                logits = ours.next_logits(token, None, None, caches)  # (1, vocab)
                for cache in caches:
                    cache.crop(context - 1)
                return logits

            def transformers_step() -> Tensor:
                logits = theirs(token, past_key_values=hf_cache, position_ids=position, use_cache=True, logits_to_keep=1).logits[:, -1]
                hf_cache.crop(-1)  # transformers 5: a negative count of tokens to drop
                return logits

            med, outs = _timed({"headwise": headwise_step, "transformers": transformers_step}, decode_repeats, warmup)
            diff = float((outs["headwise"] - outs["transformers"]).abs().max())
            rows.append(LlamaTiming("decode", context, med["headwise"], med["transformers"], diff, decode_repeats, torch.get_num_threads()))
        if prefill_repeats:
            calls = {"headwise": lambda: ours(ids), "transformers": lambda: theirs(ids, use_cache=False).logits}
            med, outs = _timed(calls, prefill_repeats, warmup)
            diff = float((outs["headwise"] - outs["transformers"]).abs().max())
            rows.append(LlamaTiming("prefill", context, med["headwise"], med["transformers"], diff, prefill_repeats, torch.get_num_threads()))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.llama_decode``: print the two timings as a Markdown table."""
    p = argparse.ArgumentParser(prog="python -m headwise.bench.llama_decode", description=__doc__.splitlines()[0])
    positive = _argtypes.integer(1)
    p.add_argument("--context", type=positive, default=1024)
    p.add_argument("--decode-repeats", type=positive, default=20)
    p.add_argument("--prefill-repeats", type=positive, default=5)
    p.add_argument("--threads", type=positive, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = llama_latency(args.context, decode_repeats=args.decode_repeats, prefill_repeats=args.prefill_repeats)
    print("| step | context | headwise ms | transformers ms | speedup | max abs diff | threads |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.what} | {r.context} | {r.headwise_ms:.2f} | {r.transformers_ms:.2f} | {r.speedup:.2f}x | {r.max_abs_diff:.1e} | {r.threads} |")


if __name__ == "__main__":
    main()
