"""Serving many requests: continuous batching through a paged cache vs one at a time vs a static padded batch.

A fixed seeded mix of requests (default 32, prompts 16..1024 tokens, 16..256 new tokens, greedy,
no EOS so every strategy does the same work) through one model (default GPT-2 small's shapes
with n_positions = 1024 + 256, random weights, fp32; ``--dtype bf16`` for a bf16 model and caches,
``--cache-dtype bf16`` for bf16 caches under the fp32 model (``int8``: 8-bit rows, a ``KVCache``'s and the pools', under either), ``--int8 bf16`` or ``--int8 int8`` for its
projections and LM head as ``Int8Linear``s with those activations, ``headwise.quantize.int8_weights``)
three ways, timed interleaved in one run:

- ``paged``: ``headwise.models.Batcher``, a ``PagedKVCache`` per layer, requests leaving and
  joining at every step, the tokens of a step packed in one row;
- ``one_at_a_time``: each request alone through ``model.generate`` (a ``KVCache`` of its own length, the
  decode steps as ``generate`` runs them: unchecked, decided once, each layer's step one C++ op where built);
- ``static``: all requests in one left-padded batch through ``model.generate``, a ``KVCache`` of
  B × (longest prompt + most new tokens), run until the longest request is done.

Both baselines compute the LM head at the last position only (as the batcher does), so the
comparison is of the batching, not of wasted logits. Memory is the keys/values slots held:
the batcher's peak blocks × block_size (and its ratio to the tokens held at that step) against
B × max_len for the static batch. ``decode_*`` time one decode step of one sequence of the
whole model at one context through a ``KVCache``, through a ``PagedKVCache`` whose blocks are
consecutive (read as a view) and through one whose blocks are scattered (gathered: a copy of
every key and value read).

Beside them, the floor under any strategy: the mix's projections and LM head alone (``gemm_floor``): every
token the blocks take (each prompt token, each new token but the last a request makes) through every block's
projections and every new token through the LM head, at the rate the model's own projection calls reach on
calls of 2048 rows (their most efficient here). One at a time over that floor is the most any way of batching the
mix could gain on this machine; paged over it, how far the batcher is from it. And the caches' reads
(``read_floor``): the keys and values every decode token's attention reads (the same bytes in any strategy) at the rate a
``sum`` over 512 MiB reads: the projections and the reads in turn bound what batching can gain where the arithmetic and
the memory traffic do not overlap (each decode step runs its projections, then its attention over the caches).

``paged`` runs with the ``Batcher``'s default ``max_step_tokens`` (2048: a prompt joins whole),
again with ``chunk`` (256): a long prompt fed in chunks over several steps, and ``compiled``: the
default with ``Batcher(compile=True)`` (where headwise's C++ decode kernel is not built, the running
requests' next tokens in one compiled call per layer over their blocks, compiled before the timed runs
on a small mix of the same model; where it is built, the same C++ call as the default). For each, the
longest step and the running requests' time between two of their tokens (median and worst)
say how long a joining prompt stalls the others.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import _argtypes
from ..cache import PagedKVCache
from ..config import GPT2Config
from ..linear import linear, project
from ..models.batching import Batcher
from ..models.gpt2 import GPT2LMHeadModel
from ..quantize import ACTIVATIONS, Int8Linear, int8_weights
from .cases import DTYPES
from .host import ReadProbe
from .models import kv_bytes, matrix_elements
from .timing import interleaved

#: ``--cache-dtype``: what the caches hold under a float32 model.
CACHE_DTYPES = {"bf16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class StepTimes:
    """One paged run's steps: ``max_step_tokens``, the longest step and the gaps between a request's tokens (ms)."""

    max_step_tokens: int
    longest_step_ms: float
    gap_median_ms: float
    gap_max_ms: float

    @classmethod
    def of(cls, max_step_tokens: int, steps: list[tuple[float, float, list[int]]]) -> StepTimes:
        """From (start, end, request ids given a token) per step."""
        last: dict[int, float] = {}
        gaps = []
        for _, end, emitted in steps:
            gaps += [end - last[r] for r in emitted if r in last]
            last.update(dict.fromkeys(emitted, end))
        gaps = sorted(gaps) or [0.0]  # (no request had two tokens)
        return cls(max_step_tokens, 1000 * max(b - a for a, b, _ in steps), 1000 * gaps[len(gaps) // 2], 1000 * gaps[-1])


@dataclass(frozen=True)
class GemmFloor:
    """The mix's projections and LM head alone (``gemm_floor``): ``seconds`` at ``gflops`` GFLOP/s (calls of ``rows`` rows)."""

    seconds: float
    gflops: float
    rows: int


