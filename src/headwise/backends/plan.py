"""How one attention call runs, and why: one ordered table of rules, read by ``attention`` and ``headwise.plan``.

Each rule: a predicate over the call, the runner it builds, the backend whose way it is, the
backends it serves, and why. The first rule that matches and serves the asked backend runs the
call ("auto" is served by every rule). A rule whose runner is ``backend`` is the first match
under ``backend`` whenever it is under "auto": ``attention(..., backend=plan.backend)`` runs
the same runner, bit for bit. Runners take the sizes below as arguments (measured: docs/performance).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from .._checks import compiling, has_values, transformed
from ..machine import cpu, mkl_avx512_on
from ..observe import observing
from . import decode_kernel, packed, paged, prefill_kernel, sdpa, softcap
from . import math as math_runner
from .blocks import rows_per_block
from .spec import Spec

#: Query rows per row of a decode step, the calls the decode rules take: a bfloat16 call on the CPU
#: (torch's fused CPU kernel against two matmuls, one query over 128-2048 keys: bench.decode_attention)
#: and any call traced by torch.compile on the CPU (bench.compiled_attention); more rows not measured.
DECODE_QUERIES = 1
#: Query rows per key head (G * T) up to which half matmuls on the CPU run in float32: decode
#: steps of G = 1 and 3 timed both ways (bench.decode_attention); larger G * T not measured.
FLOAT32_ROWS = 8
#: Keys or values (B * Hkv * keys * D) converted to float32 at a time on that path: a memory
#: bound for the copy (4 MiB), not a tuned speed.
FLOAT32_KEY_ELEMENTS = 1 << 20
#: Score elements (B * H * rows * keys) one block of queries holds: the memory bound of every
#: blocked runner (16 MiB of float32), not a tuned speed.
BLOCK_ELEMENTS = 1 << 22
#: The fewest queries a kernel call of a blocked causal prompt takes; a longer prompt takes
#: ``ceil(T / CAUSAL_CALLS)`` a call (``causal_rows``). Measured: docs/performance/index.md.
CAUSAL_BLOCK = 64
#: The most kernel calls a blocked causal prompt makes: each call waits for its slowest thread, so
#: a core taken by another process delays every call; few calls keep most of the blocks' saving
#: (docs/performance/layers.md, a causal prompt under contention).
CAUSAL_CALLS = 4
#: Causal prompts up to this long run as blocks; longer ones as one call, whose masked work is then
#: a smaller share of the kernel's key blocks (docs/performance/index.md).
CAUSAL_BLOCKS_UP_TO = 512
#: The fewest and the most queries a call of a windowed prompt's blocks takes (``window_rows``: W / 4 between them):
#: each call computes its (rows, W + rows) scores, so fewer rows waste less on keys before a query's window and more
#: rows make fewer, larger calls. Timed at 4096 tokens: 64 rows the fastest for W = 256, 256 for W = 1024 and 3000
#: (docs/performance/layers.md, sliding windows).
WINDOW_BLOCK, WINDOW_BLOCK_MOST = 64, 256
#: Documents with fewer keys than this are stacked with others of their length into one call,
#: where a call's overhead would outweigh its work; not tuned (bench.variants times packed rows).
SHORT_DOCUMENT = 128

#: The runner name of a decode step's attention in C++ on the CPU (``decode_kernel``), eager or compiled.
DECODE_KERNEL = "C++ decode kernel, each key head's queries in one pass"
#: The runner name of a prompt's attention in C++ on the CPU (``prefill_kernel``).
PREFILL_KERNEL = "C++ prefill kernel, blocks of 64 queries over blocks of 64 keys"

Runner = Callable[[Tensor, Tensor, Tensor, Spec], Tensor]


@dataclass(slots=True)
class Call:
    """What a rule reads: the runner's operands, the call's terms, the backend asked for, an observer."""

    q: Tensor  # (B, H, T, D)
    k: Tensor  # (B, Hkv, S, D): shape, dtype and autograd only; S is spec.S
    v: Tensor  # (B, Hkv, S, Dv)
    spec: Spec
    backend: str  # "auto", "math" or "sdpa"
    observed: bool = False
    document_runs: list | None = field(default=None)  # per row, its documents' key ranges (read once, by the rule that splits)


@dataclass(frozen=True, slots=True)
class Plan:
    """How a call runs: ``backend`` (what ``attention(..., backend=)`` takes to run the same), ``runner``
    (which kernel, blocks or split), ``reason`` (why, one sentence); ``str(plan)`` on one line."""

    backend: str
    runner: str
    reason: str
    run: Runner = field(repr=False, compare=False)

    def __str__(self) -> str:
        return f"{self.runner} (backend={self.backend!r}): {self.reason}"


@dataclass(frozen=True, slots=True)
class Rule:
    runner: str  # the name shown ({rows} filled in: the ``rows`` its runner, a partial, takes a call)
    backend: str  # whose way the runner is: "math" or "sdpa"
    serves: frozenset[str]  # the backends asked for that may take this rule
    when: Callable[[Call], bool]
    build: Callable[[Call], Runner]
    why: str


def _grad(c: Call) -> bool:
    """Whether autograd records this call: a backward to keep (the runners that give none are ruled out)."""
    return torch.is_grad_enabled() and (c.q.requires_grad or c.k.requires_grad or c.v.requires_grad)


def _trained_bias(c: Call) -> bool:
    """An ALiBi slope or float mask that wants a gradient (the fused kernels and the capped runner give none)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (c.spec.alibi, c.spec.mask))


