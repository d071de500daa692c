"""Every private torch op headwise calls, the guard in front of each, and each guard held against its op.

A private op (``torch.ops.aten._x``, ``torch.ops.mkldnn._x``) checks less than the public function
above it: outside the shapes its kernel was written for it reads past its operands (a SIGSEGV, or
values far off) or fails with an error that names nothing the caller passed. headwise calls each
one only after its guard says True and takes an exact public path otherwise. For each guard:

- shapes it accepts run on the op itself (in a child process: a guard too loose would crash it)
  and match a float64 reference;
- shapes it refuses never reach the op (the op replaced by one that raises) and still get the
  public function's answer;
- on the torch (and CPU) the guard was written for, each condition it refuses is one the op gets
  wrong (each case forked on its own: those crash).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import reference
import torch
import torch.nn.functional as F
from isolated import run_cases, run_isolated

from headwise import linear as hl
from headwise import quantize
from headwise.linear import onednn

SRC = Path(__file__).parents[1] / "src" / "headwise"


@dataclass(frozen=True)
class PrivateOp:
    files: tuple[str, ...]  # where under src/headwise the op is written
    guard: str | None  # the function that says True before every call, as "module:name"
    why: str  # what the guard keeps away from the op


PRIVATE_OPS = {
    "torch.ops.aten._weight_int8pack_mm": PrivateOp(
        ("quantize.py", "bench/panels.py"), "headwise.quantize:int8_mm_takes",
        "K not a multiple of 16 (reads past each row: SIGSEGV or values far off), rows or weight off their alignment (SIGSEGV)"),
    "torch.ops.mkldnn._linear_pointwise": PrivateOp(
        ("linear/onednn.py",), "headwise.linear.onednn:inner_product_takes",
        "an empty M, N or K, a bias not (N,) (a 0-d one gives wrong numbers), dtypes oneDNN does not run, mixed dtypes"),
    "torch.ops.mkldnn._reorder_linear_weight": PrivateOp(
        ("linear/onednn.py",), "headwise.linear.onednn:reorder_takes", "an empty weight, dtypes oneDNN does not run"),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": PrivateOp(
        ("backends/sdpa.py",), "headwise.backends.sdpa:flash_guard", "empty shapes (SIGFPE); tested in tests/test_flash_guard.py"),
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": PrivateOp(
        ("backends/sdpa.py",), "headwise.backends.sdpa:flash_guard", "the forward's guard, for the same operands"),
    "torch._int_mm": PrivateOp(
        ("quantize.py", "bench/panels.py"), None,
        "nothing: it checks its operands' dtypes and shapes, and gave exact sums on empty M, K or N and on operands at odd "
        "offsets (tests/test_quantize_int8_rows.py)"),
    "torch._dynamo": PrivateOp(
        ("models/compiled_step.py", "backends/paged.py"), None,
        "nothing: reset_code drops the graphs Dynamo keeps on a code object the compiled step owns "
        "(tests/models/test_generate_compile.py); maybe_mark_dynamic marks the sizes a paged batch's one call changes from "
        "step to step (a hint only: a size it cannot keep symbolic gets a graph of its own; tests/test_paged_rows.py)"),
    "torch._inductor": PrivateOp(
        ("linear/projection.py", "models/compiled_step.py"), None,
        "nothing: its config's freezing (per thread from torch 2.12), on while the compiled step runs (projection.freezing; "
        "Dynamo reads it where it traces, compile's options do not reach it); compiled_step.config_per_thread reads whether "
        "the settings are per thread from its config entries (anything else it finds: process-wide, the safe answer); "
        "tests/models/test_generate_compile.py checks the frozen step's logits, its recompiles, that the setting stays in "
        "the step's thread and config_per_thread against what inductor does"),
    "torch.ops.prims.inductor_force_stride_order": PrivateOp(
        ("backends/math.py",), None,
        "nothing: inductor's own prim, called only while torch.compile traces and only where inductor registered it, "
        "on a contiguous tensor with its own strides (a buffer of it under inductor, a no-op elsewhere); "
        "tests/test_compiled_decode_attention.py runs it under inductor, aot_eager and eager"),
    "torch.ops.aten.gelu_": PrivateOp(
        ("bench/projections.py",), None,
        "nothing: the in-place form of the public F.gelu (a public aten op; torch names no Python function for it), "
        "timed in the benchmark on the output the panels GEMM has just made, as the panels ran a GELU before they "
        "computed it inside"),
    "torch._assert_async": PrivateOp(
        ("_checks.py",), None, "nothing: it takes any one-element bool tensor, and holds() passes only those"),
}


def private_calls() -> dict[str, set[str]]:
    """Every private torch op or function written under src/headwise -> the files it is written in."""
    found: dict[str, set[str]] = {}
    pattern = re.compile(r"torch\.ops\.(\w+)(?:\.(\w+)|, \"(\w+)\")|torch\.(_[a-z]\w*)")
    for file in SRC.rglob("*.py"):
        for match in pattern.finditer(file.read_text()):
            namespace, op, quoted, function = match.groups()
            if namespace == "headwise":
                continue  # headwise's own custom ops
            name = f"torch.{function}" if function else f"torch.ops.{namespace}.{op or quoted or ''}"
            found.setdefault(name.rstrip("."), set()).add(file.relative_to(SRC).as_posix())
    return found


def guard_of(name: str):
    module, _, function = PRIVATE_OPS[name].guard.partition(":")
    return getattr(importlib.import_module(module), function)


def test_the_table_lists_every_private_op_the_source_calls_and_where():
    found = private_calls()
    assert set(found) == set(PRIVATE_OPS), "a private op missing from PRIVATE_OPS (or listed but no longer called)"
    for name, row in PRIVATE_OPS.items():
        assert found[name] == set(row.files), name


@pytest.mark.parametrize("name", [name for name, row in PRIVATE_OPS.items() if row.guard])
def test_every_listed_guard_exists(name):
    try:
        guard = guard_of(name)
    except AttributeError:
        if "flash" in name:
            pytest.xfail("backends/sdpa.py exposes no flash_guard")
        raise
    assert callable(guard)


# ----------------------------------------------------------------------------- int8 GEMV: aten._weight_int8pack_mm

INT8_SETUP = """
import torch
from headwise.quantize import int8_mm_takes
torch.set_num_threads(1)
op = torch.ops.aten._weight_int8pack_mm.default