@dataclass(frozen=True)
class ReadFloor:
    """The caches' reads alone (``cache_reads``): ``bytes`` every decode token's attention reads from the keys and values,
    ``seconds`` at the ``gbps`` a ``sum`` over 512 MiB reads here."""

    bytes: int
    gbps: float

    @property
    def seconds(self) -> float:
        return self.bytes / self.gbps / 1e9


@dataclass(frozen=True)
class ServingReport:
    """One interleaved run of the three strategies over one mix, and the decode-step timings.

    Times are seconds for the whole mix (median over ``repeats``); tokens are the new tokens.
    """

    requests: int
    prompt_tokens: int
    new_tokens: int
    block_size: int
    paged_s: float
    chunked_s: float  # the same paged run with max_step_tokens = chunk
    compiled_s: float  # the same paged run with Batcher(compile=True)
    chunked: StepTimes
    unchunked: StepTimes  # and with the default max_step_tokens
    one_at_a_time_s: float
    static_s: float
    paged_peak_slots: int  # blocks x block_size held at the fullest step
    paged_peak_tokens: int  # tokens held at that step
    paged_worst_ratio: float  # max over steps of slots held / tokens held
    static_slots: int  # B x max_len
    same_tokens: int  # requests whose paged tokens equal their one-at-a-time tokens
    compiled_same_tokens: int  # requests whose Batcher(compile=True) tokens equal their one-at-a-time tokens
    gemm_floor: GemmFloor
    read_floor: ReadFloor
    decode_context: int
    decode_static_ms: float
    decode_paged_view_ms: float
    decode_paged_gather_ms: float
    repeats: int
    threads: int
    dtype: str = "float32"  # the model's
    cache_dtype: str = "float32"  # its caches'
    int8: str | None = None  # int8 weights' activations ("bf16" or "int8"); None: the model's weights

    def tokens_per_s(self, seconds: float) -> float:
        return self.new_tokens / seconds


def request_mix(requests: int = 32, *, prompt: tuple[int, int] = (16, 1024), new: tuple[int, int] = (16, 256), vocab: int = 50257, seed: int = 0) -> tuple[list[Tensor], list[int]]:
    """A seeded mix: ``requests`` prompts of uniform lengths in ``prompt`` and new-token counts uniform in ``new`` (inclusive)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt[0], prompt[1] + 1, (requests,), generator=g).tolist()
    news = torch.randint(new[0], new[1] + 1, (requests,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths], news


@torch.no_grad()
def static_generate(model: GPT2LMHeadModel, prompts: Sequence[Tensor], max_new: Sequence[int], cache_dtype: torch.dtype | None = None) -> list[list[int]]:
    """Greedy generation of all prompts as one left-padded batch by ``model.generate``, through ``KVCache``s of
    ``cache_dtype`` (B = 1: one request alone, as a user runs it), each row cut to its own number of new tokens."""
    b, t = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, t, dtype=torch.long)
    real = torch.zeros(b, t, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :], real[i, t - len(p) :] = p, True
    mask = None if bool(real.all()) else real
    out = model.generate(ids, max_new_tokens=max(max_new), attention_mask=mask, cache_dtype=cache_dtype)  # (B, T + steps)
    return [row[t : t + n] for row, n in zip(out.tolist(), max_new, strict=True)]


def paged_generate(model: GPT2LMHeadModel, prompts: Sequence[Tensor], max_new: Sequence[int], block_size: int, watch: list | None = None,
                   *, max_step_tokens: int = 2048, steps: list | None = None, cache_dtype: torch.dtype | None = None,
                   compile: bool = False) -> list[list[int]]:
    """Greedy generation through the ``Batcher``; ``watch`` collects (slots held, tokens held) after every step,
    ``steps`` (start, end, request ids given a token) of every step."""
    num_blocks = sum(math.ceil((len(p) + n - 1) / block_size) for p, n in zip(prompts, max_new, strict=True))
    batcher = Batcher(model, num_blocks=num_blocks, block_size=block_size, max_step_tokens=max_step_tokens, cache_dtype=cache_dtype,
                      compile=compile)
    for p, n in zip(prompts, max_new, strict=True):
        batcher.submit(p, n)
    out: list[list[int]] = [[] for _ in prompts]
    while batcher.pending:
        start = time.perf_counter()
        emitted = batcher.step()
        if steps is not None:
            steps.append((start, time.perf_counter(), [request for request, _ in emitted]))
        for request, token in emitted:
            out[request].append(token)
        if watch is not None and batcher.tokens_held:
            watch.append((batcher.blocks_held * block_size, batcher.tokens_held))
    return out


def projections(model: GPT2LMHeadModel) -> list[nn.Module]:
    """The blocks' projections (``nn.Linear``s, or ``Int8Linear``s after ``int8_weights``), in order."""
    return [m for block in model.blocks for m in block.modules() if isinstance(m, (nn.Linear, Int8Linear))]


