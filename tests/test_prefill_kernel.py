"""The C++ prefill kernel (``backends.prefill_kernel``): its op against the float64 reference over the shapes a prompt
takes (GQA, causal over a cache's earlier keys, tails of query and key blocks, strided views), the calls it takes and
refuses, and what the plan gives it on machines it is for and not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from reference_variants import variant_attention

import headwise as hw
from headwise.backends import plan, prefill_kernel, sdpa, softcap
from headwise.backends.spec import Spec

pytestmark = pytest.mark.skipif(not prefill_kernel.available(), reason="the C++ kernels could not be built here")


def _qkv(B, H, Hkv, T, S, D, dtype, seed=0):
    """q (B, H, T, D) a transposed view (as split heads are), k and v views of a cache with room for 5 more keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, S + 5, D, generator=g).to(dtype)[:, :, :S]
    v = torch.randn(B, Hkv, S + 5, D, generator=g).to(dtype)[:, :, :S]
    return q, k, v


def _error(got, want):
    return float((got.double() - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "B,H,Hkv,T,S,D,causal",
    [(1, 12, 12, 300, 300, 64, True), (2, 8, 2, 65, 65, 128, True), (1, 4, 1, 37, 200, 64, True), (1, 3, 3, 2, 2, 64, True),
     (2, 6, 3, 130, 71, 64, False), (1, 2, 2, 64, 64, 128, False), (1, 4, 4, 7, 1000, 128, True), (2, 4, 2, 100, 150, 256, True),
     (1, 2, 1, 70, 70, 256, False), (3, 4, 4, 90, 90, 32, False), (1, 4, 2, 130, 130, 80, True), (2, 4, 1, 70, 150, 96, True)],
    ids=["GPT-2 heads, a prompt", "GQA 4, D=128, a block and one", "a chunk after 163 cached keys", "two rows",
         "every key, S < T", "one block exactly", "a short chunk after a long cache", "D=256 (Gemma's), a chunk", "D=256, every key",
         "D=32 (MiniLM's), every key", "D=80 (Phi-2's), a prompt", "D=96 (Phi-3's), a chunk"],
)
def test_the_op_gives_the_references_numbers(dtype, B, H, Hkv, T, S, D, causal):
    """As close to float64 as torch's own fused kernel gets on the same call (in float32: float32 sums; in bfloat16: the
    one rounding of the context), bottom-right causal as headwise's caches place queries."""
    q, k, v = _qkv(B, H, Hkv, T, S, D, dtype)
    out = prefill_kernel.run(q, k, v, Spec(T=T, S=S, causal=causal, scale=D**-0.5))
    want = variant_attention(q, k, v, causal=causal)  # (B, H, T, D) float64
    assert out.shape == (B, H, T, D) and out.dtype == dtype and out.transpose(1, 2).is_contiguous()  # the heads' merge a view
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
    G = H // Hkv
    torchs = F.scaled_dot_product_attention(q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask)
    assert _error(out, want) <= max(1.5 * _error(torchs, want), 2e-6 if dtype == torch.float32 else 4e-3)


SINKS = torch.tensor([0.5, -1.0, 3.0, -30.0, 2.0, 0.0, 1.0, 9.0])  # a head's logit beside its keys' (-30: next to none)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 31, 129])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize(
    "B,H,Hkv,T,S,D", [(1, 4, 4, 300, 300, 64), (2, 8, 2, 65, 65, 128), (1, 4, 1, 37, 200, 64), (1, 4, 4, 130, 500, 64), (1, 2, 1, 90, 90, 256)],
    ids=["a prompt", "GQA 4, D=128, a block and one", "a chunk after 163 cached keys", "a chunk after 370", "D=256"],
)
def test_a_window_and_sinks_give_the_references_numbers(dtype, window, sinks, B, H, Hkv, T, S, D):
    """Each query over its last ``window`` keys only (blocks of queries start at their first query's window, score tiles
    before it are skipped), and a sink logit a head joining each row's softmax (the context divided once by the keys'
    and the sink's sum): as close to float64 as torch's kernel under the same mask (its sinks through its log-sum-exp,
    ``sdpa.masked_blocks``); in bfloat16 the reference rounded once in all but a few ties."""
    q, k, v = _qkv(B, H, Hkv, T, S, D, dtype)
    sink = SINKS[:H] if sinks else None
    spec = Spec(T=T, S=S, causal=True, window=window, sinks=sink, scale=D**-0.5)
    out = prefill_kernel.run(q, k, v, spec)
    want = variant_attention(q, k, v, causal=True, window=window, sinks=sink)  # (B, H, T, D) float64
    torchs = sdpa.masked_blocks(q, k, v, spec, rows=64)  # (B, H, T, D)
    assert _error(out, want) <= max(1.5 * _error(torchs, want), 2e-6 if dtype == torch.float32 else 4e-3)
    if dtype == torch.bfloat16:
        assert float((out != want.bfloat16()).float().mean()) < 1e-3