def _bf16_decode(c: Call) -> bool:
    return c.q.dtype == torch.bfloat16 and c.q.device.type == "cpu" and c.spec.T == DECODE_QUERIES


def _kernel_decode(c: Call) -> bool:
    """A bfloat16 decode step on the CPU with nothing the fused kernel does not compute (softcap, ALiBi,
    sinks, documents, dropout, Dv != D) and something to compute."""
    s = c.spec
    return (
        _bf16_decode(c) and c.q.shape[0] > 0 and s.S > 0 and c.q.shape[-1] == c.v.shape[-1]
        and s.documents is None and not s.changes_scores and s.sinks is None and s.dropout_p == 0.0
    )


def _grouped_decode(c: Call) -> bool:
    """``_kernel_decode`` whose G >= 2 query heads per key head see every key, no mask."""
    s = c.spec
    return (
        _kernel_decode(c) and c.q.shape[1] >= 2 * c.k.shape[1]
        and s.window is None and s.mask is None and s.attention_mask is None
    )


_MKL_AVX512 = mkl_avx512_on(cpu(), torch.backends.mkl.is_available())  # read once: a compiled graph reads no /proc


def mkl_avx512() -> bool:
    """``headwise.machine.mkl_avx512_on`` this machine, read once at import."""
    return _MKL_AVX512


def _decode_on_mkl(c: Call) -> bool:
    """``_kernel_decode`` (any window or mask, folded into one; no bias that wants a gradient) where the fused
    kernel's GEMMs run MKL's AVX-512 kernels (``mkl_avx512``)."""
    return _kernel_decode(c) and not _trained_bias(c) and mkl_avx512()


def _one_head_per_key_head_decode(c: Call) -> bool:
    """``_kernel_decode`` with one query head per key head (any window or mask, folded into one; no bias that wants
    a gradient)."""
    return _kernel_decode(c) and c.q.shape[1] == c.k.shape[1] and not _trained_bias(c)


def _cpu_decode(c: Call) -> bool:
    """One query per row (a decode step) on the CPU, no dropout, nothing that wants a gradient."""
    return (
        c.q.device.type == "cpu" and c.spec.T == DECODE_QUERIES and c.spec.dropout_p == 0.0 and not _grad(c)
        and not _trained_bias(c)
    )


def _compiled_decode(c: Call) -> bool:
    """``_cpu_decode`` traced by ``torch.compile``."""
    return compiling() and _cpu_decode(c)