def flops_per_token(model: GPT2LMHeadModel) -> tuple[int, int]:
    """(through the blocks' projections, through the LM head): 2 x the weights' elements each (the head: what
    ``matrix_elements`` counts beyond the blocks' projections)."""
    blocks = sum(m.weight.numel() for m in projections(model))
    return 2 * blocks, 2 * (matrix_elements(model) - blocks)


@torch.no_grad()
def gemm_floor(model: GPT2LMHeadModel, block_tokens: int, head_tokens: int, *, rows: int = 2048, repeats: int = 3) -> GemmFloor:
    """Seconds the model's projections take for ``block_tokens`` tokens through every block and ``head_tokens`` through
    the LM head, timed as the forward calls them (``linear.project``; the head tied or its own) on calls of ``rows``
    rows, scaled to the tokens (median of ``repeats`` after one call to warm up). Only the GEMMs: no attention, norm
    or activation; a floor under any strategy that computes every token's projections."""
    weight = model.embed_tokens.weight
    layers = projections(model)
    inputs = {m.in_features: torch.randn(1, rows, m.in_features, dtype=weight.dtype, device=weight.device) for m in layers}

    def blocks() -> None:
        for m in layers:
            project(m, inputs[m.in_features])  # (1, rows, out)

    def head() -> None:
        x = inputs[weight.shape[1]]  # (1, rows, C)
        linear(x, weight) if model.lm_head is None else project(model.lm_head, x)  # (1, rows, vocab)

    times = interleaved({"blocks": blocks, "head": head}, repeats=repeats, warmup=1)
    per_row = {name: statistics.median(ts) / rows for name, ts in times.items()}
    seconds = block_tokens * per_row["blocks"] + head_tokens * per_row["head"]
    block_flops, head_flops = flops_per_token(model)
    return GemmFloor(seconds, (block_tokens * block_flops + head_tokens * head_flops) / seconds / 1e9, rows)


