"""headwise.plan: what attention runs for a call, and why; attention runs from the same table.

For every kind of call the plan names its runner and gives one sentence, and
``attention(..., backend=plan.backend)`` equals the default call bit for bit.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from reference import reference_attention

import headwise as hw
from headwise import machine
from headwise.backends import decode_kernel
from headwise.backends import plan as plan_table
from headwise.backends.plan import ROWS_IN_ONE_CALL
from headwise.masks import documents_from_cu_seqlens


def _qkv(B=2, H=4, Hkv=2, T=100, S=None, D=16, dtype=torch.float32, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    S = T if S is None else S
    q = torch.randn(B, H, T, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _cache(kind: str, dtype=torch.float32):
    """A cache holding a 20-token prefix (the same numbers every time), ready for a 1-token step."""
    q, k, v = _qkv(B=1, T=20, dtype=dtype, seed=1)
    if kind == "paged":
        cache = hw.PagedKVCache(num_blocks=16, block_size=4, num_kv_heads=2, head_dim=16, dtype=dtype)
        cache.add(0), cache.add(1)
        with torch.no_grad():
            hw.attention(q, k, v, causal=True, cache=cache.batch([0, 1], [12, 8]))
        return lambda: cache.batch([0, 1], [1, 3])
    cache = hw.KVCache.sliding(1, 2, 8, 16, dtype=dtype) if kind == "ring" else hw.KVCache(1, 2, 64, 16, dtype=dtype)
    with torch.no_grad():
        hw.attention(q, k, v, causal=True, window=cache.window, cache=cache)
    return lambda: cache


#: Where the fused kernel's GEMMs run MKL's AVX-512 kernels (Intel CPUs), one bfloat16 query per row with one query
#: head per key head or a window or mask takes the kernel one row per head; elsewhere one query head per key head takes
#: it with the row twice, G >= 2 with a window or mask two float32 matmuls; and a causal prompt is one call, else blocks
#: of queries.
HEAD_ROWS = "sdpa, one row per head on MKL" if plan_table.mkl_avx512() else "math blocks, float32 matmuls"
#: A decode step on the CPU (float32 or bfloat16, every key seen or a window's, padding, a softcap, ALiBi and sinks or
#: not, no mask or documents, no autograd) runs the C++ decode kernel where it is built; where it could not be, the rules after it.
KERNEL = plan_table.DECODE_KERNEL if decode_kernel.available() else None
ONE_HEAD_ROWS = "sdpa, one row per head on MKL" if plan_table.mkl_avx512() else "sdpa, the row twice"
PROMPT = "sdpa is_causal" if plan_table.mkl_avx512() else "sdpa causal blocks of 64 queries"

# name: (inputs, keyword arguments, grad enabled, the runner expected)
CASES = {
    "prompt": (dict(T=100), dict(causal=True), False, PROMPT),
    "prompt, training": (dict(T=100, grad=True), dict(causal=True), True, "sdpa is_causal"),
    "long prompt": (dict(B=1, H=2, Hkv=1, T=1100, D=8), dict(causal=True), False, "sdpa is_causal"),
    "decode": (dict(T=1, S=50), dict(causal=True), False, KERNEL or "sdpa"),
    "bf16 decode": (dict(T=1, S=50, dtype=torch.bfloat16), dict(causal=True), False, KERNEL or "sdpa, each key head's query heads as rows"),
    "bf16 decode, one query head per key head": (dict(Hkv=4, T=1, S=50, dtype=torch.bfloat16), dict(causal=True), False, KERNEL or ONE_HEAD_ROWS),
    "bf16 decode, one query head per key head, padding": (dict(Hkv=4, T=1, S=50, dtype=torch.bfloat16),
                                                          dict(causal=True, attention_mask=torch.arange(50).expand(2, 50) > 3), False,
                                                          KERNEL or ONE_HEAD_ROWS),
    "bf16 decode, one query head per key head, window": (dict(Hkv=4, T=1, S=50, dtype=torch.bfloat16), dict(causal=True, window=16),
                                                         False, KERNEL or ONE_HEAD_ROWS),
    "bf16 decode, window": (dict(T=1, S=50, dtype=torch.bfloat16), dict(causal=True, window=16), False, KERNEL or HEAD_ROWS),
    "bf16 decode, softcap": (dict(T=1, S=50, dtype=torch.bfloat16), dict(causal=True, softcap=30.0), False,
                             KERNEL or "math blocks, float32 matmuls"),
    "decode, softcap, sinks, window": (dict(T=1, S=50), dict(causal=True, softcap=30.0, sinks=torch.randn(4), window=16), False,
                                       KERNEL or "capped blocks (tanh through expm1, backward recomputes)"),
    "bf16 decode, ALiBi": (dict(T=1, S=50, dtype=torch.bfloat16), dict(causal=True, alibi_slopes=torch.ones(4)), False,
                           KERNEL or "math blocks, float32 matmuls"),
    "bf16 decode, a mask": (dict(T=1, S=50, dtype=torch.bfloat16), dict(causal=True, mask=torch.ones(1, 50, dtype=torch.bool)), False,
                            HEAD_ROWS),
    "bf16 decode, training": (dict(T=1, S=50, dtype=torch.bfloat16, grad=True), dict(causal=True), True,
                              "sdpa, each key head's query heads as rows"),
    "bf16 prompt": (dict(T=30, dtype=torch.bfloat16), dict(causal=True), False, "sdpa is_causal"),
    "window": (dict(T=100), dict(causal=True, window=16), False, "sdpa window blocks of 64 queries"),
    "window, one block": (dict(T=64), dict(causal=True, window=16), False, "sdpa"),
    "window over every key": (dict(T=100), dict(causal=True, window=100), False, PROMPT),
    "window, trained": (dict(T=100), dict(causal=True, window=16), True, "sdpa window blocks of 64 queries"),
    "padding": (dict(T=30), dict(causal=True, attention_mask=torch.arange(30).expand(2, 30) > 3), False, "sdpa"),
    "softcap": (dict(T=30), dict(causal=True, softcap=50.0), False, "capped blocks (tanh through expm1, backward recomputes)"),
    "softcap, dropout": (dict(T=30), dict(causal=True, softcap=50.0, dropout_p=0.2), True, "math blocks"),
    "sinks": (dict(T=30), dict(causal=True, sinks=torch.randn(4)), False, "sdpa flash kernel, sink through its log-sum-exp"),
    "sinks, dropout": (dict(T=30), dict(causal=True, sinks=torch.randn(4), dropout_p=0.2), True, "math blocks"),
    "ALiBi": (dict(T=30), dict(causal=True, alibi_slopes=torch.rand(4)), False, "sdpa ALiBi blocks"),
    "documents": (dict(B=1, T=40), dict(causal=True, documents=documents_from_cu_seqlens(torch.tensor([0, 10, 40]))), False,
                  "per document, each on sdpa's rules"),
    "documents not in runs": (dict(B=1, T=6), dict(causal=True, documents=torch.tensor([[0, 1, 0, 1, 0, 1]])), False, "sdpa"),
    "T < S": (dict(T=5, S=40), dict(), False, "sdpa"),
    "T > S, causal": (dict(T=8, S=3), dict(causal=True), False, "sdpa"),
    "float64": (dict(T=100, dtype=torch.float64), dict(causal=True), False, PROMPT),
    "float64, plain": (dict(T=10, dtype=torch.float64), dict(), False, "sdpa"),
    "cache": (dict(B=1, T=1), dict(causal=True, cache="kv"), False, KERNEL or "sdpa"),
    "bf16 cache": (dict(B=1, T=1, dtype=torch.bfloat16), dict(causal=True, cache="kv"), False,
                   KERNEL or "sdpa, each key head's query heads as rows"),
    "ring cache": (dict(B=1, T=1), dict(causal=True, window=8, cache="ring"), False, KERNEL or "sdpa"),
    "paged batch": (dict(B=1, T=4), dict(causal=True, cache="paged"), False,  # sequences of 1 and 3 new tokens
                    f"per sequence: {ROWS_IN_ONE_CALL} (C++ kernel); sdpa" if KERNEL else "sdpa"),
}


def _call(case: str):
    shape, kw, grad, _ = CASES[case]
    q, k, v = _qkv(**shape)
    kw = dict(kw)
    if "cache" in kw:
        make = _cache(kw["cache"], q.dtype)
        kw["cache"] = make
    return q, k, v, kw, grad


def _attend(q, k, v, kw, grad, **extra):
    kw = {**kw, **extra}
    if "cache" in kw:
        kw["cache"] = kw["cache"]()
    torch.manual_seed(7)  # the same dropout draws for both calls
    with torch.set_grad_enabled(grad):
        return hw.attention(q, k, v, **kw)


@pytest.mark.parametrize("case", CASES)
def test_the_plan_names_the_runner_and_its_backend_reproduces_the_default_bit_for_bit(case):
    q, k, v, kw, grad = _call(case)
    plan_kw = {**kw, "cache": kw["cache"]()} if "cache" in kw else kw
    with torch.set_grad_enabled(grad):
        plan = hw.plan(q, k, v, **plan_kw)
    assert plan.runner == CASES[case][3]
    mixed = plan.runner.startswith("per sequence: ")  # a paged batch's sequences on different runners: "auto" reruns them
    assert plan.backend == "auto" if mixed else plan.backend in ("math", "sdpa")
    assert plan.reason and "\n" not in str(plan)
    assert str(plan).startswith(plan.runner) and plan.reason in str(plan)
    if "cache" in kw:  # two caches with the same prefix: one for each call
        default = _attend(q, k, v, {**kw, "cache": _cache(CASES[case][1]["cache"], q.dtype)}, grad)
        chosen = _attend(q, k, v, {**kw, "cache": _cache(CASES[case][1]["cache"], q.dtype)}, grad, backend=plan.backend)
    else:
        default, chosen = _attend(q, k, v, kw, grad), _attend(q, k, v, kw, grad, backend=plan.backend)
    assert torch.equal(default, chosen)
    with torch.set_grad_enabled(grad):
        again = hw.plan(q, k, v, **{**plan_kw, "backend": plan.backend})
    assert again.runner == plan.runner


def test_a_plan_writes_nothing_to_a_cache():
    q, k, v = _qkv(B=1, T=3)
    cache = hw.KVCache(1, 2, 8, 16)
    assert hw.plan(q, k, v, causal=True, cache=cache).runner == "sdpa is_causal"
    assert len(cache) == 0
    paged = hw.PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=16)
    paged.add(0)
    hw.plan(q, k, v, causal=True, cache=paged.batch([0], [3]))
    assert paged.length(0) == 0 and paged.free_blocks == 4


def test_a_cache_that_holds_padding_plans_as_its_run_will():
    q, k, v = _qkv(B=1, T=4)
    cache = hw.KVCache(1, 2, 8, 16)
    hw.attention(q, k, v, causal=True, cache=cache, attention_mask=torch.tensor([[False, True, True, True]]))
    step = _qkv(B=1, T=4, seed=3)
    assert hw.plan(*step, causal=True, cache=cache).runner == "sdpa"  # the cache hands on its padding: a mask, not is_causal


def test_while_observed_auto_and_math_plan_every_step_whole():
    q, k, v = _qkv(T=8)
    with hw.observe(lambda name, t: None):
        assert hw.plan(q, k, v, causal=True).runner == "math, every step whole"
        assert hw.plan(q, k, v, causal=True, backend="math").runner == "math, every step whole"
        assert hw.plan(q, k, v, causal=True, backend="sdpa").runner == "sdpa is_causal"


def test_attention_runs_what_the_table_says(monkeypatch):
    """Change the table and attention changes: it has no other way of choosing."""
    q, k, v = _qkv(T=8)
    marker = plan_table.Rule("marker", "sdpa", plan_table.EVERY, lambda c: True, lambda c: lambda q, k, v, spec: torch.full_like(q, 7.0), "a test")
    monkeypatch.setattr(plan_table, "RULES", (marker,))
    assert torch.equal(hw.attention(q, k, v, causal=True), torch.full_like(q, 7.0))
    assert hw.plan(q, k, v).runner == "marker"


def test_every_backend_has_a_last_rule_that_takes_any_call():
    for backend in ("auto", "math", "sdpa"):
        last = [rule for rule in plan_table.RULES if backend in rule.serves][-1]
        assert last.when(None), backend  # its predicate reads nothing


def test_a_module_plans_its_next_call():
    torch.manual_seed(0)
    mha = hw.MultiHeadAttention(32, 32, 512, 0.0, num_heads=4).eval()
    x = torch.randn(1, 200, 32)
    with torch.no_grad():
        assert mha.plan(x).runner == PROMPT
        cache = hw.KVCache(1, 4, 256, 8)
        mha(x, cache=cache)
        assert mha.plan(x[:, :1], cache=cache).runner == (KERNEL or "sdpa") and len(cache) == 200
    assert mha.plan(x).runner == "sdpa is_causal"  # with autograd: one kernel call
    bf16 = hw.MultiHeadAttention(32, 32, 512, 0.0, num_heads=4, softcap=30.0).eval().to(torch.bfloat16)
    assert "capped blocks" in str(bf16.plan(x.to(torch.bfloat16)))
    cross = hw.MultiHeadAttention(32, 32, 512, 0.0, num_heads=4, causal=False, kv_dim=6).eval()
    assert cross.plan(x, context=torch.randn(1, 9, 6)).runner == "sdpa"


def test_plan_refuses_what_attention_refuses():
    q, k, v = _qkv(T=4)
    with pytest.raises(ValueError, match=r"softcap must be a number"):
        hw.plan(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'math', 'sdpa'\], got 'fast'"):
        hw.plan(q, k, v, backend="fast")
    with pytest.raises(ValueError, match=r"mask must broadcast to \(B, H, T, S\) = \(2, 4, 4, 4\)"):
        hw.plan(q, k, v, mask=torch.ones(3, 3, dtype=torch.bool))


def test_float32_matmuls_follow_the_rows_per_key_head():
    """The math runners' float32 matmuls for half decode shapes on the CPU: at most FLOAT32_ROWS rows per key head."""
    k = torch.zeros(1, 2, 10, 8, dtype=torch.bfloat16)
    assert plan_table.float32_keys(torch.zeros(1, 8, 2, 8, dtype=torch.bfloat16), k, 2) == plan_table.FLOAT32_KEY_ELEMENTS  # 4 * 2
    assert plan_table.float32_keys(torch.zeros(1, 8, 3, 8, dtype=torch.bfloat16), k, 3) is None  # 12 rows
    assert plan_table.float32_keys(torch.zeros(1, 8, 1, 8), k.float(), 1) is None  # float32 already