def _padding(B, S, pattern):
    """(B, S) bool, False = a padded key: each row's first b * S // 5 keys (left), last ones (right), runs in the middle
    (holes), or the last row with no real key (empty)."""
    real = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        n = (b + 1) * S // 5
        if pattern == "left":
            real[b, :n] = False
        elif pattern == "right":
            real[b, S - n :] = False
        else:
            real[b, 3 + b :: 7] = False
            real[b, S // 3 : S // 3 + n] = False
    if pattern == "empty":
        real[-1] = False
    return real


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["left", "right", "holes", "empty"])
@pytest.mark.parametrize(
    "B,H,Hkv,T,S,D,causal,window,sinks",
    [(3, 4, 2, 150, 150, 64, True, None, False), (2, 4, 4, 70, 200, 128, True, None, False), (2, 4, 1, 140, 140, 64, True, 31, True),
     (2, 2, 2, 80, 100, 64, False, None, False), (3, 4, 4, 9, 130, 64, True, 40, False), (2, 2, 1, 70, 70, 256, True, None, False),
     (3, 4, 4, 100, 100, 32, False, None, False), (2, 4, 2, 90, 90, 80, True, 33, True)],
    ids=["a prompt, GQA", "a chunk after 130 cached keys, D=128", "a window and sinks", "every key", "a short chunk, a window", "D=256",
         "D=32, every key (a padded batch of sentences)", "D=80, a window and sinks"],
)
def test_padded_keys_give_the_references_numbers(dtype, pattern, B, H, Hkv, T, S, D, causal, window, sinks):
    """Padding before a row's first real key (not read), after its last (not read) and between (masked), every real key
    seen: as close to float64 as torch's kernel under the same mask; a query that sees no real key gets zeros."""
    q, k, v = _qkv(B, H, Hkv, T, S, D, dtype)
    real = _padding(B, S, pattern)
    sink = SINKS[:H] if sinks else None
    out = prefill_kernel.run(q, k, v, Spec(T=T, S=S, causal=causal, window=window, sinks=sink, attention_mask=real, scale=D**-0.5))
    want = variant_attention(q, k, v, causal=causal, window=window, sinks=sink, attention_mask=real)  # (B, H, T, D) float64
    allowed = real[:, None, None, :].expand(B, 1, T, S).clone()  # (B, 1, T, S)
    if causal:
        allowed &= torch.ones(T, S, dtype=torch.bool).tril(S - T)
    if window is not None:
        allowed &= torch.ones(T, S, dtype=torch.bool).triu(S - T - window + 1)
    seen = allowed.any(-1, keepdim=True)  # (B, 1, T, 1): rows that see a key
    torchs = sdpa.masked_blocks(q, k, v, Spec(T=T, S=S, causal=causal, window=window, sinks=sink, attention_mask=real, scale=D**-0.5), rows=64)
    assert torch.equal(out.masked_select(~seen), torch.zeros_like(out).masked_select(~seen))
    assert (pattern != "empty") or not bool(seen[-1].any())
    got, ref, theirs = (x.masked_fill(~seen, 0) for x in (out.double(), want, torchs.double()))
    assert _error(got, ref) <= max(1.5 * _error(theirs, ref), 2e-6 if dtype == torch.float32 else 4e-3)
    k_nan, v_nan = k.clone(), v.clone()  # whatever a padded key and value hold reaches no row
    k_nan.transpose(1, 2)[~real], v_nan.transpose(1, 2)[~real] = float("nan"), float("nan")
    dirty = prefill_kernel.run(q, k_nan, v_nan, Spec(T=T, S=S, causal=causal, window=window, sinks=sink, attention_mask=real, scale=D**-0.5))
    assert torch.equal(dirty, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cap", [1e-6, 0.5, 5.0, 50.0, 1e30])
@pytest.mark.parametrize(
    "B,H,Hkv,T,S,D,window,padded",
    [(2, 4, 2, 150, 150, 64, None, False), (1, 4, 4, 70, 200, 256, 40, False), (3, 2, 1, 90, 90, 128, None, True),
     (1, 4, 2, 80, 80, 96, None, False)],
    ids=["a prompt, GQA", "a windowed chunk, D=256 (Gemma 2's)", "padded, D=128", "D=96"],
)
def test_a_softcap_gives_the_references_numbers(dtype, cap, B, H, Hkv, T, S, D, window, padded):
    """Scores taken to cap * tanh(score / cap) (Gemma 2's 50; 0.5, where most scores saturate; the ends of the range taken, 1e-6
    and 1e30): as close to float64 as
    the capped blocks (tanh through expm1) that take such prompts elsewhere; in bfloat16 the reference rounded once in
    all but a few ties."""
    q, k, v = _qkv(B, H, Hkv, T, S, D, dtype, seed=11)
    q = (q.float() * 2).to(dtype)  # scores up to ~7: both sides of tanh's two ways (|x| < 0.4 and above)
    real = _padding(B, S, "left") if padded else None
    spec = Spec(T=T, S=S, causal=True, window=window, softcap=cap, attention_mask=real, scale=D**-0.5)
    out = prefill_kernel.run(q, k, v, spec)
    want = variant_attention(q, k, v, causal=True, window=window, softcap=cap, attention_mask=real)  # (B, H, T, D) float64
    theirs = softcap.run(q, k, v, spec, block_elements=plan.BLOCK_ELEMENTS)  # (B, H, T, D)
    seen = torch.ones(B, 1, T, 1, dtype=torch.bool) if real is None else (real.cumsum(-1) > 0)[:, None, -T:, None]
    got, ref, them = (x.double().masked_fill(~seen, 0) for x in (out, want, theirs))
    assert _error(got, ref) <= max(1.5 * _error(them, ref), 2e-6 if dtype == torch.float32 else 4e-3)
    if dtype == torch.bfloat16:
        assert float((got != ref.bfloat16().double()).float().mean()) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slopes", ["H", "BH"], ids=["the model's slopes", "a row's own"])
@pytest.mark.parametrize(
    "B,H,Hkv,T,S,D,causal,terms",
    [(2, 8, 2, 150, 150, 64, True, {}), (2, 4, 4, 70, 70, 128, False, {}), (2, 4, 1, 40, 200, 64, True, {"window": 31, "softcap": 5.0}),
     (2, 4, 2, 90, 90, 80, True, {"padded": True, "sinks": True})],
    ids=["a prompt, GQA", "every key, D=128", "a chunk after cached keys, a window, a softcap", "padded, sinks, D=80"],
)
def test_alibi_gives_the_references_numbers(dtype, slopes, B, H, Hkv, T, S, D, causal, terms):
    """ALiBi (BLOOM's, MPT's): each score less slope * |the query's position - the key's|, after a softcap, with the other
    terms: as close to float64 as torch's kernel over the same bias (the ALiBi blocks that take such prompts elsewhere)."""
    q, k, v = _qkv(B, H, Hkv, T, S, D, dtype, seed=17)
    g = torch.Generator().manual_seed(5)
    alibi = (torch.rand(H, generator=g) if slopes == "H" else torch.rand(B, H, generator=g)) * 0.3
    real = _padding(B, S, "left") if terms.get("padded") else None
    sink = SINKS[:H] if terms.get("sinks") else None
    kw = dict(causal=causal, window=terms.get("window"), softcap=terms.get("softcap"), sinks=sink, attention_mask=real)
    spec = Spec(T=T, S=S, **kw, alibi=alibi.view(-1, H), scale=D**-0.5)
    out = prefill_kernel.run(q, k, v, spec)
    want = variant_attention(q, k, v, **kw, alibi_slopes=alibi)  # (B, H, T, D) float64
    theirs = (softcap.run(q, k, v, spec, block_elements=plan.BLOCK_ELEMENTS) if spec.softcap is not None
              else sdpa.masked_blocks(q, k, v, spec, rows=64))  # (B, H, T, D)
    seen = torch.ones(B, 1, T, 1, dtype=torch.bool) if real is None else (real.cumsum(-1) > 0)[:, None, -T:, None]
    got, ref, them = (x.double().masked_fill(~seen, 0) for x in (out, want, theirs))
    assert _error(got, ref) <= max(1.5 * _error(them, ref), 2e-6 if dtype == torch.float32 else 4e-3)


def test_tanh_in_the_kernel_is_within_a_few_ulps():
    """The kernel's tanh (softcap 1) over scores from -30 to 30 (and 0, +-1e-30, either side of 0.4 where its two ways
    meet), each read back from queries over two keys, of scores s and 0, as log(w0 / w1) = tanh(s): against float64."""
    s = torch.linspace(-30, 30, 4001, dtype=torch.float64)
    s = torch.cat([s, torch.tensor([0.0, 1e-30, -1e-30, 0.39999, 0.40001, -0.4])])
    n = s.numel()
    # one query of ones, one key per row: key 0 has score s (q . k = s with q = e0 * 8, k = e0 * s / 8, scale 1), key 1
    # score 0; values (1, 0, ...) and (0, 1, ...): the context is (w0, w1) = softmax(tanh(s), 0)
    q = torch.zeros(n, 1, 8, 64)
    q[..., 0] = 8.0
    k = torch.zeros(n, 1, 2, 64)
    k[:, 0, 0, 0] = (s / 8).float()
    v = torch.zeros(n, 1, 2, 64)
    v[:, 0, 0, 0], v[:, 0, 1, 1] = 1.0, 1.0
    out = prefill_kernel.run(q, k, v, Spec(T=8, S=2, causal=False, softcap=1.0, scale=1.0))[:, 0, 0, :2].double()  # (n, 2)
    logits = torch.log(out[:, 0] / out[:, 1])  # tanh(s) - 0, as the kernel's softmax held it
    want = torch.tanh(k[:, 0, 0, 0].double() * 8)
    assert float((logits - want).abs().max()) < 4e-7  # a few ulps of numbers up to 1, plus the softmax's own rounding


def test_a_windowed_row_reads_no_key_before_its_window():
    """Keys and values before position 100 - W + 1 hold NaN: rows from 100 on (whose windows start past them) are as over
    finite keys, bit for bit, in blocks and tiles that start before them."""
    W = 20
    q, k, v = _qkv(1, 2, 2, 200, 200, 64, torch.float32)
    spec = Spec(T=200, S=200, causal=True, window=W, scale=0.125)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, : 100 - W + 1], v_nan[:, :, : 100 - W + 1] = float("nan"), float("nan")
    clean, dirty = prefill_kernel.run(q, k, v, spec), prefill_kernel.run(q, k_nan, v_nan, spec)
    assert torch.equal(dirty[:, :, 100:], clean[:, :, 100:]) and not clean.isnan().any()
    assert dirty[:, :, : 100 - W + 1].isnan().all()


