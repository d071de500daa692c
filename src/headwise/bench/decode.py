"""Per-token decode latency of a GPT-2 attention stack: KV cache vs recompute vs transformers.

The stack is ``n_layer`` attention layers with residual connections, ``x = x + attn(x)``
(no layer norms or MLPs: they cost the same for everyone and would only hide the attention).
One decode step at context ``n`` is the call that takes the cache from ``n - 1`` tokens to
``n``. It is timed up to three ways, interleaved (one of each per repeat, in rotating order, so
that noise from other jobs on the machine hits all of them alike), and the median is kept:

- ``cached``: headwise ``GPT2MultiHeadAttention`` with a ``KVCache`` per layer, one new token;
- ``uncached``: the same layers recomputing attention over the whole prefix (``n`` tokens),
  which is what decoding without a cache costs;
- ``hf_cached``: transformers' ``GPT2Attention`` (its SDPA attention) with a ``DynamicCache``,
  the same weights, one new token.

After every timed step both caches are cropped back to ``n - 1`` tokens, so each repeat
measures the same step. ``max_abs_diff`` compares the headwise and transformers outputs of
the step: the two stacks compute the same function, so it is ~1e-6.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import _checks
from .._optional import require
from ..cache import KVCache
from ..config import GPT2Config
from ..fused import GPT2MultiHeadAttention
from .host import Load, loaded
from .models import cache_keyword
from .timing import interleaved, keeping


@dataclass(frozen=True)
class DecodeRow:
    """Median wall-clock milliseconds for one decode step of the whole stack at one context.

    Attributes:
        width: the stack's C (n_embd; a preset's width).
        batch: B, the sequences a step decodes.
        context: tokens the new token attends over (cached prefix + itself).
        cached_ms: headwise with a ``KVCache``.
        uncached_ms: headwise recomputing the whole prefix; None when not measured.
        hf_cached_ms: transformers' GPT2Attention with a ``DynamicCache``; None when not measured.
        max_abs_diff: largest |headwise - transformers| over the step's outputs; None when not measured.
        repeats: timed steps behind each median.
        threads: ``torch.get_num_threads()`` during the run.
        load: the load average before and after the interleaved rounds.
    """

    width: int
    batch: int
    context: int
    cached_ms: float
    uncached_ms: float | None
    hf_cached_ms: float | None
    max_abs_diff: float | None
    repeats: int
    threads: int
    load: Load | None = None

    @property
    def cache_speedup(self) -> float | None:
        """How many times faster the cached step is than recomputing the prefix."""
        return None if self.uncached_ms is None else self.uncached_ms / self.cached_ms

    @property
    def hf_speedup(self) -> float | None:
        """How many times faster headwise's cached step is than transformers' (>1 = headwise faster)."""
        return None if self.hf_cached_ms is None else self.hf_cached_ms / self.cached_ms


def _hf_stack(layers: nn.ModuleList, config: GPT2Config) -> nn.ModuleList:
    """transformers GPT2Attention layers holding the same weights (their Conv1D stores (in, out))."""
    require("transformers", "hf", "timing transformers' GPT-2 attention beside headwise's (hf=True)")
    from transformers import GPT2Config as HFConfig
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

    hf_config = HFConfig(n_embd=config.n_embd, n_head=config.n_head, n_layer=len(layers), n_positions=config.n_positions)
    hf_config._attn_implementation = "sdpa"
    hf_layers = nn.ModuleList(GPT2Attention(hf_config, layer_idx=i) for i in range(len(layers)))
    with torch.no_grad():
        for ours, theirs in zip(layers, hf_layers, strict=True):
            theirs.c_attn.weight.copy_(ours.c_attn.weight.T)  # (C, 3C) <- (3C, C)
            theirs.c_attn.bias.copy_(ours.c_attn.bias)
            theirs.c_proj.weight.copy_(ours.c_proj.weight.T)  # (C, C)
            theirs.c_proj.bias.copy_(ours.c_proj.bias)
    return hf_layers.eval()


def _steps(layers: nn.ModuleList, hf_layers: nn.ModuleList | None, prompt: Tensor, token: Tensor, uncached: bool) -> dict[str, Callable[[], Tensor]]:
    """Prefill the caches with ``prompt`` (B, n-1, C); return one decode step per implementation."""
    B, P, _ = prompt.shape
    first = layers[0]
    caches = [KVCache(B, first.num_kv_heads, P + 1, first.head_dim, dtype=prompt.dtype) for _ in layers]
    x = prompt
    for layer, cache in zip(layers, caches, strict=True):
        x = x + layer(x, cache=cache)  # (B, P, C)

    def cached() -> Tensor:
        y = token
        for layer, cache in zip(layers, caches, strict=True):
            y = y + layer(y, cache=cache)  # (B, 1, C)
        for cache in caches:
            cache.crop(P)
        return y

    steps = {"cached": cached}
    if uncached:
        full = torch.cat([prompt, token], dim=1)  # (B, P + 1, C)

        def recompute() -> Tensor:
            y = full
            for layer in layers:
                y = y + layer(y)  # (B, P + 1, C)
            return y[:, -1:]  # (B, 1, C)

        steps["uncached"] = recompute
    if hf_layers is not None:
        from transformers import DynamicCache

        hf_cache = DynamicCache(config=hf_layers[0].config)
        cached = {cache_keyword(hf_layers[0].forward): hf_cache}
        x = prompt
        for layer in hf_layers:
            x = x + layer(x, **cached)[0]  # (B, P, C)

        def hf_cached() -> Tensor:
            y = token
            for layer in hf_layers:
                y = y + layer(y, **cached)[0]  # (B, 1, C)
            hf_cache.crop(-1)  # transformers 5: a negative count of tokens to drop
            return y

        steps["hf_cached"] = hf_cached
    return steps


def decode_latency(
    contexts: tuple[int, ...] = (128, 512, 1024),
    *,
    n_layer: int = 12,
    n_embd: int = 768,
    n_head: int = 12,
    batch_size: int = 1,
    repeats: int = 20,
    warmup: int = 3,
    uncached: bool = True,
    hf: bool = True,
    backend: str = "auto",
    seed: int = 0,
) -> list[DecodeRow]:
    """Time one decode step of an ``n_layer`` attention stack at each context length.

    Runs in float32 on the CPU under ``torch.inference_mode``, with the thread count torch
    already has (set it in the caller, e.g. ``torch.set_num_threads``). Nothing is printed.
    Most of the time goes to recomputing the prefix (``uncached=False`` skips that).

    Args:
        contexts: tokens the new token attends over, each in [2, 1024] (GPT-2's n_positions).
        n_layer, n_embd, n_head: the stack (default GPT-2 small: 12 layers, C=768, H=12).
        batch_size: B.
        repeats: timed steps per context and implementation (the median is reported).
        warmup: untimed steps first.
        uncached: also time headwise recomputing the whole prefix.
        hf: also time transformers' GPT2Attention with its DynamicCache (imports transformers).
        backend: headwise's backend, "auto", "math" or "sdpa".
        seed: for the weights and inputs.

    Returns:
        One ``DecodeRow`` per context, in the order given.

    Example:
        >>> row, = decode_latency((64,), n_layer=2, repeats=3, hf=False)
        >>> row.context, row.cache_speedup is not None
        (64, True)
    """
    config = GPT2Config(n_embd=n_embd, n_head=n_head, n_layer=n_layer, attn_pdrop=0.0, resid_pdrop=0.0)
    for n in contexts:
        _checks.integer(f"contexts (in {contexts!r})", n, low=2, high=config.n_positions)
    _checks.integer("repeats", repeats, low=1)
    _checks.integer("warmup", warmup, low=0)
    _checks.integer("batch_size", batch_size, low=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # seeded weights without touching the caller's RNG
        torch.manual_seed(seed)
        layers = nn.ModuleList(GPT2MultiHeadAttention(config, backend=backend) for _ in range(n_layer)).eval()
    hf_layers = _hf_stack(layers, config) if hf else None
    rows = []
    with torch.inference_mode():
        for n in contexts:
            prompt = torch.randn(batch_size, n - 1, n_embd, generator=gen)  # (B, n-1, C)
            token = torch.randn(batch_size, 1, n_embd, generator=gen)  # (B, 1, C)
            steps = _steps(layers, hf_layers, prompt, token, uncached)
            outs: dict[str, Tensor] = {}
            timed = {name: keeping(step, outs, name) for name, step in steps.items()}
            times, load = loaded(lambda timed=timed: interleaved(timed, repeats=repeats, warmup=warmup))
            med = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            diff = float((outs["cached"] - outs["hf_cached"]).abs().max()) if hf else None
            rows.append(DecodeRow(n_embd, batch_size, n, med["cached"], med.get("uncached"), med.get("hf_cached"), diff, repeats, torch.get_num_threads(), load))
    return rows
