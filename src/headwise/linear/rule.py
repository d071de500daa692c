"""The rule that picks a projection's path, ``F.linear`` ("torch"), oneDNN ("onednn") or the panels GEMM ("panels"), from fixed facts.

Nothing is timed. A call's path follows, in order:

1. ``set_path("onednn" | "panels" | "torch")`` (or ``use_path``) if called, else ``HEADWISE_LINEAR`` =
   ``auto`` (default), ``onednn``, ``panels`` or ``torch``, read at each call;
2. ``auto`` chooses oneDNN only for float32, only on an AMD CPU whose torch kernels run AVX-512
   (``torch.backends.cpu.get_cpu_capability()``), only on the torch versions in ``TESTED_TORCH``;
   everything else (Intel, ARM; bfloat16 but as in 3 and below) is ``torch``; bfloat16 inference calls of more than
   ``DECODE_ROWS`` rows on a CPU without native bfloat16 dot products (no ``avx512_bf16`` or ``amx_bf16``: AVX2
   CPUs among them; there, more than ``AVX2_WIDE_ROWS`` where the panels take bfloat16, as in 3) take ``widened``:
   ``F.linear`` of the operands widened to float32 (products exact), the sums rounded once to bfloat16, as torch's
   bfloat16 GEMM rounds them, at float32's rate (torch's own bfloat16 GEMM runs at a fraction of it there; docs:
   decoding); where the library builds
   (``native``), an inference call (autograd records nothing) that would take oneDNN's packed weight
   there takes the panels GEMM over the weight packed once instead (``panels``: level with oneDNN at
   a prompt's rows, a GELU after it (``linear``'s ``gelu``) computed inside as oneDNN's GEMM computes it, and one
   packed copy serves prompts and decode steps), but bfloat16 on a CPU with AMX tiles (oneDNN's AMX GEMM runs a
   prompt's rows faster than the panels' tiles);
3. decode-shaped calls (at most ``DECODE_ROWS`` rows of input, a weight of at least
   ``MIN_DECODE_WEIGHT`` elements: every projection and LM head of a decode step) follow
   ``choose_few_rows``: an inference call of float32 on a CPU whose torch kernels run AVX-512, or
   of bfloat16 on one with AVX512-BF16 too (in AMX tiles from 4 rows where the CPU has them), takes the panels GEMM
   (a decode step's weights read at about memory's rate, where the library builds); on a CPU whose torch kernels
   run AVX2, so does an inference call of float32 of up to ``AVX2_ROWS`` rows, or of bfloat16 (widened to float32
   in registers) of up to ``AVX2_WIDE_ROWS``, and a weight of at least ``MIN_DECODE_WEIGHT`` elements, decode-shaped
   or not (``avx2_band``:
   MKL's float32 GEMV and GEMM of few rows on AMD's AVX2 CPUs, and torch's bfloat16 GEMM, read the weights far
   slower: docs, decoding);
   otherwise float32 as in 2,
   except that on any CPU whose torch kernels run AVX-512 an inference call of more than
   ``GEMV_ROWS`` rows takes oneDNN's packed weight (MKL's GEMM behind ``F.linear`` packs the plain
   weight again on every such call; up to ``GEMV_ROWS`` rows it runs a GEMV that reads it once; a
   call autograd records keeps ``F.linear``, whose backward was the faster at so few rows);
   bfloat16 on oneDNN's packed weight on any CPU whose flags name ``avx512_bf16`` or ``amx_bf16``
   (native bf16 dot products, where torch's bf16 matmul re-reads the plain (N, K) weight each
   call), on the tested torch versions; so are bfloat16 calls of more rows that autograd does not
   record (the same oneDNN kernels as torch's bf16 GEMM, without packing the plain weight again on
   every call; the panels as in 2 where they take them); a recorded one keeps ``F.linear``;
4. ``onednn`` (chosen or forced) needs the private ops to work (``onednn.ops_error``): where
   they fail, ``torch`` and one warning; ``panels`` forced takes every inference call the panels
   multiply here, at any row count;
5. per call (``path_for``), a decision still falls back to ``F.linear`` for operands the op does not
   take (oneDNN: ``onednn.inner_product_takes``: tensor subclasses such as DTensor, other dtypes,
   empty sizes, a bias not (N,), a weight that is not contiguous; the panels: ``panels.takes``; and a
   weight whose change could not be seen, an inference tensor or one under torch.distributed, takes
   the rule without the panels, since nothing packed from it could be kept), few rows (fewer than ``MIN_ROWS`` with a weight under
   ``MIN_DECODE_WEIGHT`` elements), ``torch.backends.mkldnn.enabled`` False (oneDNN), autocast on
   for x's device (it casts ``F.linear``'s operands), or ``torch.compile`` tracing.

``describe()`` returns the decisions (many rows and few rows, per dtype; a compiled step's) and the
machine facts behind them. Nothing global is changed.

A compiled decode step (``generate(..., compile=True)``, its weights frozen) follows none of the
above: its float32 projections run ``panels`` (one C++ GEMM over the weight packed when the step is
compiled) on CPUs whose torch kernels run AVX-512, its bfloat16 and int8 ones (``Int8Linear``'s bfloat16
sums) on those with AVX512-BF16 too, int8 with int8 activations wherever torch's kernels run AVX2 or
AVX-512 except on CPUs with AMX's int8 tiles (AVX512-VNNI's byte products, else AVX2's word products), and
inductor's GEMMs (torch's int8 GEMM for int8 activations) elsewhere (``describe()["compiled_step"]``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from .. import native
from .._checks import compiling
from ..machine import BF16_FLAGS, bf16_flags_on, cpu
from . import onednn, panels

TESTED_TORCH = ("2.13",)  # torch major.minor the oneDNN path was tested with (pyproject.toml [tool.headwise] says the same)
PATHS = ("auto", "onednn", "panels", "torch")
ENV = "HEADWISE_LINEAR"
# Bounds found by timing both paths' GEMMs at decode and prompt shapes on an AMD EPYC (the timings: the performance docs):
MIN_ROWS = 32  # fewer rows (B*T) than this and a weight under MIN_DECODE_WEIGHT: F.linear's lower per-call overhead wins
MIN_DECODE_WEIGHT = 2**17  # weight elements from which a few rows read oneDNN's packed weight faster than MKL's gemv
DECODE_ROWS = 16  # rows (B*T) up to which a call with a weight of MIN_DECODE_WEIGHT or more follows choose_few_rows
GEMV_ROWS = 3  # rows up to which MKL's F.linear reads a float32 weight once (a GEMV); from 4 rows it packs the weight every call
AVX2_ROWS = 128  # rows up to which a float32 inference call takes the panels where torch's kernels run AVX2: from about
#                  256 rows MKL's float32 GEMM is level
AVX2_WIDE_ROWS = 256  # the same for bfloat16 (and Int8Linear's int8) weights, widened in the panels' registers: from about
#                       512 rows a float32 GEMM of the operands widened once in memory (``widened``) is level
_forced: str | None = None  # set_path's value; None = the environment decides
_scoped: contextvars.ContextVar[str | None] = contextvars.ContextVar("headwise_linear_path", default=None)  # use_path's, per thread


def set_path(path: str | None) -> str | None:
    """Force the path of every later call ("auto", "onednn", "torch"); None hands back to ``HEADWISE_LINEAR``.

    Returns:
        the previous ``set_path`` value (None if none was set).
    """
    global _forced
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None, got {path!r}")
    previous, _forced = _forced, path
    return previous


@contextlib.contextmanager
def use_path(path: str) -> Iterator[None]:
    """The path of every call inside a ``with`` block, in this thread (and its context) only, over ``set_path``'s and
    ``HEADWISE_LINEAR``'s; as it was after the block."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    token = _scoped.set(path)
    try:
        yield
    finally:
        _scoped.reset(token)