def _kernel(c: Call) -> bool:
    """``_cpu_decode`` that the C++ decode kernel computes (``decode_kernel.takes``: float32 or bfloat16, every key
    seen or a causal window's, padding, a softcap, ALiBi and sinks or not, no mask or documents), where it is built (``decode_kernel.available``: built at the first such call, once
    per machine and torch version, then loaded from torch's extension cache)."""
    return _cpu_decode(c) and decode_kernel.takes(c.q, c.k, c.v, c.spec) and decode_kernel.available()


def _prefill_kernel(c: Call) -> bool:
    """A prompt's query rows (``prefill_kernel.FEWEST_ROWS`` or more) that the C++ prefill kernel computes on this
    machine (``prefill_kernel.takes``), where it is built."""
    return prefill_kernel.takes(c.q, c.k, c.v, c.spec) and prefill_kernel.available()


def _split_documents(c: Call) -> bool:
    """Documents in contiguous runs, eager (the split reads the ids on the host, once: kept in ``c``)."""
    if c.spec.documents is None or compiling() or not has_values(c.spec.documents):  # (meta: no ids to read)
        return False
    c.document_runs = packed.runs(c.spec.documents)
    return c.document_runs is not None


def _capped(c: Call) -> bool:
    return c.spec.softcap is not None and c.spec.dropout_p == 0.0 and not _trained_bias(c)


def _sinks_fused(c: Call) -> bool:
    """Sinks the CPU flash kernel carries through its log-sum-exp: one head size, no dropout, eager,
    no bias that wants a gradient (the kernel's backward gives none to its mask)."""
    return (
        c.q.device.type == "cpu" and c.q.shape[-1] == c.v.shape[-1] and c.spec.dropout_p == 0.0
        and not _trained_bias(c) and not compiling()
    )


def _math_only(c: Call) -> bool:
    return (c.spec.softcap is not None and not _capped(c)) or (c.spec.sinks is not None and not _sinks_fused(c))