def cache_reads(prompts: Sequence[Tensor], max_new: Sequence[int], per_position: int) -> int:
    """Bytes every decode token of the mix reads from the caches: a request of L prompt tokens feeds its new tokens
    but the last at positions L .. L + n - 2, each attending over its position + 1 keys and values, ``per_position`` bytes
    each; the same in any strategy (each sequence's cache is its own)."""
    return per_position * sum((n - 1) * len(p) + n * (n - 1) // 2 for p, n in zip(prompts, max_new, strict=True))


def read_floor(model: GPT2LMHeadModel, prompts: Sequence[Tensor], max_new: Sequence[int], cache_dtype: torch.dtype | None = None, *,
               repeats: int = 3) -> ReadFloor:
    """``cache_reads`` of the mix at the rate a ``sum`` over 512 MiB reads (median of ``repeats``): with ``gemm_floor``, the
    time of a strategy that does the arithmetic and the reads in turn, at their best rates."""
    probe = ReadProbe()
    times = interleaved({"sum": probe}, repeats=repeats, warmup=1)["sum"]
    return ReadFloor(cache_reads(prompts, max_new, kv_bytes(model, cache_dtype)), probe.gbps(statistics.median(times)))


def _decode_steps(model: GPT2LMHeadModel, context: int, block_size: int, cache_dtype: torch.dtype | None) -> dict[str, Callable[[], None]]:
    """One decode step of one sequence at ``context`` tokens, three ways; each call advances one token."""
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.config.vocab_size, (1, context - 1), generator=g)
    steps: dict[str, Callable[[], None]] = {}
    static = model.new_caches(1, context + 64, cache_dtype)
    model(prompt, cache=static, logits_to_keep=1)
    steps["static"] = lambda: model(prompt[:, -1:], positions=torch.tensor([[len(static[0])]]), cache=static, logits_to_keep=1)
    for name, scatter in (("paged_view", False), ("paged_gather", True)):
        blocks = 2 * math.ceil((context + 64) / block_size) + 2
        caches = model.new_paged_caches(blocks, block_size, cache_dtype)
        for cache in caches:
            cache.add(0)
            if scatter:  # a second sequence takes every other block: sequence 0's blocks are not consecutive
                cache.add(1)
        ids = [0, 1] if scatter else [0]
        for start in range(0, context - 1, block_size):  # prefill a block at a time (sequence 1 taking the block after each)
            n = min(block_size, context - 1 - start)
            chunk, where = prompt[:, start : start + n], list(range(start, start + n))
            row, pos = (torch.cat([chunk, chunk], 1), [where + where]) if scatter else (chunk, [where])  # (1, T), (1, T)
            model(row, positions=torch.tensor(pos), cache=[c.batch(ids, [n] * len(ids)) for c in caches], logits_to_keep=torch.tensor([n - 1]))

        def step(caches: list[PagedKVCache] = caches) -> None:
            length = caches[0].length(0)
            model(prompt[:, -1:], positions=torch.tensor([[length]]), cache=[c.batch([0], [1]) for c in caches], logits_to_keep=torch.tensor([0]))

        steps[name] = step
    return steps


