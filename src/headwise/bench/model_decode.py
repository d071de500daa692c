"""Whole-model decode on the CPU: GPT-2 small and a GPT-2-small-sized Llama, headwise vs transformers.

A decode step reads every weight once and the KV cache it attends over: its speed limit is
memory bandwidth. Each row here reports, for one model, dtype, batch B and context:

- ``headwise_ms``: one step as ``generate`` runs it (``step_logits``, unchecked: B new tokens
  through a ``KVCache`` per layer; each repeat appends its token, so the steps see
  ``context - repeats`` .. ``context`` keys, one more each time, as ``generate``'s do), median of
  interleaved repeats; ``checked_ms``: the same step through ``next_logits``, every argument
  checked in every layer (what each step cost before ``generate`` checked once per call);
- ``transformers_ms``: transformers' model on the same weights, the same cache contents (a
  ``DynamicCache``), ``logits_to_keep=1``; for int8 rows, None (transformers has no such CPU path);
- ``read_bytes``: bytes a step reads: every projection and LM-head weight as stored (int8 +
  scales for int8), plus keys and values of every layer at this context and batch;
- ``sum_gbps``: the machine's read bandwidth measured in the same interleaved rounds (a
  512 MiB float32 ``sum``), so that the share is taken under the same load.

The models are built as a user builds them (outside ``torch.inference_mode``: inference-mode
parameters cannot be packed or stacked once, ``headwise.linear``), then timed in inference mode.
The caches are filled with the same random keys and values for both libraries (a step costs
the same whatever they hold), so no prefill is run for a decode row and both libraries' logits
can be compared (``max_abs_diff``). ``prefill`` compares the 480-token prompt pass that
``generate`` makes (last position's logits only, as both libraries' ``generate`` do), and
``generate_speeds`` whole ``generate`` calls.

``python -m headwise.bench.model_decode`` prints the README's tables (``--long`` adds contexts
2048 and 4096, ``--compile`` transformers' StaticCache under ``torch.compile``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import _argtypes, _checks
from ..config import GPT2Config
from ..convert import HF_GPT2_TRANSPOSED, is_legacy_gpt2_buffer, load_checked
from ..models.generate import decode_step
from ..models.gpt2 import GPT2LMHeadModel
from ..models.llama import LlamaForCausalLM
from ..quantize import Int8Linear, int8_weights
from .llama_decode import GPT2_SMALL_LLAMA
from .timing import interleaved

MODELS = ("gpt2", "llama")
#: int8: int8 weights, float32 activations; int8-bf16: int8 weights, bfloat16 activations and KV cache.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32, "int8-bf16": torch.bfloat16}
SUM_BYTES = 512 * 2**20
#: Small sizes for a quick check of the benchmark itself (``tiny=True``): the numbers mean nothing.
TINY = {"gpt2": {"vocab_size": 211, "n_embd": 64, "n_layer": 2, "n_head": 4},
        "llama": {"vocab_size": 211, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2}}


@dataclass(frozen=True)
class DecodeSpeed:
    """One decode step of a whole model; milliseconds are medians of interleaved repeats.

    Attributes:
        model, dtype, batch, context: what was run ("gpt2" / "llama", a key of ``DTYPES``).
        headwise_ms, transformers_ms: one step (transformers: None for int8 weights).
        checked_ms: headwise's step through ``next_logits`` (every layer's checks, every step).
        read_bytes: weights + KV a step reads.
        sum_gbps: the 512 MiB sum's GB/s in the same rounds.
        max_abs_diff: largest |headwise - transformers| over the step's logits (None without transformers).
        compiled_ms: the step as ``generate(..., compile=True)`` runs it (None unless asked for).
        repeats, threads: timed rounds; ``torch.get_num_threads()``.
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