@pytest.mark.parametrize("causal,T,S,D", [(False, 126, 9, 128), (True, 172, 507, 128), (False, 201, 374, 128), (True, 150, 300, 256),
                                          (True, 140, 140, 80), (False, 99, 200, 96)])
def test_large_scores_over_a_wide_head_stay_at_float32s_error(causal, T, S, D):
    """Queries 3x the keys' scale over D = 80 to 256 (scores up to ~10): each score summed over spans of the head, as a
    blocked GEMM does, keeps the error at torch's kernel's (a single chain over 128 products gave 2.8x it)."""
    q, k, v = _qkv(2, 12, 3, T, S, D, torch.float32, seed=13)
    q = q * 3
    out = prefill_kernel.run(q, k, v, Spec(T=T, S=S, causal=causal, scale=D**-0.5))
    want = variant_attention(q, k, v, causal=causal)
    mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None
    torchs = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1), attn_mask=mask)
    assert _error(out, want) <= max(2 * _error(torchs, want), 1e-6)


ROUNDED_CASES = ((1, 12, 300, 64, True, 1.0), (2, 4, 130, 128, False, 3.0), (1, 3, 77, 64, True, 3.0), (1, 4, 90, 80, True, 3.0),
                 (2, 4, 70, 32, False, 1.0))