def operands(m, n, k, rows_at=0, weight_at=0):
    # (M, K) bf16 rows and an (N, K) int8 weight at offsets into storage whose bytes past them hold large
    # values: a kernel that reads past its operands gives values far off, not by luck the right ones
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    rows = torch.full((rows_at + m * k + 64,), 1e3, dtype=torch.bfloat16)
    rows = rows[rows_at : rows_at + m * k].copy_(torch.randn(m * k, generator=gen)).view(m, k)  # (M, K)
    weight = torch.full((weight_at + n * k + 64,), 127, dtype=torch.int8)
    weight = weight[weight_at : weight_at + n * k].copy_(torch.randint(-127, 128, (n * k,), generator=gen)).view(n, k)  # (N, K)
    return rows, weight

def error(m, n, k, rows_at=0, weight_at=0):
    rows, weight = operands(m, n, k, rows_at, weight_at)
    scales = torch.rand(n, generator=torch.Generator().manual_seed(1)).bfloat16() + 0.5  # (N,)
    want = rows.double() @ weight.double().T * scales.double()  # (M, N)
    got = op(rows, weight, scales)
    return ((got.double() - want).norm() / want.norm()).item()
"""
INT8_ACCEPTED = [(m, n, k, at, at) for m in (1, 3, 5, 16) for n in (1, 5, 17) for k in (16, 48) for at in (0, 16)]  # at 16: 32 bytes in


@pytest.mark.slow
@pytest.mark.slow  # child processes
def test_int8_shapes_the_guard_accepts_run_on_the_kernel():
    """Every accepted case run on the op itself in one child (a crash fails the test): bf16 output rounding only."""
    if not quantize._INT8_KERNEL:
        pytest.skip("this torch has no _weight_int8pack_mm")
    verdicts = run_isolated(INT8_SETUP + f"""