PADDED = torch.arange(300).expand(3, 300) >= torch.tensor([[0], [120], [300]])  # (B, S): row 1 left-padded, row 2 sees no key


@pytest.mark.parametrize("on_mkl", [True, False])
@pytest.mark.parametrize(("Hkv", "terms"), [(4, {}), (4, {"attention_mask": PADDED}), (2, {"attention_mask": PADDED}), (4, {"window": 64}),
                                           (2, {"window": 64, "attention_mask": PADDED})], ids=["G=1", "G=1 padded", "G=2 padded", "G=1 window",
                                                                                              "G=2 window padded"])
def test_a_bf16_decode_step_takes_the_fused_kernel_where_its_gemms_are_mkls_or_with_the_row_twice(monkeypatch, on_mkl, Hkv, terms):
    """Where the C++ decode kernel does not take the step (a window; or not built); either way the step is as close to
    the float64 reference as the bf16 output allows."""
    monkeypatch.setattr(plan_table, "mkl_avx512", lambda: on_mkl)
    monkeypatch.setattr(decode_kernel, "available", lambda: False)
    q, k, v = _qkv(B=3, H=4, Hkv=Hkv, T=1, S=300, D=64, dtype=torch.bfloat16)
    plan = hw.plan(q, k, v, causal=True, **terms)
    off_mkl = "sdpa, the row twice" if Hkv == 4 else "math blocks, float32 matmuls"  # G = 1: two equal rows of each head
    assert plan.runner == ("sdpa, one row per head on MKL" if on_mkl else off_mkl)
    out = hw.attention(q, k, v, causal=True, **terms)
    assert torch.equal(out, hw.attention(q, k, v, causal=True, backend=plan.backend, **terms))
    want = reference_attention(q, k, v, causal=True, **terms)  # (B, H, 1, D) float64
    assert float((out.double() - want).abs().max()) <= 2 * float(want.abs().max()) * 2**-8  # two bf16 roundings at most
    if "attention_mask" in terms:
        assert not out[2].any()  # a row that sees no key: zeros


