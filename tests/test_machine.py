"""headwise.machine: the CPU facts every rule reads, and the two facts drawn from them, asked of pretend machines."""

import torch

from headwise import machine
from headwise.quantize import _BF16_GEMM


def test_cpu_names_what_the_rules_read():
    facts = machine.cpu()
    assert set(facts) == {"vendor", "family", "model", "name", "flags", "capability"}
    assert facts["capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(facts["flags"]) <= {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"}
    assert machine.cpu() is facts  # read once


def test_bf16_flags_are_the_native_bf16_dot_products_named():
    assert machine.bf16_flags_on({"flags": ["avx2", "avx512f"]}) == []
    assert machine.bf16_flags_on({"flags": ["amx_bf16", "avx2", "avx512_bf16", "avx512f"]}) == ["amx_bf16", "avx512_bf16"]
    assert machine.bf16_flags_on({"flags": ["avx512_bf16"]}) == ["avx512_bf16"]
    assert machine.bf16_flags() == machine.bf16_flags_on(machine.cpu())
    assert bool(machine.bf16_flags()) == _BF16_GEMM  # Int8Linear's prompt GEMM reads it once


def test_mkl_avx512_reads_the_vendor_the_kernels_and_the_build():
    intel = {"vendor": "GenuineIntel", "capability": "AVX512"}
    assert machine.mkl_avx512_on(intel, mkl=True)
    assert not machine.mkl_avx512_on(intel, mkl=False)
    assert not machine.mkl_avx512_on({**intel, "vendor": "AuthenticAMD"}, mkl=True)
    assert not machine.mkl_avx512_on({**intel, "capability": "AVX2"}, mkl=True)


def test_amx_int8_needs_the_tiles_and_their_int8_products():
    assert machine.amx_int8_on({"flags": ["amx_bf16", "amx_int8", "amx_tile", "avx512f"]})
    assert not machine.amx_int8_on({"flags": ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f"]})
    assert not machine.amx_int8_on({"flags": ["avx2", "avx512_bf16", "avx512f"]})  # a Zen 4 EPYC: VNNI, no AMX
    from headwise.quantize import _AMX_INT8

    assert machine.amx_int8_on(machine.cpu()) == _AMX_INT8  # Int8Linear reads it once