def build(name: str, dtype: str, *, positions: int = 1024, seed: int = 0, hf: bool = True, tiny: bool = False) -> tuple[nn.Module, nn.Module | None]:
    """headwise's model (int8: ``int8_weights`` of the float32 or bfloat16 one) and transformers' with the same weights."""
    _checks.integer("positions", positions, low=2)
    if name not in MODELS or dtype not in DTYPES:
        raise ValueError(f"model must be one of {MODELS} and dtype one of {list(DTYPES)}, got {name!r}, {dtype!r}")
    from dataclasses import replace

    import transformers

    torch.manual_seed(seed)
    sizes = TINY[name] if tiny else {}
    if name == "gpt2":
        hf_config = transformers.GPT2Config(n_positions=positions, **sizes)
        hf_config._attn_implementation = "sdpa"
        theirs = transformers.GPT2LMHeadModel(hf_config).eval()
        with torch.device("meta"):
            ours = GPT2LMHeadModel(GPT2Config(n_positions=positions, **sizes))
        ours = load_checked(ours, theirs.state_dict(), source="transformers' GPT-2", transposed=HF_GPT2_TRANSPOSED,
                            ignore=lambda key: key == "lm_head.weight" or is_legacy_gpt2_buffer(key))
        ours = ours.eval()
    else:
        c = replace(GPT2_SMALL_LLAMA, **sizes)
        hf_config = transformers.LlamaConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.kv_heads, max_position_embeddings=positions,
            rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings,
        )
        hf_config._attn_implementation = "sdpa"
        theirs = transformers.LlamaForCausalLM(hf_config).eval()
        ours = LlamaForCausalLM(replace(c, max_position_embeddings=positions)).eval()
        ours.load_state_dict(theirs.state_dict(), strict=True)
    ours, theirs = ours.to(DTYPES[dtype]), theirs.to(DTYPES[dtype])
    if dtype.startswith("int8"):
        ours = int8_weights(ours)
    return ours, (theirs if hf and not dtype.startswith("int8") else None)


def read_bytes(model: nn.Module, batch: int, context: int) -> int:
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
    caches = model.new_caches(1, 1)
    kv = sum(2 * c.k.shape[1] * c.k.shape[3] for c in caches) * batch * context * caches[0].k.element_size()
    return weights + kv


def _fill(ours: nn.Module, theirs: nn.Module | None, batch: int, past: int, room: int, gen: torch.Generator, copies: int) -> tuple[list, object]:
    """``copies`` sets of headwise caches (room for ``room`` tokens) holding ``past`` random tokens' keys and
    values, and transformers' DynamicCache holding the same."""
    kv = []
    for cache in ours.new_caches(batch, 1):
        _, hkv, _, d = cache.k.shape
        kv.append(tuple(torch.randn(batch, hkv, past, d, generator=gen).to(cache.k.dtype) for _ in range(2)))  # (B, Hkv, past, D) each
    sets = []
    for _ in range(copies):
        caches = ours.new_caches(batch, room)
        for cache, (k, v) in zip(caches, kv, strict=True):
            cache.update(k, v)
        sets.append(caches)
    hf_cache = None
    if theirs is not None:
        from transformers import DynamicCache

        hf_cache = DynamicCache(config=theirs.config)
        for i, (k, v) in enumerate(kv):
            hf_cache.update(k.clone(), v.clone(), i)
    return sets, hf_cache