@pytest.mark.parametrize("on_mkl", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True], ids=["", "padded"])
def test_a_causal_prompt_is_one_call_where_mkl_runs_its_avx512_kernels_else_blocks(monkeypatch, on_mkl, dtype, padded):
    """A causal prompt, padded (left, right, a row of nothing but padding) or not, as blocks of queries over the keys
    each sees off MKL's AVX-512 kernels (the first block of an unpadded one with is_causal), one call on them. (Heads of
    48, which the C++ prompt kernel does not take.)"""
    monkeypatch.setattr(plan_table, "mkl_avx512", lambda: on_mkl)
    q, k, v = _qkv(B=3, H=4, Hkv=2, T=200, D=48, dtype=dtype)
    real = torch.ones(3, 200, dtype=torch.bool)
    real[0, :70], real[1, 150:], real[2] = False, False, False
    terms = dict(causal=True, attention_mask=real if padded else None)
    plan = hw.plan(q, k, v, **terms)
    assert plan.runner == ("sdpa" if on_mkl and padded else "sdpa is_causal" if on_mkl else "sdpa causal blocks of 64 queries")
    out = hw.attention(q, k, v, **terms)
    want = reference_attention(q, k, v, **terms)  # (B, H, T, D) float64
    assert float((out.double() - want).abs().max()) <= 2 * float(want.abs().max()) * (2**-8 if dtype == torch.bfloat16 else 2**-20)
    if padded:
        assert not out[2].any() and not out[0, :, :70].any()  # queries that see no key: zeros