def _setting() -> tuple[str, str]:
    """The setting the rule starts from and where it came from ("use_path", "set_path", ``ENV`` or "default")."""
    value = _path_setting()
    source = "use_path" if _scoped.get() is not None else "set_path" if _forced is not None else ENV if ENV in os.environ else "default"
    return value, source


def _path_setting() -> str:
    """``use_path``'s value in this thread, else ``set_path``'s, else ``HEADWISE_LINEAR``'s, else "auto" (read on every
    call: a context variable and one dict lookup)."""
    if (scoped := _scoped.get()) is not None:
        return scoped
    if _forced is not None:
        return _forced
    value = os.environ.get(ENV)
    if value is None:
        return "auto"
    if value not in PATHS:
        raise ValueError(f"the environment variable {ENV} must be one of {PATHS}, got {value!r}")
    return value


def _panels_run(dtype: torch.dtype, facts: dict) -> bool:
    """Whether the panels GEMM multiplies ``dtype`` rows by ``dtype`` weights (float32, bfloat16) on a CPU of ``facts``,
    where the library builds (``_library_built``)."""
    return dtype in onednn.DTYPES and (dtype, dtype) in panels.operands_on(facts, compiled=False) and _library_built()


def avx2_rows_for(dtype: torch.dtype) -> int:
    """The most rows of a call the panels take where torch's kernels run AVX2: ``AVX2_ROWS`` for a float32 weight,
    ``AVX2_WIDE_ROWS`` for one widened in registers (bfloat16; ``Int8Linear``'s int8)."""
    return AVX2_ROWS if dtype == torch.float32 else AVX2_WIDE_ROWS