import json
cases = {INT8_ACCEPTED!r}
print(json.dumps([[int8_mm_takes(*operands(*case)), error(*case)] for case in cases]))
""")
    for case, (accepted, err) in zip(INT8_ACCEPTED, verdicts, strict=True):
        assert accepted and err < 1e-2, (case, err)


def misaligned(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The same values in storage that starts ``nbytes`` past an aligned allocation."""
    step = t.element_size()
    buffer = torch.empty(t.numel() + nbytes // step, dtype=t.dtype)
    return buffer[nbytes // step :].view(t.shape).copy_(t)


@pytest.mark.parametrize("why, make", [
    ("K = 12", lambda: (torch.randn(2, 12).bfloat16(), torch.ones(4, 12, dtype=torch.int8))),
    ("K = 24", lambda: (torch.randn(1, 24).bfloat16(), torch.ones(4, 24, dtype=torch.int8))),
    ("rows 16 bytes in", lambda: (misaligned(torch.randn(1, 64).bfloat16(), 16), torch.ones(4, 64, dtype=torch.int8))),
    ("weight 1 byte in", lambda: (torch.randn(5, 64).bfloat16(), misaligned(torch.ones(4, 64, dtype=torch.int8), 1))),
    ("rows not contiguous", lambda: (torch.randn(64, 2).bfloat16().T, torch.ones(4, 64, dtype=torch.int8))),
    ("float32 rows", lambda: (torch.randn(1, 64), torch.ones(4, 64, dtype=torch.int8))),
])
def test_the_int8_guard_refuses(why, make):
    rows, weight = make()
    assert not quantize.int8_mm_takes(rows, weight), why


@pytest.mark.parametrize("n, k, weight_at", [(2, 3, 0), (4, 8, 0), (4, 24, 0), (6, 40, 0), (4, 64, 1), (4, 64, 8)])
def test_int8_operands_the_guard_refuses_never_reach_the_kernel(monkeypatch, n, k, weight_at):
    """Odd K, or a weight off its alignment: torch's GEMM with the kernel's arithmetic, the op untouched."""
    def unreachable(*args):
        raise AssertionError("the int8 kernel was called")

    monkeypatch.setattr(quantize, "_int8_mm", unreachable)
    gen = torch.Generator().manual_seed(k)
    lin = quantize.Int8Linear(torch.randn(n, k, generator=gen), torch.randn(n, generator=gen))
    lin.weight = misaligned(lin.weight, weight_at)
    x = torch.randn(3, k, generator=gen)  # (M, K): decode-shaped
    want, slack = reference.int8_linear(x, lin.weight, lin.scales, lin.bias)  # (M, N)
    assert not lin.uses_kernel(x)
    with torch.no_grad():
        assert bool(((lin(x).double() - want).abs() <= slack).all())


@pytest.mark.slow
@pytest.mark.slow  # child processes
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or not torch.__version__.startswith("2.13"),
                    reason="the refused conditions were measured on torch 2.13's AVX-512 kernel")
def test_each_condition_the_int8_guard_refuses_is_one_the_kernel_gets_wrong():
    """Raw kernel calls, each forked on its own: an odd K and storage off alignment crash or give values far off."""
    cases = {"K = 12": "error(2, 4, 12)", "K = 24": "error(1, 4, 24)", "rows 16 bytes in": "error(1, 4, 64, rows_at=8)",
             "weight 1 byte in": "error(5, 4, 64, weight_at=1)"}
    answers = dict(zip(cases, run_cases(INT8_SETUP, list(cases.values())), strict=True))
    for why, answer in answers.items():
        assert answer.startswith("crash") or answer == "nan" or float(answer) > 0.1, (why, answer)
    assert float(run_cases(INT8_SETUP, ["error(1, 4, 64, rows_at=16)"])[0]) < 1e-2  # 32 bytes in: aligned enough


# ----------------------------------------------------------------------------- oneDNN: mkldnn._linear_pointwise and _reorder_linear_weight

ONEDNN_SETUP = """
import torch
import torch.nn.functional as F
from headwise.linear.onednn import inner_product_takes, reorder_takes
torch.set_num_threads(1)
linear_pointwise = torch.ops.mkldnn._linear_pointwise
reorder = torch.ops.mkldnn._reorder_linear_weight
LAYOUTS = {  # the same values in the layouts callers hand over (a 1-D tensor stays contiguous)
    "contiguous": lambda t: t.clone(),
    "transposed": lambda t: t.mT.contiguous().mT if t.ndim > 1 else t.clone(),
    "sliced": lambda t: torch.cat([t, t], -1)[..., : t.shape[-1]],
    "expanded": lambda t: t.flatten()[:1].view([1] * t.ndim).expand(t.shape),  # every element one stride-0 value
}

def error(dtype, x_shape, n, bias, x_layout="contiguous", w_layout="contiguous", packed=False, x_dtype=None):
    gen = torch.Generator().manual_seed(0)
    x = LAYOUTS[x_layout](torch.randn(x_shape, generator=gen)).to(x_dtype or dtype)  # (..., K)
    w = LAYOUTS[w_layout](torch.randn(n, x_shape[-1], generator=gen)).to(dtype)  # (N, K)
    b = {"none": None, "(N,)": torch.randn(n, generator=gen), "(1,)": torch.randn(1), "0-d": torch.randn(())}[bias]
    b = None if b is None else b.to(dtype)
    if not inner_product_takes(x, w, b) or (packed and not reorder_takes(w)):
        return "refused"
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    with torch.no_grad():
        got = linear_pointwise(x, reorder(w, None) if packed else w, b, "none", [], "")
    return ((got.double() - want).norm() / want.norm()).item()
"""
ONEDNN_ACCEPTED = [
    (dtype, x_shape, n, bias, x_layout, w_layout, packed)
    for dtype in ("float32", "bfloat16")
    for x_shape, n in (((1, 1), 1), ((5, 8), 6), ((3, 7), 5), ((2, 3, 16), 12), ((16,), 4))
    for bias in ("none", "(N,)")
    for x_layout, w_layout, packed in (("contiguous", "contiguous", False), ("contiguous", "contiguous", True),
                                       ("transposed", "transposed", False), ("sliced", "sliced", True), ("expanded", "contiguous", True))
]


def skip_without_onednn():
    if onednn.ops_error(torch.float32) is not None:
        pytest.skip(f"oneDNN's private ops do not work here: {onednn.ops_error(torch.float32)}")


@pytest.mark.slow
@pytest.mark.slow  # child processes
def test_onednn_operands_the_guards_accept_run_on_the_ops():
    """Every accepted case on the ops themselves in one child, against F.linear in float64 (the backward's
    transposed operands and the packed weight included), in the dtypes the ops work in here (on a CPU without AVX-512
    they refuse bfloat16, and ``ops_error`` keeps every call off them)."""
    skip_without_onednn()
    cases = [case for case in ONEDNN_ACCEPTED if onednn.ops_error(getattr(torch, case[0])) is None]
    errors = run_isolated(ONEDNN_SETUP + f"""
import json
print(json.dumps([error(getattr(torch, case[0]), *case[1:]) for case in {cases!r}]))
""")
    for case, err in zip(cases, errors, strict=True):
        assert err != "refused" and err < (1e-6 if case[0] == "float32" else 1e-2), (case, err)


# (x, weight, bias) F.linear takes that oneDNN's inner product refuses, gets wrong or cannot differentiate
ONEDNN_REFUSED = {
    "0-d bias": lambda: (torch.randn(64, 16), torch.randn(8, 16), torch.randn(())),  # F.linear broadcasts it
    "(1,) bias": lambda: (torch.randn(64, 16), torch.randn(8, 16), torch.randn(1)),
    "K = 0": lambda: (torch.randn(64, 0), torch.randn(8, 0), None),
    "N = 0": lambda: (torch.randn(64, 16), torch.randn(0, 16), torch.randn(0)),
    "M = 0, decode-sized weight": lambda: (torch.randn(2, 0, 512), torch.randn(256, 512), None),
    "1-D weight": lambda: (torch.randn(64, 16), torch.randn(16), None),
    "float64": lambda: (torch.randn(64, 16).double(), torch.randn(8, 16).double(), None),
}


@pytest.mark.parametrize("edge", ONEDNN_REFUSED)
@pytest.mark.parametrize("grad", [False, True])
def test_onednn_operands_the_guard_refuses_never_reach_the_ops(monkeypatch, edge, grad):
    """Forced onto oneDNN, each is F.linear's result and gradient, and neither op is called."""
    def unreachable(*args):
        raise AssertionError("a private oneDNN op was called")

    skip_without_onednn()
    x, w, b = ONEDNN_REFUSED[edge]()
    assert not onednn.inner_product_takes(x, w, b)
    x64, w64 = x.double().requires_grad_(grad), w.double().requires_grad_(grad)
    want = F.linear(x64, w64, None if b is None else b.double())
    x, w = x.requires_grad_(grad), w.requires_grad_(grad)
    monkeypatch.setattr(onednn, "inner_product", unreachable)
    monkeypatch.setattr(onednn, "reorder", unreachable)
    with hl.use_path("onednn"):
        got = hl.linear(x, w, b)
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-6, atol=1e-6)
    if grad:
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("weight", [torch.randn(0, 16), torch.randn(8, 0), torch.randn(8, 16).double(), torch.randn(16)], ids=str)
def test_a_weight_the_reorder_guard_refuses_is_used_unpacked(monkeypatch, weight):
    def unreachable(*args):
        raise AssertionError("_reorder_linear_weight was called")

    monkeypatch.setattr(onednn, "reorder", unreachable)
    assert not onednn.reorder_takes(weight)
    assert onednn.packed(weight) is weight