def _rounded_case(B, H, T, D, causal, s):
    q, k, v = _qkv(B, H, H, T, T, D, torch.bfloat16, seed=T)
    return (q.float() * s).bfloat16(), k, v  # queries s times the keys' scale: larger scores


def rounded_outputs() -> dict[str, torch.Tensor]:
    """The op over bfloat16 prompts (``ROUNDED_CASES``), by case."""
    return {str(case): prefill_kernel.run(*_rounded_case(*case), Spec(T=case[2], S=case[2], causal=case[4], scale=case[3] ** -0.5))
            for case in ROUNDED_CASES}


def test_bfloat16_outputs_are_the_reference_rounded_once_but_for_a_few(tmp_path):
    """In bfloat16 each output is the float64 reference rounded once to bfloat16 in all but a few ties (< 0.1%; torch's own
    kernel, which rounds the weights to bfloat16 before the context, misses a quarter or more): the scores' float32 sums
    by AVX512-BF16's pair products where the CPU has them, and widened to float32 on the AVX2 build, both that close."""
    builds = {"this build": rounded_outputs()}
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        from helpers import outputs_under_avx2

        builds["the AVX2 build"] = outputs_under_avx2("test_prefill_kernel", "rounded_outputs", tmp_path)
    for build, outputs in builds.items():
        for case in ROUNDED_CASES:
            want = variant_attention(*_rounded_case(*case), causal=case[4]).bfloat16()  # (B, H, T, D): the reference, rounded once
            missed = float((outputs[str(case)] != want).float().mean())
            assert missed < 1e-3, (build, case, missed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_causal_row_reads_nothing_past_its_own_position(dtype):
    """Keys and values from position 42 on hold NaN: rows 0..41 (in the same blocks and tiles of queries and keys as the NaN
    rows) are the same as over finite keys there, bit for bit; the later rows see NaN."""
    q, k, v = _qkv(1, 2, 2, 70, 70, 64, dtype)
    spec = Spec(T=70, S=70, causal=True, scale=0.125)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, 42:], v_nan[:, :, 42:] = float("nan"), float("nan")
    clean, dirty = prefill_kernel.run(q, k, v, spec), prefill_kernel.run(q, k_nan, v_nan, spec)
    assert torch.equal(dirty[:, :, :42], clean[:, :, :42]) and not clean.isnan().any()
    assert dirty[:, :, 42:].isnan().all()