def _steps(ours: nn.Module, theirs: nn.Module | None, batch: int, context: int, rounds: int, gen: torch.Generator,
           compile: bool = False) -> tuple[dict[str, Callable[[], Tensor]], dict[str, Tensor]]:
    """One decode step of each kind, each on caches of its own, and each kind's logits from one step on the same contents.

    Every call appends its token, as ``generate``'s steps do, so each sees one more key than the
    last (a kernel built for one key count is not reused for the next; the CPU's bfloat16 matmul
    builds one per shape): ``rounds`` calls take the caches from ``context - rounds`` keys to ``context``.
    """
    past = max(2, context - rounds)  # keys the first timed step sees
    (mine, checked_caches, compiled_caches), hf_cache = _fill(ours, theirs, batch, past - 1, past + rounds, gen, copies=3)
    token = torch.randint(0, ours.vocab_size, (batch, 1), generator=gen)  # (B, 1)
    step = decode_step(ours, compile=True) if compile else None  # generate(..., compile=True)'s step
    steps = {
        "headwise": lambda: ours.step_logits(token, None, mine),  # (B, vocab): generate's step
        "checked": lambda: ours.next_logits(token, None, None, checked_caches),  # every argument checked in every layer
        **({"compiled": lambda: step(token, None, compiled_caches)} if compile else {}),
    }
    if theirs is not None:
        steps["transformers"] = lambda: theirs(token, past_key_values=hf_cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # (B, vocab)
    first = {name: run() for name, run in steps.items()}  # one step each on the same contents (and the compile), then back
    for caches in (mine, checked_caches, compiled_caches):
        for cache in caches:
            cache.crop(past - 1)
    if hf_cache is not None:
        hf_cache.crop(-1)  # a negative count of tokens to drop
    return steps, first


def _calls(ours: nn.Module, theirs: nn.Module, ids: Tensor, new_tokens: int, compile: bool, hf_compile: bool) -> dict[str, Callable[[], object]]:
    """The prompt pass (last position's logits) and whole greedy generate calls of each library."""
    prompt = ids.shape[1]
    hf_kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    calls = {
        "headwise prefill": lambda: ours.next_logits(ids, None, None, ours.new_caches(1, prompt + 1)),
        "transformers prefill": lambda: theirs(ids, use_cache=True, logits_to_keep=1).logits[:, -1],
        "headwise generate": lambda: ours.generate(ids, max_new_tokens=new_tokens),
        "transformers generate": lambda: theirs.generate(ids, **hf_kw),
    }
    if compile:
        calls["headwise compile generate"] = lambda: ours.generate(ids, max_new_tokens=new_tokens, compile=True)
    if hf_compile:
        static = copy.deepcopy(theirs)
        static.forward = torch.compile(static.forward, fullgraph=True)
        calls["transformers static+compile generate"] = lambda: static.generate(ids, cache_implementation="static", **hf_kw)
    return calls


def _rel(got: Tensor, want: Tensor) -> float:
    """||got - want|| / ||want|| in float32."""
    return float((got.float() - want.float()).norm() / want.float().norm())


def _medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def decode_speeds(
    models: Sequence[str] = MODELS,
    dtypes: Sequence[str] = tuple(DTYPES),
    shapes: Sequence[tuple[int, int]] = ((1, 512), (8, 512)),
    *,
    repeats: int = 10,
    warmup: int = 2,
    hf: bool = True,
    seed: int = 0,
    tiny: bool = False,
    compile: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[DecodeSpeed]:
    """Time one decode step of each model and dtype at each (batch, context) of ``shapes`` (see the module docstring).

    With ``compile``, also the step ``generate(..., compile=True)`` runs (compiled during the warm-up rounds).

    Imports transformers (unless ``hf=False``). Nothing is printed (``progress`` is told what runs).
    Under ``torch.inference_mode``, with the thread count torch already has.
    """
    _checks.integer("repeats", repeats, low=1)
    _checks.integer("warmup", warmup, low=0)
    positions = max(1024, *(n for _, n in shapes))
    for b, n in shapes:
        _checks.integer(f"a batch size (in shapes {tuple(shapes)!r})", b, low=1)
        _checks.integer(f"a context (in shapes {tuple(shapes)!r})", n, low=2)
    gen = torch.Generator().manual_seed(seed)
    big = torch.ones(SUM_BYTES // 4)  # (128 Mi,) float32: the read-bandwidth probe
    rows = []
    for name in models:
        for dtype in dtypes:
            ours, theirs = build(name, dtype, positions=positions, seed=seed, hf=hf, tiny=tiny)  # as a user builds them
            with torch.inference_mode():
                for batch, context in shapes:
                    if progress:
                        progress(f"{name} {dtype} B={batch} context {context}")
                    steps, outs = _steps(ours, theirs, batch, context, repeats + warmup, gen, compile)
                    med = _medians(interleaved({**steps, "sum": big.sum}, repeats=repeats, warmup=warmup))
                    diff = None if theirs is None else float((outs["headwise"].float() - outs["transformers"].float()).abs().max())
                    if not torch.equal(outs["headwise"], outs["checked"]):
                        raise RuntimeError(f"{name} {dtype}: generate's unchecked step and the checked step gave different logits")
                    if compile and _rel(outs["compiled"], outs["headwise"]) > (1e-4 if dtype == "fp32" else 0.05):  # bf16 rounding differs in fused code
                        raise RuntimeError(f"{name} {dtype}: the compiled step's logits are {_rel(outs['compiled'], outs['headwise']):.2g} from the eager step's")
                    rows.append(DecodeSpeed(name, dtype, batch, context, med["headwise"], med.get("transformers"),
                                            read_bytes(ours, batch, context), SUM_BYTES / med["sum"] / 1e6, diff, repeats,
                                            torch.get_num_threads(), med["checked"], med.get("compiled")))
            del ours, theirs
    return rows


@dataclass(frozen=True)
class Comparison:
    """Median milliseconds of one call, headwise and transformers: ``what`` says which call."""

    what: str
    model: str
    dtype: str
    headwise_ms: float
    transformers_ms: float
    repeats: int
    threads: int

    @property
    def speedup(self) -> float:
        return self.transformers_ms / self.headwise_ms


def prefill_and_generate(
    models: Sequence[str] = MODELS,
    dtypes: Sequence[str] = ("fp32", "bf16"),
    *,
    prompt: int = 480,
    new_tokens: int = 32,
    repeats: int = 3,
    compile: bool = False,
    hf_compile: bool | None = None,
    seed: int = 0,
    tiny: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[Comparison]:
    """The prompt pass ``generate`` makes (last position's logits) and whole greedy ``generate`` calls, B = 1.

    ``generate``'s row reports milliseconds per new token: (generate - prefill) / new_tokens, both
    medians. With ``compile``, headwise's ``generate(..., compile=True)`` beside transformers with a
    StaticCache under torch.compile (``cache_implementation="static"``; both compiled on first use,
    minutes on 2 cores).
    """
    _checks.integer("prompt", prompt, low=1)
    _checks.integer("new_tokens", new_tokens, low=1)
    _checks.integer("repeats", repeats, low=1)
    rows = []
    ids = torch.randint(0, 211 if tiny else 32000, (1, prompt), generator=torch.Generator().manual_seed(seed))  # (1, T)
    for name in models:
        for dtype in dtypes:
            if progress:
                progress(f"{name} {dtype}: prefill and generate")
            ours, theirs = build(name, dtype, positions=max(1024, prompt + new_tokens), seed=seed, tiny=tiny)  # as a user builds them
            with torch.inference_mode():
                med = _medians(interleaved(_calls(ours, theirs, ids, new_tokens, compile, compile if hf_compile is None else hf_compile),
                                           repeats=repeats, warmup=1))
                threads = torch.get_num_threads()
                rows.append(Comparison("prefill", name, dtype, med["headwise prefill"], med["transformers prefill"], repeats, threads))
                prefill = {"headwise": med["headwise prefill"], "transformers": med["transformers prefill"]}
                per_token = {k: (med[f"{k} generate"] - prefill[k.split()[0]]) / new_tokens
                             for k in ("headwise", "transformers", *(["headwise compile"] if compile else []),
                                       *(["transformers static+compile"] if "transformers static+compile generate" in med else []))}
                rows.append(Comparison("generate ms/token", name, dtype, per_token["headwise"], per_token["transformers"], repeats, threads))
                if compile:
                    rows.append(Comparison("generate ms/token, compile=True", name, dtype, per_token["headwise compile"],
                                           per_token["transformers"], repeats, threads))
                if "transformers static+compile" in per_token:
                    rows.append(Comparison("generate ms/token, both compiled (static cache)", name, dtype,
                                           per_token["headwise compile" if compile else "headwise"], per_token["transformers static+compile"], repeats, threads))
                del ours, theirs
    return rows


def markdown(speeds: Sequence[DecodeSpeed], comparisons: Sequence[Comparison]) -> str:
    """The README's tables."""
    compiled = any(r.compiled_ms is not None for r in speeds)
    extra = " compiled ms | compiled share |" if compiled else ""
    out = ["| model | dtype | B | context | headwise ms | checked ms | tok/s | MB read | GB/s | share of sum GB/s | sum GB/s |" + extra
           + " transformers ms | speed-up |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * (1 + compiled)]
    for r in speeds:
        hf = "—" if r.transformers_ms is None else f"{r.transformers_ms:.1f}"
        up = "—" if r.speedup is None else f"{r.speedup:.2f}x"
        checked = "—" if r.checked_ms is None else f"{r.checked_ms:.1f}"
        cells = "" if not compiled else (" — | — |" if r.compiled_ms is None else f" {r.compiled_ms:.1f} | {r.compiled_share:.2f} |")
        out.append(f"| {r.model} | {r.dtype} | {r.batch} | {r.context} | {r.headwise_ms:.1f} | {checked} | {r.tokens_per_s:.0f} | {r.read_bytes / 1e6:.0f} | "
                   f"{r.gbps:.1f} | {r.share:.2f} | {r.sum_gbps:.1f} |{cells} {hf} | {up} |")
    if comparisons:
        out += ["", "| call | model | dtype | headwise ms | transformers ms | speed-up |", "|---|---|---|---:|---:|---:|"]
        out += [f"| {c.what} | {c.model} | {c.dtype} | {c.headwise_ms:.1f} | {c.transformers_ms:.1f} | {c.speedup:.2f}x |" for c in comparisons]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m headwise.bench.model_decode``: print the tables (progress on stderr)."""
    import sys

    from .harness import machine

    p = argparse.ArgumentParser(prog="python -m headwise.bench.model_decode", description=__doc__.splitlines()[0])
    positive = _argtypes.integer(1)
    p.add_argument("--models", type=_argtypes.listing(_argtypes.choice(MODELS), "models"), default=list(MODELS), help="comma list (default gpt2,llama)")
    p.add_argument("--dtypes", type=_argtypes.listing(_argtypes.choice(list(DTYPES)), "dtypes"), default=list(DTYPES),
                   help="comma list (default fp32,bf16,int8,int8-bf16)")
    p.add_argument("--batches", type=_argtypes.listing(positive, "positive ints"), default=[1, 8], help="comma list (default 1,8)")
    p.add_argument("--contexts", type=_argtypes.listing(positive, "positive ints"), default=[128, 512, 1024], help="comma list (default 128,512,1024)")
    p.add_argument("--long", action="store_true", help="also contexts 2048 and 4096 (B=1)")
    p.add_argument("--repeats", type=positive, default=10)
    p.add_argument("--no-generate", action="store_true", help="skip the prefill and generate comparisons")
    p.add_argument("--compile", action="store_true",
                   help="also generate(compile=True)'s step, and both libraries' compiled generate (transformers: StaticCache; slow to compile)")
    p.add_argument("--no-hf-compile", action="store_true", help="with --compile: skip transformers' StaticCache + torch.compile generate")
    p.add_argument("--threads", type=positive, default=None, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models, dtypes, batches, contexts = args.models, args.dtypes, args.batches, args.contexts
    say = lambda what: print(what, file=sys.stderr, flush=True)  # noqa: E731
    shapes = [(1, c) for c in contexts] + [(b, 512) for b in batches if b != 1]  # B = 1 at every context, larger batches at 512
    shapes += [(1, 2048), (1, 4096)] if args.long else []
    speeds = decode_speeds(models, dtypes, shapes, repeats=args.repeats, compile=args.compile, progress=say)
    comparisons = [] if args.no_generate else prefill_and_generate(models, [d for d in dtypes if not d.startswith("int8")], compile=args.compile,
                                                                   hf_compile=args.compile and not args.no_hf_compile, progress=say)
    print(f"{machine()}\n")
    print(markdown(speeds, comparisons))


if __name__ == "__main__":
    main()