@pytest.mark.slow
@pytest.mark.slow  # child processes
@pytest.mark.skipif(not torch.__version__.startswith("2.13"), reason="the refused conditions were measured on torch 2.13's oneDNN ops")
def test_each_condition_the_onednn_guards_refuse_is_one_the_ops_get_wrong():
    """Raw op calls, each forked on its own: an error that names nothing the caller passed, or other numbers."""
    skip_without_onednn()
    cases = {
        "K = 0 (also the weight gradient's GEMM when M = 0)": "error(torch.float32, (5, 0), 6, 'none')",
        "N = 0, packed": "error(torch.float32, (5, 8), 0, 'none', packed=True)",
        "(1,) bias": "error(torch.float32, (5, 8), 6, '(1,)')",
        "0-d bias": "error(torch.float32, (5, 8), 6, '0-d')",
        "float64": "error(torch.float64, (5, 8), 6, 'none')",
        "mixed dtypes": "error(torch.bfloat16, (5, 8), 6, 'none', x_dtype=torch.float32)",
    }
    unguarded = ONEDNN_SETUP.replace("if not inner_product_takes(x, w, b) or (packed and not reorder_takes(w)):", "if False:")
    answers = dict(zip(cases, run_cases(unguarded, list(cases.values())), strict=True))
    for why, answer in answers.items():  # float32 cases the guard accepts are within 1e-6
        assert answer.startswith(("error", "crash")) or answer == "nan" or float(answer) > 1e-3, (why, answer)