def test_the_plan_reads_the_machines_mkl_fact_once():
    assert plan_table.mkl_avx512() == machine.mkl_avx512_on(machine.cpu(), torch.backends.mkl.is_available())


def _plan_cases() -> dict:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    mha = lambda **kw: hw.MultiHeadAttention(8, 8, kw.pop("context_length", 64), 0.0, num_heads=2, **kw).eval()  # noqa: E731
    owned, short = mha(), mha(context_length=6)
    held, held6 = hw.KVCache(2, 2, 16, 4), hw.KVCache(2, 2, 16, 4)
    owned(x, cache=held), short(x, cache=held6)
    cross = mha(causal=False, kv_dim=5)
    return {
        "a cache of another layer": (mha(), x, {"cache": held}),
        "cached + new past context_length": (short, torch.randn(2, 3, 8), {"cache": held6}),
        "position_ids of the wrong shape": (owned, x, {"position_ids": torch.zeros(3, 3, dtype=torch.long)}),
        "a context for a causal module": (owned, x, {"context": torch.randn(2, 3, 8)}),
        "a context for ALiBi": (mha(causal=False, alibi=True), x, {"context": torch.randn(2, 3, 8)}),
        "a context and documents": (cross, x, {"context": torch.randn(2, 3, 5), "documents": torch.zeros(2, 3, dtype=torch.long)}),
        "no context for cross-attention": (cross, x, {}),
        "a context of the wrong width": (cross, x, {"context": torch.randn(2, 3, 7)}),
        "a KVCache for cross-attention": (cross, x, {"context": torch.randn(2, 3, 5), "cache": hw.KVCache(2, 2, 8, 4)}),
        "an empty ContextCache": (cross, x, {"cache": hw.ContextCache()}),
        "a context_mask of the wrong shape": (cross, x, {"context": torch.randn(2, 3, 5), "context_mask": torch.ones(2, 4, dtype=torch.bool)}),
    }