def test_what_it_takes_and_refuses(monkeypatch):
    monkeypatch.setattr(prefill_kernel, "_MACHINE", True)
    monkeypatch.setattr(prefill_kernel, "_AMX", False)
    q, k, v = _qkv(1, 4, 2, 16, 16, 64, torch.float32)
    spec = Spec(T=16, S=16, causal=True, scale=0.125)
    assert prefill_kernel.takes(q, k, v, spec)
    assert prefill_kernel.takes(q.bfloat16(), k.bfloat16(), v.bfloat16(), spec)
    rows = prefill_kernel.FEWEST_ROWS
    assert prefill_kernel.takes(q[:, :, :rows], k, v, Spec(T=rows, S=16, causal=True))
    assert prefill_kernel.takes(q, k, v, Spec(T=16, S=16, causal=True, window=4))
    assert prefill_kernel.takes(q, k, v, Spec(T=16, S=16, causal=True, window=4, sinks=torch.zeros(4)))
    assert prefill_kernel.takes(q, k, v, Spec(T=16, S=16, causal=True, attention_mask=torch.ones(1, 16, dtype=torch.bool)))
    assert prefill_kernel.takes(q, k, v, Spec(T=16, S=16, causal=True, softcap=30.0))
    assert prefill_kernel.takes(q, k, v, Spec(T=16, S=16, causal=True, alibi=torch.ones(1, 4)))
    refused = {
        "one row (a decode step)": (q[:, :, :1], k, v, Spec(T=1, S=16, causal=True)),
        "fewer rows than FEWEST_ROWS": (q[:, :, : prefill_kernel.FEWEST_ROWS - 1], k, v, Spec(T=prefill_kernel.FEWEST_ROWS - 1, S=16, causal=True)),
        "float16": (q.half(), k.half(), v.half(), spec),
        "mixed dtypes": (q, k.bfloat16(), v.bfloat16(), spec),
        "D = 48": (q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), spec),
        "D = 72": (torch.randn(1, 4, 16, 72), torch.randn(1, 2, 16, 72), torch.randn(1, 2, 16, 72), spec),
        "a window without causal": (q, k, v, Spec(T=16, S=16, window=4)),
        "sinks wanting a gradient": (q, k, v, Spec(T=16, S=16, causal=True, sinks=torch.zeros(4, requires_grad=True))),
        "ALiBi slopes wanting a gradient": (q, k, v, Spec(T=16, S=16, causal=True, alibi=torch.ones(1, 4, requires_grad=True))),
        "dropout": (q, k, v, Spec(T=16, S=16, causal=True, dropout_p=0.1)),
        "causal over fewer keys than queries": (q, k[:, :, :8], v[:, :, :8], Spec(T=16, S=8, causal=True)),
        "strided rows": (q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, spec),
        "autograd": (q.clone().requires_grad_(True), k, v, spec),
    }
    for name, (q_, k_, v_, s_) in refused.items():
        assert not prefill_kernel.takes(q_, k_, v_, s_), name
    monkeypatch.setattr(prefill_kernel, "_AMX", True)  # torch's kernel multiplies bfloat16 in AMX tiles there
    assert prefill_kernel.takes(q, k, v, spec) and not prefill_kernel.takes(q.bfloat16(), k.bfloat16(), v.bfloat16(), spec)
    monkeypatch.setattr(prefill_kernel, "_MACHINE", False)  # an Intel CPU (MKL's AVX-512 GEMMs), or AVX2 kernels
    assert not prefill_kernel.takes(q, k, v, spec)