@torch.no_grad()
def serving(
    *,
    requests: int = 32,
    prompt: tuple[int, int] = (16, 1024),
    new: tuple[int, int] = (16, 256),
    config: GPT2Config | None = None,
    block_size: int = 16,
    chunk: int = 256,
    repeats: int = 1,
    decode_context: int = 512,
    decode_repeats: int = 20,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    int8: str | None = None,
) -> ServingReport:
    """Run the mix through the three strategies (interleaved) and time the decode steps; see the module docstring.

    ``dtype``: the model's and so its caches' (float32 by default; bfloat16 halves the keys and values read);
    ``cache_dtype``: the caches' where not the model's (bfloat16 under a float32 model); ``int8``: "bf16" or "int8",
    the projections and the LM head as ``Int8Linear``s with those activations (``int8_weights``); None: as they are.
    """
    config = config or GPT2Config(n_positions=prompt[1] + new[1])  # GPT-2 small, with room for the longest request
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(dtype).eval()
    if int8 is not None:
        int8_weights(model, activations=int8)
    prompts, max_new = request_mix(requests, prompt=prompt, new=new, vocab=config.vocab_size, seed=seed)
    results: dict[str, list[list[int]]] = {}
    watch: list[tuple[int, int]] = []
    steps: dict[str, list] = {"unchunked": [], "chunked": []}

    def run_paged() -> None:
        watch.clear()
        steps["unchunked"].clear()
        results["paged"] = paged_generate(model, prompts, max_new, block_size, watch, steps=steps["unchunked"], cache_dtype=cache_dtype)

    def run_chunked() -> None:
        steps["chunked"].clear()
        results["chunked"] = paged_generate(model, prompts, max_new, block_size, max_step_tokens=chunk, steps=steps["chunked"], cache_dtype=cache_dtype)

    def run_compiled() -> None:
        results["compiled"] = paged_generate(model, prompts, max_new, block_size, cache_dtype=cache_dtype, compile=True)

    def run_alone() -> None:
        results["alone"] = [static_generate(model, [p], [n], cache_dtype)[0] for p, n in zip(prompts, max_new, strict=True)]

    def run_static() -> None:
        results["static"] = static_generate(model, prompts, max_new, cache_dtype)

    small, small_new = request_mix(4, prompt=(16, 64), new=(4, 8), vocab=config.vocab_size, seed=seed + 1)
    paged_generate(model, small[:1], small_new[:1], block_size, cache_dtype=cache_dtype, compile=True)  # compiles: one sequence,
    paged_generate(model, small, small_new, block_size, cache_dtype=cache_dtype, compile=True)  # then several
    strategies = {"paged": run_paged, "chunked": run_chunked, "compiled": run_compiled, "one_at_a_time": run_alone, "static": run_static}
    times = interleaved(strategies, repeats=repeats)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    peak_slots, peak_tokens = max(watch)
    decode = interleaved(_decode_steps(model, decode_context, block_size, cache_dtype), repeats=decode_repeats, warmup=2)
    ms = {name: 1000 * statistics.median(ts) for name, ts in decode.items()}
    prompt_tokens = sum(len(p) for p in prompts)
    floor = gemm_floor(model, prompt_tokens + sum(max_new) - requests, sum(max_new))  # (a request's last token is never fed back)
    reads = read_floor(model, prompts, max_new, cache_dtype)
    return ServingReport(
        requests=requests, prompt_tokens=prompt_tokens, new_tokens=sum(max_new), block_size=block_size,
        paged_s=median["paged"], chunked_s=median["chunked"], compiled_s=median["compiled"], one_at_a_time_s=median["one_at_a_time"], static_s=median["static"],
        chunked=StepTimes.of(chunk, steps["chunked"]), unchunked=StepTimes.of(2048, steps["unchunked"]),
        paged_peak_slots=peak_slots, paged_peak_tokens=peak_tokens, paged_worst_ratio=max(s / t for s, t in watch),
        static_slots=requests * (max(len(p) for p in prompts) + max(max_new)),
        same_tokens=sum(a == b == c for a, b, c in zip(results["paged"], results["chunked"], results["alone"], strict=True)),
        compiled_same_tokens=sum(a == b for a, b in zip(results["compiled"], results["alone"], strict=True)), gemm_floor=floor, read_floor=reads,
        decode_context=decode_context, decode_static_ms=ms["static"], decode_paged_view_ms=ms["paged_view"],
        decode_paged_gather_ms=ms["paged_gather"], repeats=repeats, threads=torch.get_num_threads(), dtype=str(dtype).removeprefix("torch."),
        cache_dtype=str(model.cache_dtype(cache_dtype)).removeprefix("torch."), int8=int8,
    )