def avx2_band(size: int, k: int, weight_size: int, dtype: torch.dtype) -> bool:
    """Whether a call of ``size`` input elements, rows of ``k``, by a ``dtype`` weight of ``weight_size`` elements lies
    in the band the panels take where torch's kernels run AVX2 (step 3; ``Int8Linear``'s calls too): at most
    ``avx2_rows_for(dtype)`` rows of a weight of ``MIN_DECODE_WEIGHT`` elements or more (a small weight's rows run faster in
    MKL's float32 GEMM)."""
    return weight_size >= MIN_DECODE_WEIGHT and size <= avx2_rows_for(dtype) * k


def _library_built() -> bool:
    """Whether headwise's C++ library (the panels GEMM's) is built here: built at the first call (``native.built``)."""
    return native.built()


def _panels_auto(dtype: torch.dtype, few_rows: bool, facts: dict, avx2_rows: bool = False) -> tuple[str, str] | None:
    """Rule step 3's panels for an inference call the panels multiply here (``_panels_run``), and why; None where
    another path keeps it: bfloat16 of more than ``DECODE_ROWS`` rows on a CPU with AMX tiles (oneDNN's AMX GEMM,
    faster there than the panels' own tiles; a model that prompts and decodes keeps both packed copies), float32 of
    more than ``DECODE_ROWS`` rows off AMD (MKL's GEMM over the plain weight, nothing packed). Where torch's kernels
    run AVX2 the panels take calls of 1-``avx2_rows_for(dtype)`` rows of a weight of ``MIN_DECODE_WEIGHT`` elements or
    more (``avx2_rows``), whatever ``few_rows`` says, and no others
    (the panels' 2-3 rows of sums a read of the weight: MKL's float32 GEMM runs more rows, or a weight in the cache, as
    fast or faster)."""
    name, flag = str(dtype).removeprefix("torch."), panels.OPERANDS[(dtype, dtype)]
    if facts["capability"] == "AVX2":
        widening = ", each pair widened to float32 in registers" if dtype == torch.bfloat16 else ""
        return ("panels", f"{name} inference, 1-{avx2_rows_for(dtype)} rows, AVX2 kernels{widening}: headwise's C++ GEMM over the "
                          "weight packed once in 32-column panels (on AMD's AVX2 CPUs MKL's float32 GEMV and its GEMM of few "
                          "rows, and torch's bfloat16 GEMM without dot products, read the weight far slower)") if avx2_rows else None
    tiles = dtype == torch.bfloat16 and "amx_bf16" in facts["flags"]
    if tiles and not few_rows:
        return None
    kernels = f"AVX-512 kernels, {flag} and AMX tiles (4 rows or more)" if tiles else "AVX-512 kernels" + (f" and {flag}" if flag else "")
    if few_rows:
        return "panels", (f"{name} inference, 1-{DECODE_ROWS} rows, {kernels}: headwise's C++ GEMM over the weight packed once "
                          "in 32-column panels, which reads a decode step's weights at about memory's rate")
    if dtype == torch.bfloat16 or facts["vendor"] == "AuthenticAMD":
        return "panels", (f"{name} inference, {kernels}" + (", AMD" if dtype == torch.float32 else "") + ": headwise's C++ "
                          "GEMM over the weight packed once in 32-column panels, level with oneDNN's packed weight at a "
                          "prompt's rows, a GELU after it computed inside, and one packed copy for prompts and decode "
                          "steps alike")
    return None


