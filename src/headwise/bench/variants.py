"""The attention variants against their alternatives, timed interleaved in one run.

- packed: one row of N documents (``documents=``) against the same documents run one after
  another through SDPA, and against the dense way (a (T, T) bool block-diagonal causal mask
  into SDPA); time and peak memory (each way in a fresh subprocess on the CPU);
- softcap, sinks, ALiBi: headwise with the term against plain causal headwise (the ratio is
  the term's cost), and against the eager functions transformers runs for them (Gemma 2's
  and gpt-oss's ``eager_attention_forward``), forward and forward+backward. For softcap, the
  ways tried beside the one kept: the blocked math with ``torch.tanh`` differentiated by
  autograd (every block's weights kept for the backward), and (``--flex``, which compiles
  and needs a C++ compiler) torch's ``flex_attention`` with a softcap ``score_mod``;
- a decode step's softcap, sinks, window and ALiBi (one query over a cache of S keys, ``decode_terms``): headwise's way
  (the plan's: the C++ decode kernel where built) against the way its rules take without that kernel, plain causal
  headwise and transformers' eager functions, float32 and bfloat16, each way called ``calls`` times a timing.

``python -m headwise.bench.variants`` or ``headwise bench --variants`` prints the tables.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _argtypes
from ..backends import math as math_backend
from ..backends import plan
from ..backends.spec import Spec
from ..functional import attention
from ..masks import documents_from_cu_seqlens
from ..scores import alibi_slopes
from .memory import _reset_peak, _status_mib
from .timing import interleaved

PACKED_WAYS = ("headwise documents=", "one after another", "dense (T, T) mask")
#: Ways without a backward here: flex_attention has none on the CPU (torch 2.13).
FORWARD_ONLY = ("softcap: flex_attention compiled",)


@dataclass
class VariantRow:
    """One way of computing one case: median ms, peak MiB (packed only), and its ratio to the row's baseline."""

    case: str
    way: str
    mode: str
    ms: float | None = None
    peak_mib: float | None = None
    vs_baseline: float | None = None
    note: str = ""


def _packed_inputs(docs: int, doc_len: int, heads: int, head_dim: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    T = docs * doc_len
    q, k, v = (torch.randn(1, heads, T, head_dim, generator=g) for _ in range(3))  # (1, H, T, D) x3
    cu = torch.arange(docs + 1) * doc_len  # (N + 1,)
    return q, k, v, cu


def packed_call(way: str, q: Tensor, k: Tensor, v: Tensor, cu: Tensor) -> Callable[[], Tensor]:
    """A forward of ``way`` over the packed row: (1, H, T, D) -> (1, H, T, D)."""
    if way == PACKED_WAYS[0]:
        docs = documents_from_cu_seqlens(cu)  # (1, T)
        return lambda: attention(q, k, v, causal=True, documents=docs)
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    if way == PACKED_WAYS[1]:
        return lambda: torch.cat(
            [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True) for a, b in bounds], dim=2
        )
    if way == PACKED_WAYS[2]:
        ids = documents_from_cu_seqlens(cu)[0]  # (T,)
        mask = (ids[:, None] == ids[None, :]) & torch.ones(len(ids), len(ids), dtype=torch.bool).tril()  # (T, T)
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    raise ValueError(f"way must be one of {PACKED_WAYS}, got {way!r}")


def _peak_child(spec: dict) -> dict:
    """In a fresh process: build the inputs (and the dense mask), then one forward; its peak RSS beyond what came before, MiB."""
    q, k, v, cu = _packed_inputs(spec["docs"], spec["doc_len"], spec["heads"], spec["head_dim"])
    call = packed_call(spec["way"], q, k, v, cu)
    gc.collect()
    if not _reset_peak():
        return {"peak_mib": None}
    before = _status_mib("VmRSS") or 0.0
    with torch.no_grad():
        call()
    return {"peak_mib": (_status_mib("VmHWM") or 0.0) - before}