def markdown(r: ServingReport, machine: str = "") -> str:
    """The report as Markdown tables (the CLI prints this)."""
    lines = [f"Serving {r.requests} requests ({r.prompt_tokens} prompt tokens, {r.new_tokens} new tokens, greedy), "
             f"{r.dtype}" + (f" with {r.cache_dtype} caches" if r.cache_dtype != r.dtype else "")
             + (f", int8 weights with {r.int8} activations" if r.int8 else "") + f", block_size={r.block_size}, {r.threads} threads" + (f"; {machine}" if machine else ""), "",
             "| strategy | seconds | new tokens/s | paged is x faster |", "|---|---:|---:|---:|"]
    strategies = (("continuous batching, paged cache", r.paged_s), (f"the same, prompts in chunks of {r.chunked.max_step_tokens}", r.chunked_s),
                  ("the same, compile=True (compiled one call where the C++ kernel is not built)", r.compiled_s),
                  ("one at a time", r.one_at_a_time_s), ("static padded batch", r.static_s))
    for name, s in strategies:
        lines.append(f"| {name} | {s:.1f} | {r.tokens_per_s(s):.0f} | {s / r.paged_s:.2f} |")
    f = r.gemm_floor
    lines += ["", f"The projections and LM head alone (every token's, at the rate of calls of {f.rows} rows: {f.gflops:.0f} GFLOP/s): "
              f"{f.seconds:.1f} s, a floor under any strategy. One at a time over it: {r.one_at_a_time_s / f.seconds:.2f}x, the most "
              f"any batching of this mix could gain here; paged over it: {r.paged_s / f.seconds:.2f}x."]
    g, both = r.read_floor, f.seconds + r.read_floor.seconds
    lines += ["", f"The caches' reads alone (every decode token's keys and values, {g.bytes / 1e9:.1f} GB, at the {g.gbps:.1f} GB/s a "
              f"`sum` reads here): {g.seconds:.1f} s, the same in any strategy. The projections and the reads in turn: {both:.1f} s; "
              f"one at a time over it: {r.one_at_a_time_s / both:.2f}x, the most batching could gain without overlapping arithmetic "
              f"and memory; paged over it: {r.paged_s / both:.2f}x."]
    lines += ["", "| KV memory (slots per layer) | slots | / tokens held |", "|---|---:|---:|",
              f"| paged, fullest step | {r.paged_peak_slots} | {r.paged_peak_slots / r.paged_peak_tokens:.3f} (worst step {r.paged_worst_ratio:.3f}) |",
              f"| static batch, B x max_len | {r.static_slots} | {r.static_slots / r.paged_peak_tokens:.2f} |",
              "", f"Requests whose paged tokens (chunked or not) equal their one-at-a-time tokens: {r.same_tokens} of {r.requests}; "
              f"with compile=True: {r.compiled_same_tokens} of {r.requests}.", "",
              "| paged, max_step_tokens | longest step ms | between a request's tokens: median ms | worst ms |", "|---|---:|---:|---:|",
              *(f"| {t.max_step_tokens} | {t.longest_step_ms:.0f} | {t.gap_median_ms:.1f} | {t.gap_max_ms:.0f} |" for t in (r.unchunked, r.chunked)), "",
              f"| decode step, one sequence, context {r.decode_context} | ms | / KVCache |", "|---|---:|---:|"]
    for name, t in (("KVCache", r.decode_static_ms), ("PagedKVCache, consecutive blocks (view)", r.decode_paged_view_ms),
                    ("PagedKVCache, scattered blocks (gather)", r.decode_paged_gather_ms)):
        lines.append(f"| {name} | {t:.2f} | {t / r.decode_static_ms:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.serving``: run the mix and print the tables."""
    from .host import add_busy_flag, busy, loaded, machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.serving", description=__doc__.splitlines()[0])
    positive = _argtypes.integer(1)
    p.add_argument("--requests", type=positive, default=32)
    p.add_argument("--repeats", type=positive, default=1)
    p.add_argument("--chunk", type=positive, default=256, help="max_step_tokens of the chunked paged run")
    p.add_argument("--threads", type=_argtypes.threads, default=None, help="torch threads (default: torch's)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="the model's and its caches' (default fp32)")
    p.add_argument("--cache-dtype", choices=tuple(CACHE_DTYPES), default=None,
                   help="the caches' where not the model's: bf16 under an fp32 model, or int8 (8-bit rows) under an fp32 or bf16 one (default: the model's)")
    p.add_argument("--int8", choices=ACTIVATIONS, default=None, help="int8 weights (int8_weights) with these activations (default: none)")
    add_busy_flag(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with busy(args.busy):
        report, load = loaded(lambda: serving(requests=args.requests, repeats=args.repeats, chunk=args.chunk,
                                                    dtype=DTYPES[args.dtype], cache_dtype=CACHE_DTYPES.get(args.cache_dtype), int8=args.int8))
    print(markdown(report, f"{machine()}; load average {load}" + (f" with {args.busy} busy processes beside it" if args.busy else "")))
    print(f"\n({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
