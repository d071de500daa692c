"""The machine facts the rules read, in one place: the CPU and what follows from it for torch's kernels.

``cpu()`` reads ``/proc/cpuinfo`` once (vendor, family, model, name, the flags the rules ask about)
and torch's kernel ISA (``torch.backends.cpu.get_cpu_capability()``). The facts drawn from it are
pure functions of those facts, so that tests can ask them about any machine:

- ``bf16_flags_on``: the CPU's native bfloat16 dot products (``avx512_bf16``, ``amx_bf16``), where
  oneDNN runs bf16 GEMMs on them: ``headwise.linear``'s bf16 decode rule and ``Int8Linear``'s
  prompt GEMM read it;
- ``mkl_avx512_on``: whether the GEMMs torch hands to MKL run MKL's AVX-512 kernels (an Intel CPU,
  torch built with MKL, AVX-512 kernels; MKL runs its AVX2 code on other vendors' CPUs): the
  attention plan's bf16 decode and causal-prompt rules read it;
- ``amx_int8_on``: whether the CPU multiplies int8 by int8 in AMX tiles, where inductor's GEMM
  templates have a vector kernel for int8 activations: ``Int8Linear(activations="int8")`` under
  ``torch.compile`` reads it.

A rule that reads a fact inside a compiled graph keeps it in a constant read at import (a graph
reads no /proc).
"""

from __future__ import annotations

import contextlib
import functools
import platform

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU flags of native bf16 dot products (oneDNN's bf16 kernels use them)


@functools.cache
def cpu() -> dict:
    """The CPU facts the rules read: vendor, family, model, name, torch's kernel ISA (``capability``), relevant flags."""
    facts = {"vendor": "", "family": "", "model": "", "name": platform.processor() or platform.machine(), "flags": []}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = (s.strip() for s in line.partition(":"))
            for field, name in (("vendor_id", "vendor"), ("cpu family", "family"), ("model", "model"), ("model name", "name")):
                if key == field:
                    facts[name] = value
            if key in ("flags", "Features"):
                facts["flags"] = sorted({"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"} & set(value.split()))
                break
    facts["capability"] = torch.backends.cpu.get_cpu_capability()
    return facts


def bf16_flags_on(facts: dict) -> list[str]:
    """The flags of native bfloat16 dot products among ``facts["flags"]`` (of ``BF16_FLAGS``): where oneDNN runs
    bf16 GEMMs on them, at twice the multiply-adds per instruction of float32's (empty: none)."""
    return sorted(set(BF16_FLAGS) & set(facts["flags"]))


def bf16_flags() -> list[str]:
    """``bf16_flags_on`` this machine."""
    return bf16_flags_on(cpu())


def mkl_avx512_on(facts: dict, mkl: bool) -> bool:
    """Whether the GEMMs torch's CPU kernels hand to MKL (float32 ``sgemm``, bfloat16 operands into float32:
    the fused attention kernel's products) run MKL's AVX-512 kernels on a CPU of ``facts`` (``cpu()``): torch
    built with MKL (``mkl``), an Intel CPU, AVX-512 kernels. MKL runs its AVX2 code on other vendors' CPUs
    (the reason float32 projections take oneDNN on AMD: ``headwise.linear``)."""
    return mkl and facts["vendor"] == "GenuineIntel" and facts["capability"].startswith("AVX512")


def amx_int8_on(facts: dict) -> bool:
    """Whether a CPU of ``facts`` (``cpu()``) multiplies int8 by int8 in AMX tiles (``amx_tile``, ``amx_int8``). Only
    there do inductor's CPU GEMM templates (max-autotune over frozen weights) hold a vector micro-kernel for signed
    int8 activations times int8 weights (torch 2.13: AMX's; its AVX512-VNNI one takes unsigned activations); elsewhere
    they offer their scalar reference kernel and oneDNN's qlinear, both slower than torch's own int8 GEMM (docs: decoding)."""
    return {"amx_tile", "amx_int8"} <= set(facts["flags"])