@pytest.mark.parametrize("case", list(_plan_cases()))
def test_a_modules_plan_refuses_what_its_forward_refuses_with_the_same_error(case):
    cases = _plan_cases()  # held while the test runs: a cache's owner is held weakly
    module, x, kwargs = cases[case]
    with pytest.raises((TypeError, ValueError)) as refused:
        module(x, **kwargs)
    with pytest.raises(type(refused.value), match=re.escape(str(refused.value))):
        module.plan(x, **kwargs)


def test_a_modules_plan_takes_a_context_mask_as_its_forward_does():
    torch.manual_seed(0)
    cross = hw.MultiHeadAttention(8, 8, 64, 0.0, num_heads=2, causal=False, kv_dim=5).eval()
    x, context, padding = torch.randn(2, 4, 8), torch.randn(2, 3, 5), torch.tensor([[True, True, False], [True, True, True]])
    shown = cross.plan(x, context=context, context_mask=padding)  # (a TypeError before: plan took no context_mask)
    assert isinstance(shown, hw.Plan)
    with torch.no_grad():  # the plan's backend runs the call forward runs, bit for bit
        assert torch.equal(cross(x, context=context, context_mask=padding), _with_backend(cross, shown.backend)(x, context=context, context_mask=padding))


def _with_backend(module, backend):
    copy_ = copy.deepcopy(module)
    copy_.backend = backend
    return copy_