def causal_rows(T: int) -> int:
    """Queries per kernel call of a blocked causal prompt of ``T`` tokens: ``CAUSAL_BLOCK``, or more where that would
    take more than ``CAUSAL_CALLS`` calls."""
    return max(CAUSAL_BLOCK, -(-T // CAUSAL_CALLS))


def _causal_blocks(c: Call) -> bool:
    """A causal prompt over T == S keys with nothing else but padding, on the CPU. Eager first: a compiled graph keeps T
    symbolic, and comparing it would add guards."""
    return (
        not compiling() and c.spec.causal_prompt and c.q.device.type == "cpu" and not mkl_avx512()
        and CAUSAL_BLOCK < c.spec.T <= CAUSAL_BLOCKS_UP_TO and c.spec.sinks is None and c.spec.dropout_p == 0.0 and not _grad(c)
    )


def window_rows(window: int) -> int:
    """Queries per kernel call of a windowed prompt's blocks: W / 4, within ``WINDOW_BLOCK`` .. ``WINDOW_BLOCK_MOST``."""
    return min(WINDOW_BLOCK_MOST, max(WINDOW_BLOCK, window // 4))


def _window_blocks(c: Call) -> bool:
    """A causal window that leaves keys out (W < S) over more queries than one block takes, on the CPU, eager (a
    compiled graph keeps T symbolic)."""
    s = c.spec
    return (
        not compiling() and s.causal and s.window is not None and s.window < s.S
        and window_rows(s.window) < s.T and c.q.device.type == "cpu"
    )


def float32_keys(q: Tensor, k: Tensor, T: int) -> int | None:
    """Keys converted to float32 at a time for half matmuls of a decode shape on the CPU, else None (matmuls in q's dtype)."""
    few_rows = (q.shape[1] // max(1, k.shape[1])) * T <= FLOAT32_ROWS
    return FLOAT32_KEY_ELEMENTS if q.dtype in (torch.float16, torch.bfloat16) and q.device.type == "cpu" and few_rows else None


def _math_whole(c: Call) -> Runner:
    return partial(math_runner.run, float32_keys=float32_keys(c.q, c.k, c.spec.T))


def _math_summed(c: Call) -> Runner:
    return partial(math_runner.run_chunked, block_elements=BLOCK_ELEMENTS, summed=True)


def _math_blocks(c: Call) -> Runner:
    return partial(math_runner.run_chunked, float32_keys=float32_keys(c.q, c.k, c.spec.T), block_elements=BLOCK_ELEMENTS)


def _per_document(backend: str) -> Callable[[Call], Runner]:
    def build(c: Call) -> Runner:
        def inner(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:  # one document (or a stack of short ones), planned alone
            return choose(Call(q, k, v, spec, backend)).run(q, k, v, spec)

        return partial(packed.run, runs=c.document_runs, inner=inner, short=SHORT_DOCUMENT)

    return build


def _transformed(c: Call) -> bool:
    """q, k, v or any tensor term (a mask, padding, documents, sinks, slopes) wrapped by a transform or carrying a tangent."""
    return transformed(c.q, c.k, c.v, *c.spec.tensors)


AUTO_MATH, AUTO_SDPA, EVERY = frozenset({"auto", "math"}), frozenset({"auto", "sdpa"}), frozenset({"auto", "math", "sdpa"})

RULES: tuple[Rule, ...] = (
    Rule("math, every step whole", "math", AUTO_MATH, lambda c: c.observed, _math_whole,
         "an observer (headwise.observe, explain) reads every step's whole tensor"),
    Rule("math blocks under torch.func", "math", EVERY, _transformed, _math_blocks,
         "a torch.func transform (grad, vmap, jacrev) wraps q, k, v or a tensor term, or one carries a forward-mode tangent: torch's "
         "own ops only, which it transforms "
         "(the C++ kernels and the flash-style autograd Functions do not run under it)"),
    Rule("math blocks, every weight dropped", "math", EVERY, lambda c: c.spec.dropout_p == 1.0, _math_blocks,
         "dropout_p=1 drops every weight: torch's dropout multiplies the weights by zero (zero context, zero gradients), "
         "where a fused kernel would scale the kept weights by 1 / (1 - p) = inf"),
    Rule(DECODE_KERNEL, "sdpa", AUTO_SDPA, _kernel, lambda c: decode_kernel.run,
         "one float32 or bfloat16 query per row on the CPU, every key seen or (eager) a window's last keys, padding, a softcap, "
         "ALiBi and sinks or not, no mask or documents: one C++ pass per key head (scores, softmax, weighted sum on vectors, "
         "each key and value row read once for the query heads sharing it) beats torch's fused kernel, the capped blocks and "
         "two matmuls eagerly, and inductor's loops for the same sums in a compiled step"),
    Rule("math, products summed (compiled)", "math", AUTO_MATH, _compiled_decode, _math_summed,
         "one query per row under torch.compile on the CPU: products and sums, which inductor fuses into loops that read "
         "each key and value once in their own dtype, beat the fused kernel's call and the matmuls in a compiled step"),
    Rule("sdpa, each key head's query heads as rows", "sdpa", AUTO_SDPA, _grouped_decode, lambda c: sdpa.grouped_rows,
         "one bfloat16 query per row on the CPU, G >= 2 query heads per key head seeing every key: as G rows of one "
         "fused call the kernel beats two float32 matmuls (its path for one row per head does so on Intel CPUs only: next rule)"),
    Rule("sdpa, one row per head on MKL", "sdpa", AUTO_SDPA, _decode_on_mkl, lambda c: sdpa.fused,
         "one bfloat16 query per row on an Intel CPU with AVX-512 (one query head per key head, or a window or mask): the "
         "fused kernel's bf16-to-float32 GEMMs run on MKL's kernels for this CPU and beat two float32 matmuls (elsewhere they do not)"),
    Rule("sdpa, the row twice", "sdpa", AUTO_SDPA, _one_head_per_key_head_decode, lambda c: sdpa.row_twice,
         "one bfloat16 query per row on a CPU where the fused kernel's bf16 GEMMs are not MKL's AVX-512 kernels, one query "
         "head per key head: as two equal rows of each head its GEMMs beat one row's, and two float32 matmuls"),
    Rule("math blocks, float32 matmuls", "math", AUTO_MATH, _bf16_decode, _math_blocks,
         "one bfloat16 query per row on the CPU (a decode step): two matmuls beat torch's fused CPU kernel there"),
    Rule(PREFILL_KERNEL, "sdpa", AUTO_SDPA, _prefill_kernel, lambda c: prefill_kernel.run,
         "a prompt's rows on an AMD-style CPU (torch's kernels on AVX-512, MKL's GEMMs not), every key seen or causal (a "
         "window too), sinks, padded keys, a softcap, ALiBi or not, nothing else but the scale, no autograd: one C++ pass a block of queries, float32 "
         "sums in registers, a causal block reading only the keys its queries see (from its first query's window on, not the padding "
         "before its row's first real key), beats torch's flash kernel, whose block GEMMs run slowly there (and which reads padding "
         "as a whole mask)"),
    Rule("per document, each on sdpa's rules", "sdpa", AUTO_SDPA, _split_documents, _per_document("sdpa"),
         "packed documents attend within themselves: one call per document costs sum(T_i * S_i), not T * S"),
    Rule("per document, each on math's rules", "math", frozenset({"math"}), _split_documents, _per_document("math"),
         "packed documents attend within themselves: scores of one document at a time, not T * S"),
    Rule("capped blocks (tanh through expm1, backward recomputes)", "sdpa", AUTO_SDPA, _capped,
         lambda c: partial(softcap.run, block_elements=BLOCK_ELEMENTS),
         "no fused kernel caps scores: they are written a block of queries at a time, and backward recomputes each block"),
    Rule("math blocks", "math", EVERY, _math_only, _math_blocks,
         "softcap with dropout or a trained bias, or sinks the CPU flash kernel cannot take (device, Dv != D, dropout, "
         "a trained bias, compile): math a block of queries at a time, differentiated by autograd"),
    Rule("sdpa ALiBi blocks", "sdpa", AUTO_SDPA, lambda c: c.spec.alibi is not None,
         lambda c: partial(sdpa.masked_blocks, rows=rows_per_block(c.spec.T, c.spec.alibi.shape[0] * c.q.shape[1] * c.spec.S, BLOCK_ELEMENTS)),
         "ALiBi is an additive bias: folded into the fused kernel's mask a block of queries at a time, never (H, T, S) at once"),
    Rule("sdpa window blocks of {rows} queries", "sdpa", AUTO_SDPA, _window_blocks,
         lambda c: partial(sdpa.masked_blocks, rows=window_rows(c.spec.window)),
         "a sliding window over a prompt on the CPU: blocks of queries each over the keys its window reaches (about W + "
         "rows a query), where one call would compute every score of the (T, S) mask"),
    Rule("sdpa flash kernel, sink through its log-sum-exp", "sdpa", AUTO_SDPA, lambda c: c.spec.sinks is not None, lambda c: sdpa.fused,
         "a sink only rescales each row: the CPU flash kernel's log-sum-exp gives context * sigmoid(lse - sink)"),
    Rule("sdpa causal blocks of {rows} queries", "sdpa", AUTO_SDPA, _causal_blocks,
         lambda c: partial(sdpa.masked_blocks, rows=causal_rows(c.spec.T)),
         "a causal prompt (padded or not) on the CPU where MKL runs no AVX-512 kernels: torch's flash kernel computes the masked "
         "half of each key block; a few blocks over the keys each sees skip it (with MKL's AVX-512 GEMMs, on Intel CPUs, one "
         "call is the faster)"),
    Rule("sdpa is_causal", "sdpa", AUTO_SDPA, lambda c: c.spec.plain_causal, lambda c: sdpa.fused,
         "causal over T == S keys with nothing else: the fused kernel's is_causal says it all, no mask"),
    Rule("sdpa", "sdpa", AUTO_SDPA, lambda c: True, lambda c: sdpa.fused,
         "torch's fused kernel takes what remains (a window, padding, masks, causal over T != S) folded into one mask, or none"),
    Rule("math, every score at once", "math", frozenset({"math"}), lambda c: True, _math_whole,
         "asked for math: every score written out, the reference"),
)


#: A paged batch's one-token rows in one call: sorted by their key counts, cut into up to this many calls of at
#: least ``ROWS_PER_GROUP`` rows, so that fewer padded keys are computed (1, 2, 4 and 8 groups of 32 rows
#: timed: bench.paged_attention's sizes; 4 the fastest in float32 and bfloat16).
ROW_GROUPS = 4
#: Rows below which a group is not cut again (a call's fixed cost against its padding); not tuned.
ROWS_PER_GROUP = 8
#: How a paged batch runs its one-token rows when ``rows_in_one_call`` says so (``one_call_runner`` adds how: the C++
#: kernel or inductor's loops).
ROWS_IN_ONE_CALL = "paged one-token rows in one call over their blocks"
ROWS_IN_ONE_CALL_WHY = (
    "a paged batch's one-token rows (decode steps) on the CPU with no mask, documents or dropout: every sequence's query "
    "over its own blocks of the pool, read in place, in one call per layer (the C++ decode kernel, a softcap, sinks and "
    "ALiBi included; where it is not built, inductor's loops over a bfloat16 pool, for a batch made with compile=True, "
    "with no term but causal, a window and the scale), not one call per sequence"
)


def rows_in_one_call(q: Tensor, spec: Spec, backend: str, stored: torch.dtype, compile: bool) -> bool:
    """Whether a paged batch attends its one-token rows in one call (``backends.paged``): eager on the CPU over a pool
    (of ``stored``) that the C++ kernel reads (``paged.in_cpp``), or, for a batch made with ``compile=True``, over a
    bfloat16 pool (inductor's loops; over float32 views the fused kernel per sequence was the faster:
    bench.paged_attention), ``backend="auto"``, no observer, no dropout or gradient, no mask or documents, and a
    softcap, sinks or ALiBi only in C++ (masks and documents go sequence by sequence, through ``RULES``; so do those
    terms where inductor's loops would run); and at least one query head (none: an empty answer, sequence by sequence)."""
    s = spec
    return (
        backend == "auto" and q.device.type == "cpu" and q.shape[1] > 0 and not compiling() and not observing()
        and s.dropout_p == 0.0 and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, s.sinks, s.alibi)))
        and s.mask is None and s.documents is None
        and (paged.in_cpp(q.device, torch.float32, stored) or (compile and stored == torch.bfloat16 and not s.changes_scores and s.sinks is None))
    )


def one_call_runner(device: torch.device, stored: torch.dtype) -> str:
    """The runner name of ``rows_in_one_call``'s call over a pool of ``stored`` (the queries in float32): how it runs."""
    return f"{ROWS_IN_ONE_CALL} ({'C++ kernel' if paged.in_cpp(device, torch.float32, stored) else 'compiled'})"


def choose(call: Call) -> Plan:
    """The first rule that serves ``call.backend`` and matches ``call``, as a ``Plan`` whose ``run`` runs it."""
    for rule in RULES:
        if call.backend in rule.serves and rule.when(call):
            run = rule.build(call)
            name = rule.runner.format(rows=run.keywords["rows"]) if "{" in rule.runner else rule.runner  # (a blocked runner's partial)
            return Plan(rule.backend, name, rule.why, run)
    raise AssertionError(f"no rule serves backend {call.backend!r}")  # the last rules of each backend match every call


def plan(q: Tensor, k: Tensor, v: Tensor, spec: Spec, backend: str) -> Plan:
    """``choose`` for the operands of one runner call: (B, H, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv)."""
    return choose(Call(q, k, v, spec, backend, observed=backend != "sdpa" and observing()))