@functools.cache
def _auto(dtype: torch.dtype, few_rows: bool = False, gemv: bool = False, recorded: bool = False, kept: bool = True,
          avx2_rows: bool = False) -> tuple[str, str]:
    """Rule steps 2 and 3: the path "auto" picks for ``dtype`` on this machine, and why (``gemv``: a
    decode-shaped call of at most ``GEMV_ROWS`` rows, or one autograd records; ``recorded``: autograd records it;
    ``kept``: False for a weight nothing packed from can be kept, which the panels do not take; ``avx2_rows``: at
    most ``avx2_rows_for(dtype)`` rows of a weight of ``MIN_DECODE_WEIGHT`` or more)."""
    facts = cpu()
    if kept and not recorded and _panels_run(dtype, facts) and (path := _panels_auto(dtype, few_rows, facts, avx2_rows)):
        return path
    untested = None  # or the decision on a torch the oneDNN path was not tested with
    if ".".join(torch.__version__.split(".")[:2]) not in TESTED_TORCH:
        untested = "torch", f"torch {torch.__version__}: the oneDNN path was tested with torch {', '.join(TESTED_TORCH)} only"
    if dtype == torch.bfloat16 and (few_rows or not recorded):
        flags = bf16_flags_on(facts)
        if not flags and not few_rows:
            return "widened", (f"bfloat16 inference of many rows on a CPU without {' or '.join(BF16_FLAGS)}: a "
                               "float32 GEMM of the operands widened (exact), its sums rounded once to bfloat16, as torch's "
                               "bfloat16 GEMM rounds them (which, without native bfloat16 dot products, runs at a fraction "
                               "of float32's rate)")
        if not flags:
            return "torch", f"bfloat16 on a CPU without {' or '.join(BF16_FLAGS)}: torch's own GEMM"
        return untested or ("onednn", f"bfloat16 with {', '.join(flags)}: oneDNN's packed weight, read once per call"
                                      + ("" if few_rows else " (a call autograd records keeps F.linear)"))
    if dtype == torch.bfloat16:
        return "torch", "bfloat16, recorded by autograd: torch's own GEMM (on oneDNN too) and its backward"
    if dtype != torch.float32:
        return "torch", f"{str(dtype).removeprefix('torch.')}: torch's own GEMM"
    if not facts["capability"].startswith("AVX512"):
        return "torch", f"{facts['vendor'] or facts['name']} with {facts['capability']} kernels: only CPUs with AVX-512 take oneDNN"
    if facts["vendor"] != "AuthenticAMD":
        if few_rows and not gemv:
            return untested or ("onednn", f"{GEMV_ROWS + 1}-{DECODE_ROWS} rows, inference, AVX-512 kernels: MKL's GEMM packs the plain weight "
                                          "on every call, oneDNN's weight is packed once")
        if few_rows:
            return "torch", (f"{facts['vendor'] or facts['name']}, up to {GEMV_ROWS} rows or under autograd: MKL's float32 GEMV reads the plain "
                             "weight once, and its backward is the faster at few rows")
        return "torch", f"{facts['vendor'] or facts['name']}, many rows: MKL's float32 GEMM (oneDNN's was faster on AMD CPUs only)"
    return untested or ("onednn", f"AMD family {facts['family']} with AVX-512 kernels: MKL's fp32 GEMM is slower here than oneDNN's")


def choose(dtype: torch.dtype = torch.float32, *, recorded: bool = False) -> tuple[str, str]:
    """The path ("onednn", "torch"; "panels" when forced) for ``dtype`` and why, before the per-call checks (see the module docstring);
    ``recorded``: for a call autograd records."""
    return _decision(dtype, few_rows=False, recorded=recorded)


def choose_few_rows(dtype: torch.dtype = torch.float32, rows: int = DECODE_ROWS) -> tuple[str, str]:
    """The path for ``dtype`` and why when a call has ``rows`` <= ``DECODE_ROWS`` rows and a weight of at
    least ``MIN_DECODE_WEIGHT`` elements (a decode step's projections and LM head; rule step 3)."""
    return _decision(dtype, few_rows=True, gemv=rows <= GEMV_ROWS, avx2_rows=True)  # (DECODE_ROWS <= AVX2_ROWS)