@pytest.mark.parametrize("machine", [True, False])
def test_the_plan_gives_a_prompt_to_it_only_on_a_machine_it_is_for(monkeypatch, machine):
    """Where it takes the call, ``attention`` and ``plan`` run it (the same numbers, bit for bit); elsewhere torch's."""
    monkeypatch.setattr(prefill_kernel, "_MACHINE", machine)
    q, k, v = _qkv(1, 12, 12, 200, 200, 64, torch.float32)
    chosen = hw.plan(q, k, v, causal=True)
    assert (chosen.runner == plan.PREFILL_KERNEL) == machine
    got = hw.attention(q, k, v, causal=True)
    assert torch.equal(got, chosen.run(q, k, v, Spec(T=200, S=200, causal=True, scale=0.125)))
    if machine:
        assert torch.equal(got, prefill_kernel.run(q, k, v, Spec(T=200, S=200, causal=True, scale=0.125)))
    with torch.enable_grad():  # a gradient to keep: torch's kernels, whose backward exists
        assert hw.plan(q.clone().requires_grad_(True), k, v, causal=True).runner != plan.PREFILL_KERNEL


def test_a_left_padded_prompt_goes_to_it(monkeypatch):
    """``attention``'s (B, S) padding (a batch of prompts left-padded to one length) runs in the kernel where it is for,
    torch's one masked call elsewhere: the same numbers to float32 rounding, padded queries zeros."""
    q, k, v = _qkv(3, 4, 4, 130, 130, 64, torch.float32)
    real = _padding(3, 130, "left")
    monkeypatch.setattr(prefill_kernel, "_MACHINE", True)
    assert hw.plan(q, k, v, causal=True, attention_mask=real).runner == plan.PREFILL_KERNEL
    ours = hw.attention(q, k, v, causal=True, attention_mask=real)
    monkeypatch.setattr(prefill_kernel, "_MACHINE", False)
    assert hw.plan(q, k, v, causal=True, attention_mask=real).runner != plan.PREFILL_KERNEL
    torchs = hw.attention(q, k, v, causal=True, attention_mask=real)
    want = variant_attention(q, k, v, causal=True, attention_mask=real)
    assert _error(ours, want) <= max(1.5 * _error(torchs, want), 2e-6)
    assert not ours.transpose(1, 2)[~real].any()


def test_a_models_prompt_and_generation_through_it(monkeypatch):
    """A GPT-2's prompt logits and greedy tokens with the kernel equal those with torch's kernels, to float32 rounding."""
    model = hw.models.GPT2LMHeadModel(hw.GPT2Config(vocab_size=101, n_positions=160, n_embd=128, n_layer=2, n_head=2)).eval()
    ids = torch.randint(0, 101, (2, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        monkeypatch.setattr(prefill_kernel, "_MACHINE", True)
        ours, tokens = model(ids), model.generate(ids[:1, :90], max_new_tokens=8)
        monkeypatch.setattr(prefill_kernel, "_MACHINE", False)
        torchs, tokens_torch = model(ids), model.generate(ids[:1, :90], max_new_tokens=8)
    torch.testing.assert_close(ours, torchs, rtol=1e-5, atol=1e-5)
    assert torch.equal(tokens, tokens_torch)