@pytest.mark.parametrize("cache", ["batch", "full", "head size", "used paged batch", "pool exhausted"])
def test_plan_runs_a_caches_checks_as_attention_does_and_writes_nothing(cache):
    torch.manual_seed(0)
    q = k = v = torch.randn(2, 2, 5, 8)
    if cache in ("used paged batch", "pool exhausted"):
        pool = hw.PagedKVCache(2 if cache == "pool exhausted" else 8, 2, 2, 8)
        pool.add(0)
        made = pool.batch([0], [5])
        if cache == "used paged batch":
            hw.attention(q[:1], k[:1], v[:1], causal=True, cache=made)
        q = k = v = q[:1]
        before = (pool.length(0), pool.free_blocks)
        state = lambda: (pool.length(0), pool.free_blocks)  # noqa: E731
    else:
        made = {"batch": hw.KVCache(3, 2, 16, 8), "full": hw.KVCache(2, 2, 4, 8), "head size": hw.KVCache(2, 2, 16, 9)}[cache]
        before = len(made)
        state = lambda: len(made)  # noqa: E731
    with pytest.raises(ValueError) as refused:
        hw.attention(q, k, v, causal=True, cache=made)
    assert state() == before
    with pytest.raises(ValueError, match=re.escape(str(refused.value))):
        hw.plan(q, k, v, causal=True, cache=made)
    assert state() == before


def test_architectures_plan_table_lists_every_rule_in_order():
    """ARCHITECTURE.md's plan table is the rules as the code has them: each rule's runner and backend, in RULES's order."""
    import pathlib

    text = (pathlib.Path(__file__).parents[1] / "ARCHITECTURE.md").read_text()
    table = text[text.index("| runner | backend | serves | when |"):].split("\n\n")[0]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:] if line.startswith("|")]
    assert [(name.strip(), backend.strip()) for name, backend in rows] == [(r.runner, r.backend) for r in plan_table.RULES]