def _decision(dtype: torch.dtype, few_rows: bool, setting: str | None = None, gemv: bool = False, recorded: bool = False,
              kept: bool = True, avx2_rows: bool = False) -> tuple[str, str]:
    """Rule steps 1-4 for ``dtype`` (``few_rows``: step 3's calls; ``gemv``: one of them of at most
    ``GEMV_ROWS`` rows or recorded by autograd; ``recorded``: autograd records the call; ``kept``: False where nothing
    packed from the weight can be kept; ``avx2_rows``: within ``avx2_band``);
    ``setting`` read when not given."""
    setting = _path_setting() if setting is None else setting
    if setting == "torch":
        return "torch", f"forced by {_setting()[1]}"
    if setting == "panels":
        if recorded or not _panels_run(dtype, cpu()):
            return "torch", f"forced by {_setting()[1]} to the panels, which do not take this call: F.linear"
        return "panels", f"forced by {_setting()[1]}"
    if dtype not in onednn.DTYPES:
        return "torch", f"{dtype}: oneDNN's inner product runs float32 and bfloat16 only"
    path, reason = ("onednn", f"forced by {_setting()[1]}") if setting == "onednn" else _auto(dtype, few_rows, gemv, recorded, kept, avx2_rows)
    if path == "onednn" and (error := onednn.ops_error(dtype)):
        return "torch", f"oneDNN's private ops fail here: {error}"
    return path, reason


def describe() -> dict:
    """The decision as data: CPU facts, torch version, setting and, per dtype, the path and why
    (``few_rows``: the same for decode-shaped calls of ``GEMV_ROWS`` + 1 to ``DECODE_ROWS`` rows,
    and in its ``gemv`` entry for those of 1 to ``GEMV_ROWS`` rows).

    Example:
        >>> list(describe())
        ['cpu', 'float32', 'bfloat16', 'few_rows', 'compiled_step', 'setting', 'mkldnn_enabled', 'torch', 'tested_torch']
        >>> describe()["float32"]["path"] in ("onednn", "panels", "torch"), describe()["few_rows"]["rows"]
        (True, 16)
    """
    setting, source = _setting()
    names = [str(dtype).removeprefix("torch.") for dtype in onednn.DTYPES]
    deciders = (choose, choose_few_rows, lambda dtype: choose_few_rows(dtype, GEMV_ROWS))
    decided = {name: [dict(zip(("path", "reason"), decide(dtype), strict=True)) for decide in deciders]
               for name, dtype in zip(names, onednn.DTYPES, strict=True)}
    return {"cpu": cpu(), **{name: many for name, (many, _, _) in decided.items()},
            "few_rows": {"rows": DECODE_ROWS, "min_weight": MIN_DECODE_WEIGHT, **{name: few for name, (_, few, _) in decided.items()},
                         "gemv": {"rows": GEMV_ROWS, **{name: gemv for name, (_, _, gemv) in decided.items()}}},
            "compiled_step": _compiled_step(cpu()),
            "setting": f"{setting} ({source})", "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
            "torch": torch.__version__, "tested_torch": list(TESTED_TORCH)}


# A compiled step's projections by their weights' dtype (and an int8 weight's activations): the operands the panels
# multiply (``panels.OPERANDS``, whose flag the CPU needs beyond AVX-512), and what they do besides.
_STEP_PANELS = {
    "float32": ((torch.float32, torch.float32), ""),
    "bfloat16": ((torch.bfloat16, torch.bfloat16), ""),
    "int8": ((torch.bfloat16, torch.int8), ", int8 widened to bfloat16 in registers (Int8Linear's bfloat16 sums)"),
    "int8, int8 activations": ((torch.int8, torch.int8), ", int8 by int8 in exact int32 sums (Int8Linear's activations='int8')"),
}