def _peak_mib(spec: dict) -> float | None:
    proc = subprocess.run([sys.executable, "-m", "headwise.bench.variants", "--_peak", json.dumps(spec)], capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"]
    except (IndexError, KeyError, json.JSONDecodeError):
        return None


def packed(docs: int = 16, doc_len: int = 512, heads: int = 8, head_dim: int = 64, *, repeats: int = 5, warmup: int = 1) -> list[VariantRow]:
    """B = 1, ``docs`` causal documents of ``doc_len`` tokens in one row, fp32 forward: every way, its time and peak memory."""
    q, k, v, cu = _packed_inputs(docs, doc_len, heads, head_dim)
    steps = {way: packed_call(way, q, k, v, cu) for way in PACKED_WAYS}
    with torch.no_grad():
        want = steps[PACKED_WAYS[1]]()
        for way, step in steps.items():
            err = (step() - want).abs().max().item()
            if err > 1e-4:
                raise RuntimeError(f"{way} differs from the documents run one by one by {err:.3g}")
        times = interleaved(steps, repeats=repeats, warmup=warmup)
    case = f"packed {docs}x{doc_len} H={heads} D={head_dim} fp32"
    rows = []
    for way in PACKED_WAYS:
        spec = {"way": way, "docs": docs, "doc_len": doc_len, "heads": heads, "head_dim": head_dim}
        rows.append(VariantRow(case, way, "forward", ms=1e3 * statistics.median(times[way]), peak_mib=_peak_mib(spec)))
    base = next(r for r in rows if r.way == PACKED_WAYS[1])
    for r in rows:
        r.vs_baseline = r.ms / base.ms
    return rows


# ----------------------------------------------------------------------------- softcap, sinks, ALiBi


class _Module(torch.nn.Module):
    """What transformers' eager functions read from their attention module."""

    def __init__(self, heads: int, head_dim: int, sinks: Tensor) -> None:
        super().__init__()
        self.head_dim, self.num_key_value_groups, self.training = head_dim, 1, False
        self.sinks = sinks


def _transformers_eager() -> dict[str, Callable] | str:
    try:
        from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2
        from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss
    except ImportError as e:
        return f"transformers not importable: {e}"
    return {"gemma2": gemma2, "gpt_oss": gpt_oss}


def _flex_softcap(tokens: int, softcap: float) -> Callable[..., Tensor]:
    """torch.compile(flex_attention) with a softcap ``score_mod`` and a causal block mask (compiled at the first call)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    blocks = create_block_mask(lambda b, h, i, j: i >= j, None, None, tokens, tokens, device="cpu")
    compiled = torch.compile(flex_attention)
    return lambda q, k, v: compiled(q, k, v, score_mod=lambda s, b, h, i, j: softcap * torch.tanh(s / softcap), block_mask=blocks)


def terms(batch: int = 4, tokens: int = 1024, heads: int = 12, head_dim: int = 64, *, softcap: float = 50.0,
          modes: tuple[str, ...] = ("forward", "backward"), repeats: int = 5, warmup: int = 1, flex: bool = False) -> list[VariantRow]:
    """Each term's cost over plain causal headwise, and transformers' eager way beside it (B, T, GPT-2-small heads, fp32).

    ``flex`` adds compiled ``flex_attention`` with softcap, forward only (its compile runs in the
    warmup round; it has no backward on the CPU).
    """
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, generator=g) for _ in range(3))  # (B, H, T, D) x3
    sinks = torch.randn(heads, generator=g)  # (H,)
    slopes = alibi_slopes(heads)  # (H,)
    module = _Module(heads, head_dim, sinks)
    scale = head_dim**-0.5
    min_mask = torch.zeros(tokens, tokens).masked_fill(~torch.ones(tokens, tokens, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    min_mask = min_mask[None, None]  # (1, 1, T, T): transformers' additive causal mask
    hf = _transformers_eager()
    ways: dict[str, Callable[..., Tensor]] = {
        "headwise causal": lambda q, k, v: attention(q, k, v, causal=True),
        "headwise softcap": lambda q, k, v: attention(q, k, v, causal=True, softcap=softcap),
        "headwise sinks": lambda q, k, v: attention(q, k, v, causal=True, sinks=sinks),
        "headwise ALiBi": lambda q, k, v: attention(q, k, v, causal=True, alibi_slopes=slopes),
        "softcap: tanh, autograd over blocks": lambda q, k, v: math_backend.run_chunked(
            q, k, v, Spec(T=tokens, S=tokens, causal=True, softcap=softcap, scale=scale), block_elements=plan.BLOCK_ELEMENTS
        ),
    }
    if flex:
        ways["softcap: flex_attention compiled"] = _flex_softcap(tokens, softcap)
    if isinstance(hf, dict):
        ways["transformers Gemma 2 eager (softcap)"] = lambda q, k, v: hf["gemma2"](module, q, k, v, min_mask, scaling=scale, softcap=softcap)[0]
        ways["transformers gpt-oss eager (sinks)"] = lambda q, k, v: hf["gpt_oss"](module, q, k, v, min_mask, scaling=scale)[0]
    case = f"B={batch} T={tokens} H={heads} D={head_dim} fp32"
    rows: list[VariantRow] = []
    for mode in modes:
        steps = {name: _step(fn, q, k, v, mode) for name, fn in ways.items() if mode == "forward" or name not in FORWARD_ONLY}
        times = interleaved(steps, repeats=repeats, warmup=warmup)
        base = statistics.median(times["headwise causal"])
        for name in steps:
            ms = statistics.median(times[name])
            rows.append(VariantRow(case, name, mode, ms=1e3 * ms, vs_baseline=ms / base))
    if isinstance(hf, str):
        rows.append(VariantRow(case, "transformers eager", "-", note=hf))
    return rows


def without_decode_kernel(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """The runner ``plan.RULES`` gives a call when the C++ decode kernel's rule is left out (what runs where it is not
    built): (B, H, 1, D) x (B, Hkv, S, D) x2 -> (B, H, 1, D)."""
    call = plan.Call(q, k, v, spec, "auto")
    rule = next(r for r in plan.RULES if r.runner != plan.DECODE_KERNEL and "auto" in r.serves and r.when(call))
    return rule.build(call)(q, k, v, spec)


def decode_terms(batch: int = 1, context: int = 1024, heads: int = 12, kv_heads: int = 4, head_dim: int = 64, *,
                 dtype: torch.dtype = torch.float32, softcap: float = 50.0, window: int = 128, calls: int = 50, repeats: int = 9,
                 warmup: int = 1) -> list[VariantRow]:
    """A decode step's terms: one query a row over ``context`` cached keys (B, Hkv, S, D), plain causal headwise the
    baseline; each term through ``attention`` (the plan's way), through the rules without the C++ decode kernel, and
    through transformers' eager function for it where importable. ms per call (the median of ``repeats`` timings of
    ``calls`` calls each)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 1, head_dim, generator=g).to(dtype)  # (B, H, 1, D)
    k, v = (torch.randn(batch, kv_heads, context, head_dim, generator=g).to(dtype) for _ in range(2))  # (B, Hkv, S, D) x2
    sinks = torch.randn(heads, generator=g)  # (H,) float32
    scale = head_dim**-0.5
    slopes = alibi_slopes(heads)  # (H,)
    terms_of = {"softcap": {"softcap": softcap}, "sinks": {"sinks": sinks}, f"window {window}": {"window": window},
                "ALiBi": {"alibi_slopes": slopes}}
    ways: dict[str, Callable[[], Tensor]] = {"headwise causal": lambda: attention(q, k, v, causal=True)}
    for name, kw in terms_of.items():
        spec = Spec(T=1, S=context, causal=True, scale=scale, **{n: t for n, t in kw.items() if n != "alibi_slopes"},
                    alibi=kw["alibi_slopes"].view(1, -1) if "alibi_slopes" in kw else None)
        ways[f"headwise {name}"] = lambda kw=kw: attention(q, k, v, causal=True, **kw)
        ways[f"headwise {name}, rules without the decode kernel"] = lambda spec=spec: without_decode_kernel(q, k, v, spec)
    hf = _transformers_eager()
    if isinstance(hf, dict):
        module = _Module(heads, head_dim, sinks.to(dtype))
        module.num_key_value_groups = heads // kv_heads
        ways["transformers Gemma 2 eager (softcap)"] = lambda: hf["gemma2"](module, q, k, v, None, scaling=scale, softcap=softcap)[0]
        ways["transformers gpt-oss eager (sinks)"] = lambda: hf["gpt_oss"](module, q, k, v, None, scaling=scale)[0]

    def repeated(fn: Callable[[], Tensor]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                for _ in range(calls):
                    fn()
        return run

    times = interleaved({name: repeated(fn) for name, fn in ways.items()}, repeats=repeats, warmup=warmup)
    case = f"decode B={batch} S={context} H={heads} Hkv={kv_heads} D={head_dim} {str(dtype).removeprefix('torch.')}"
    base = statistics.median(times["headwise causal"])
    rows = [VariantRow(case, name, "forward", ms=1e3 * statistics.median(ts) / calls, vs_baseline=statistics.median(ts) / base)
            for name, ts in times.items()]
    if isinstance(hf, str):
        rows.append(VariantRow(case, "transformers eager", "-", note=hf))
    return rows


def _step(fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, mode: str) -> Callable[[], None]:
    if mode == "forward":
        def forward() -> None:
            with torch.no_grad():
                fn(q, k, v)
        return forward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def backward() -> None:
        out = fn(*leaves)
        out.backward(torch.ones_like(out))
        for t in leaves:
            t.grad = None
    return backward


def markdown(rows: list[VariantRow]) -> str:
    """The rows as one Markdown table, one line per way, forward and forward+backward side by side.

    Ratios are against the case's baseline (the documents one after another, or plain causal).
    """
    lines = ["| case | way | forward ms | x baseline | fwd+bwd ms | x baseline | peak MiB |", "|---|---|---|---|---|---|---|"]
    ways: dict[tuple[str, str], dict[str, VariantRow]] = {}
    for r in rows:
        ways.setdefault((r.case, r.way), {})[r.mode] = r
    last_case = None
    for (case, way), modes in ways.items():
        cells = []
        for mode in ("forward", "backward"):
            r = modes.get(mode)
            cells += ["" if r is None or r.ms is None else f"{r.ms:.{3 if r.ms < 1 else 1 if r.ms < 10 else 0}f}",
                      "" if r is None or r.vs_baseline is None else f"{r.vs_baseline:.2f}x"]
        peak = next((r.peak_mib for r in modes.values() if r.peak_mib is not None and not math.isnan(r.peak_mib)), None)
        note = next((r.note for r in modes.values() if r.note), "")
        label = f"{way} ({note})" if note else way
        lines.append(f"| {case if case != last_case else ''} | {label} | {' | '.join(cells)} | {'' if peak is None else f'{peak:.0f}'} |")
        last_case = case
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m headwise.bench.variants [--repeats N] [--only packed|terms|decode]``: print the tables."""
    import argparse

    from .host import machine

    p = argparse.ArgumentParser(prog="headwise bench --variants", description="packed documents, softcap, sinks, ALiBi: headwise against the other ways")
    p.add_argument("--repeats", type=_argtypes.integer(1), default=5)
    p.add_argument("--warmup", type=_argtypes.integer(0), default=1)
    p.add_argument("--only", choices=("packed", "terms", "decode"), default=None)
    p.add_argument("--flex", action="store_true", help="add compiled flex_attention with softcap (needs a C++ compiler; compiles ~1 min)")
    p.add_argument("--_peak", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._peak:
        print(json.dumps(_peak_child(json.loads(args._peak))))
        return
    rows = []
    if args.only in (None, "packed"):
        rows += packed(repeats=args.repeats, warmup=args.warmup)
    if args.only in (None, "terms"):
        rows += terms(repeats=args.repeats, warmup=max(1, args.warmup) if args.flex else args.warmup, flex=args.flex)
    if args.only in (None, "decode"):
        for dtype in (torch.float32, torch.bfloat16):
            rows += decode_terms(dtype=dtype, repeats=args.repeats, warmup=args.warmup)
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} (1 min)\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