def _compiled_step(facts: dict) -> dict:
    """A compiled decode step's projections (weights frozen), per weight dtype: ``panels`` or inductor's GEMMs, and why."""
    runs, isa = panels.operands_on(facts), facts["capability"]
    step = {}
    for name, (operands, note) in _STEP_PANELS.items():
        flag = panels.OPERANDS[operands]
        if operands in runs:
            has = flag is None or flag in facts["flags"]  # else int8 x int8 by AVX2's word products
            needs = f"torch's kernels run {'AVX-512' if isa == 'AVX512' else isa}" + (f", the CPU has {flag}" if flag and has else "")
            note = note if has else f"{note} by AVX2's word products" + (f" (no {flag})" if isa == "AVX512" else "")
            fewest = 2 if name == "int8" else 4  # rows: panels.cpp's INT8_TILE_ROWS, TILE_ROWS
            tiles = f", in AMX tiles from {fewest} rows" if operands[0] == torch.bfloat16 and "amx_bf16" in facts["flags"] else ""
            entry = {"path": "panels", "reason": f"{needs}: headwise's C++ GEMM over the weight packed in 32-column panels "
                                                 f"(where headwise's C++ library builds){note}{tiles}"}
        elif operands[0] == torch.int8 and panels.amx_int8_on(facts):
            entry = {"path": "inductor", "reason": "the CPU multiplies int8 by int8 in AMX tiles: inductor's int8 GEMM "
                                                   "over the weight it packs when the step is compiled"}
        elif operands[0] == torch.int8:
            entry = {"path": "int_mm", "reason": f"torch's kernels run {isa}: torch's int8 GEMM as an opaque op"}
        else:
            lacks = f", no {flag}" if isa == "AVX512" and flag else ""
            entry = {"path": "inductor", "reason": f"torch's kernels run {isa}{lacks}: inductor's GEMM over the weight it packs "
                                                   "when the step is compiled"}
        step[name] = entry
    return step


def under_cpu_autocast(x: Tensor) -> bool:
    """Whether x is a CPU tensor inside ``torch.autocast("cpu")``, which casts ``F.linear``'s operands: only
    ``F.linear`` then gives autocast's dtype (oneDNN's and the panels' paths, and a kept call's packed weight, compute
    in x's own)."""
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu")


def path_for(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> str:
    """The path ``linear(x, weight, bias)`` takes (with its ``gelu`` or without): "onednn", "panels",
    "widened" (``F.linear`` of bfloat16 operands widened to float32, rounded once) or "torch" (``F.linear``); rule step 5."""
    if compiling():  # first: the row count below would put a guard on T into every compiled graph
        return "torch"  # (without autograd, a compiled call runs ``linear`` whole as one opaque op, which decides when it runs)
    if under_cpu_autocast(x):
        return "torch"  # autocast casts F.linear's operands; the CPU's other paths would compute in x's own dtype
    big, size = weight.numel() >= MIN_DECODE_WEIGHT, x.numel()
    if not big and x.ndim and size < MIN_ROWS * x.shape[-1]:  # few rows and a small weight (asked first: the cheapest question)
        return "torch"
    setting = _path_setting()
    k, recorded = x.shape[-1] if x.ndim else 0, onednn.recorded(x, weight, bias)
    few = big and size <= k * DECODE_ROWS
    gemv = few and (size <= GEMV_ROWS * k or recorded)  # where MKL's F.linear stays on Intel (its backward is faster)
    avx2_rows = avx2_band(size, k, weight.numel(), x.dtype)
    path = _decision(x.dtype, few, setting, gemv, recorded, avx2_rows=avx2_rows)[0]
    if path == "panels":
        if not onednn.plain_tensors(x, weight, bias) or not panels.takes(x, weight, bias) or not x.numel():
            return "torch"
        if panels.keeps(weight):
            return "panels"
        if setting == "panels":
            return "torch"
        path = _decision(x.dtype, few, setting, gemv, recorded, kept=False, avx2_rows=avx2_rows)[0]  # nothing packed could be kept: the rule without the panels
    if path == "onednn" and onednn.inner_product_takes(x, weight, bias) and weight.is_contiguous() and torch.backends.mkldnn.enabled:
        return "onednn"
    if path == "widened" and x.device.type == "cpu" and weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return "widened"
    return "torch"  # (a sliced weight, row stride != K, would take oneDNN's slow strided path)


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """True when ``linear(x, weight, bias)`` takes the oneDNN path (``path_for``)."""
    return path_for(x, weight, bias) == "onednn"
