"""The 8-bit KVCache (dtype=torch.int8): each (token, head) row stored as D int8 values and a float32 scale.

What it stores is checked against a rounding written here with numpy (float32 scale max|x| / 127, x / scale rounded
half to even); what attention answers against float64 attention over those stored rows read back; the C++ decode
step's writes and reads against the Python path's, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import BACKENDS
from hypothesis import given
from hypothesis import strategies as st
from reference_variants import variant_attention

import headwise as hw
from headwise import GPT2Config
from headwise.backends import decode_kernel
from headwise.cache.static import dequantize_rows, quantize_rows
from headwise.models import GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from headwise.quantize import int8_weights as to_int8


def rounded(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(..., D) float32 -> the int8 values and the float32 scale of every row, one row at a time in numpy."""
    rows = x.detach().float().reshape(-1, x.shape[-1]).numpy()
    values, scales = np.zeros(rows.shape, np.int8), np.zeros(len(rows), np.float32)
    for i, row in enumerate(rows):
        top = np.float32(np.nan) if np.isnan(row).any() else np.abs(row).max()
        scale = np.float32(top / np.float32(127))
        scales[i] = scale
        if np.isfinite(scale) and scale > 0:
            values[i] = np.clip(np.rint(row / scale), -127, 127).astype(np.int8)
    return values.reshape(x.shape), scales.reshape(x.shape[:-1])


def read_back(x: torch.Tensor) -> torch.Tensor:
    """What an 8-bit cache answers for keys x: its stored values times their row's scale (a float32 product), as float64."""
    values, scales = rounded(x)
    return torch.from_numpy(values.astype(np.float32) * scales[..., None]).double()


def test_rows_are_rounded_to_their_own_scale_and_read_back():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 7, 64) * torch.logspace(-3, 3, 7)[:, None]  # rows of very different sizes
    x[0, 0, 0] = 0.0  # a row of zeros
    x[0, 0, 1, 5] = 127.5 * x[0, 0, 1].abs().max() / 127  # (one value the largest)
    rows = quantize_rows(x)
    assert rows.shape == (3, 4, 7, 68) and rows.dtype == torch.int8
    values, scales = rounded(x)
    assert torch.equal(rows[..., :64], torch.from_numpy(values))
    assert torch.equal(rows[..., 64:].contiguous().view(torch.float32)[..., 0], torch.from_numpy(scales))
    back = dequantize_rows(rows)
    assert back.dtype == torch.float32 and torch.equal(back.double(), read_back(x))
    assert (back - x).abs().le(torch.from_numpy(scales)[..., None] / 2 * (1 + 1e-6)).all()  # half a step at most
    assert torch.equal(back[0, 0, 0], torch.zeros(64))


@pytest.mark.parametrize("shape", [(1, 6), (6,), (2, 1, 10)])
def test_rows_of_any_width_read_back_one_row_or_many(shape):
    """A lone row's scale sits at an offset of D bytes: read back from a copy of its own (a view of it is misaligned
    for float32 when D is not a multiple of 4)."""
    x = torch.randn(*shape)
    assert torch.equal(dequantize_rows(quantize_rows(x)).double(), read_back(x))


def test_a_row_with_inf_or_nan_reads_back_as_nan_never_as_a_number():
    x = torch.randn(3, 64)
    x[0, 3], x[1, 7] = float("inf"), float("nan")
    back = dequantize_rows(quantize_rows(x))
    assert back[0].isnan().all() and back[1].isnan().all()
    assert torch.equal(back[2].double(), read_back(x[2:])[0])


@pytest.mark.parametrize("D", [64, 128, 80, 8, 20])
@pytest.mark.parametrize("H,Hkv", [(12, 12), (8, 2), (6, 1), (5, 1)])
@pytest.mark.parametrize("padded", [False, True])
def test_the_kernel_reads_8_bit_rows_as_the_rows_read_back(D, H, Hkv, padded):
    if not decode_kernel.available():
        pytest.skip("headwise's C++ kernels are not built here")
    torch.manual_seed(D + H)
    B, S = 2, 77
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    real = (torch.rand(B, S) > 0.3) if padded else None
    k8, v8 = quantize_rows(k), quantize_rows(v)
    got = decode_kernel.dense(q, k8, v8, real, D**-0.5)  # (B, H, 1, D)
    over_floats = decode_kernel.dense(q, dequantize_rows(k8), dequantize_rows(v8), real, D**-0.5)
    assert torch.equal(got, over_floats)  # each value read back as dequantize_rows does, then the same sums
    want = variant_attention(q.double(), read_back(k), read_back(v), causal=False,
                             attention_mask=real)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


TERMS = {
    "plain": {},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
}


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("window,ring", [(None, False), (3, True), (3, False)], ids=["linear", "ring", "window over a linear cache"])
@pytest.mark.parametrize("backend", BACKENDS)
@given(schedule=st.lists(st.integers(1, 4), min_size=1, max_size=5), Hkv=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_attention_over_an_8_bit_cache_is_attention_over_the_rows_it_holds(terms, window, ring, backend, schedule, Hkv, seed):
    """Each step (one token or a few) against float64 attention over the rows the cache holds; a window over a linear
    cache drops the keys before it once the cache holds more (a one-token step included)."""
    torch.manual_seed(seed)
    B, H, D, T = 2, 4, 8, sum(schedule)
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    cache = hw.KVCache.sliding(B, Hkv, window, D, dtype=torch.int8) if ring else hw.KVCache(B, Hkv, T, D, dtype=torch.int8)
    outs, start = [], 0
    for n in schedule:
        part = slice(start, start + n)
        outs.append(hw.attention(*(t[:, :, part] for t in (q, k, v)), causal=True, window=window, cache=cache, backend=backend, **TERMS[terms]))
        start += n
    got = torch.cat(outs, dim=2)  # (B, H, T, D)
    assert got.dtype == torch.float32 and cache.dtype == torch.float32 and cache.k.dtype == torch.int8
    if not ring:
        assert torch.equal(dequantize_rows(cache.k).double(), read_back(k)) and torch.equal(dequantize_rows(cache.v).double(), read_back(v))
    want = variant_attention(q.double(), read_back(k), read_back(v), causal=True, window=window, **TERMS[terms])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)  # float32's tolerance: attention runs in float32


def small_llama(head_dim: int = 64) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=96, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def small_gpt2(head_dim: int = 64) -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=128, n_embd=4 * head_dim, n_layer=2, n_head=4)).eval()


MODELS = {"gpt2": small_gpt2, "llama": small_llama}


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("int8_weights", [False, True, "bf16"], ids=["fp32", "int8-weights", "bf16-model"])
@pytest.mark.parametrize("head_dim", [64, 16])
def test_generate_decode_steps_write_and_read_the_rows_as_the_forward_does(model, int8_weights, head_dim):
    """The flat step (the C++ decode step: rotation, rounding to 8 bits, the kernel over the rows in place; a bfloat16
    model's keys and values widened first) against the checked forward (the rows rounded in Python, attention over them
    read back): the same stored bytes, and the same logits."""
    torch.manual_seed(1)
    m = MODELS[model](head_dim)
    if int8_weights == "bf16":
        m = m.bfloat16()
    elif int8_weights:
        to_int8(m)
    ids = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        mine, theirs = m.new_caches(2, 20, torch.int8), m.new_caches(2, 20, torch.int8)
        assert mine[0].k.dtype == torch.int8 and mine[0].k.shape[-1] == m.attention_layers()[0].head_dim + 4
        token = m(ids, cache=mine, logits_to_keep=1)[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        m(ids, cache=theirs, logits_to_keep=1)
        flat = m.flat_step()
        for _ in range(6):
            got, want = flat(token, None, mine), m(token, cache=theirs)[:, -1]
            assert torch.equal(got, want)
            token = got.argmax(-1, keepdim=True)
        assert not decode_kernel.available() or all(call is not None for *_, call in flat.kernel_calls)  # each layer's step in C++
        for a, b in zip(mine, theirs, strict=True):
            assert len(a) == len(b) == 15
            if head_dim == 64:
                assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        tokens = m.generate(ids, max_new_tokens=6, cache_dtype=torch.int8)
    assert tokens.shape == (2, 15)


def test_an_8_bit_cache_is_a_quarter_of_float32s_bytes_and_a_scale():
    m = small_gpt2(16)
    f32, i8 = m.new_caches(1, 64), m.new_caches(1, 64, torch.int8)
    nbytes = lambda caches: sum(c.k.nbytes + c.v.nbytes for c in caches)  # noqa: E731
    assert nbytes(i8) * 64 == nbytes(f32) * 20  # D = 16: 16 bytes of values and 4 of scale a row, where float32 keeps 64


@pytest.mark.parametrize("held", [0, 3])
def test_a_call_of_no_new_token_answers_an_empty_context_and_writes_nothing(held):
    cache, f32 = hw.KVCache(1, 2, 8, 16, dtype=torch.int8), hw.KVCache(1, 2, 8, 16)
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    for c in (cache, f32):
        hw.attention(q[:, :, :held], k[:, :, :held], v[:, :, :held], causal=True, cache=c)
    stored = cache.k.clone()
    for c in (cache, f32):
        out = hw.attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], causal=True, cache=c)
        assert out.shape == (1, 4, 0, 16) and len(c) == held
    assert torch.equal(cache.k, stored) and quantize_rows(torch.randn(2, 0, 16)).shape == (2, 0, 20)


def test_what_an_8_bit_cache_refuses_is_refused_before_anything_is_written():
    with pytest.raises(ValueError, match=r"dtype=torch.int8 needs a head_dim that is a multiple of 4.*got head_dim=6"):
        hw.KVCache(1, 2, 8, 6, dtype=torch.int8)
    cache = hw.KVCache(1, 2, 8, 4, dtype=torch.int8)
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"the cache holds 8-bit rows of float32 or bfloat16 keys and values; they are torch.float16"):
        hw.attention(q.half(), q.half(), q.half(), causal=True, cache=cache)
    k = torch.randn(1, 2, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"k requires grad: an 8-bit cache rounds what it stores"):
        hw.attention(q, k, k.detach(), causal=True, cache=cache)
    assert len(cache) == 0 and not cache.k.any()
    f16_model = small_gpt2(16).half()
    with pytest.raises(TypeError, match=r"cache_dtype=torch.int8 holds 8-bit rows of float32 or bfloat16 keys and values; they are torch.float16"):
        f16_model.new_caches(1, 8, torch.int8)
    with pytest.raises(TypeError, match=r"cache_dtype=torch.int8 holds 8-bit rows of float32 or bfloat16 keys and values; they are torch.float16"):
        f16_model.new_paged_caches(4, 4, torch.int8)
    with pytest.raises(ValueError, match=r"dtype=torch.int8 needs a head_dim that is a multiple of 4.*got head_dim=6"):
        hw.PagedKVCache(4, 4, 2, 6, dtype=torch.int8)
    from headwise.cache.slot import SlotCache

    with pytest.raises(ValueError, match=r"a SlotCache .* reads float32 or bfloat16 rows"):
        SlotCache(cache, torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_a_one_token_step_reads_the_rows_in_place_as_the_rows_read_back(Hkv, terms, monkeypatch):
    """A step given no padding runs the C++ decode step over the 8-bit rows (a softcap, sinks and ALiBi in the op too);
    one given padding (all real) attends over the rows read back in float32: the same bits at head size 64, and the same
    bytes stored."""
    if not decode_kernel.available():
        pytest.skip("headwise's C++ kernels are not built here")
    torch.manual_seed(Hkv)
    B, H, D, T = 2, 4, 64, 9
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    in_place, read = hw.KVCache(B, Hkv, T, D, dtype=torch.int8), hw.KVCache(B, Hkv, T, D, dtype=torch.int8)
    steps, step_op = [], decode_kernel.step
    monkeypatch.setattr(decode_kernel, "step", lambda *a: steps.append(a[5].dtype) or step_op(*a))
    with torch.no_grad():
        hw.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True, cache=in_place, **TERMS[terms])
        hw.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], causal=True, cache=read, **TERMS[terms])
        for t in range(4, T):
            step = [x[:, :, t : t + 1] for x in (q, k, v)]
            got = hw.attention(*step, causal=True, cache=in_place, **TERMS[terms])  # (B, H, 1, D)
            want = hw.attention(*step, causal=True, cache=read, attention_mask=torch.ones(B, 1, dtype=torch.bool), **TERMS[terms])
            assert torch.equal(got, want)
    assert steps == [torch.int8] * (T - 4)  # the in-place op ran each step without padding, and only then
    assert torch.equal(in_place.k, read.k) and torch.equal(in_place.v, read.v) and len(in_place) == T
    with pytest.raises(ValueError, match=r"cache is full: it holds 9 of max_len=9 tokens"):
        hw.attention(*step, causal=True, cache=in_place)


def outputs() -> dict[str, torch.Tensor]:
    """The kernel over 8-bit rows and over the rows read back, and the rows the decode step writes, for a few shapes
    (run here and in a process on torch's AVX2 kernels: headwise's C++ built for AVX2)."""
    decode_kernel.available()
    out = {}
    for D, H, Hkv in ((64, 8, 2), (128, 4, 4), (80, 6, 1), (20, 4, 2)):
        g = torch.Generator().manual_seed(D)
        q, k, v = torch.randn(2, H, 1, D, generator=g), torch.randn(2, Hkv, 41, D, generator=g), torch.randn(2, Hkv, 41, D, generator=g)
        k8, v8 = quantize_rows(k), quantize_rows(v)
        out[f"{D} rows"] = decode_kernel.dense(q, k8, v8, None, D**-0.5)
        out[f"{D} read back"] = decode_kernel.dense(q, dequantize_rows(k8), dequantize_rows(v8), None, D**-0.5)
        caches = torch.zeros(2, Hkv, 42, D + 4, dtype=torch.int8), torch.zeros(2, Hkv, 42, D + 4, dtype=torch.int8)
        caches[0][:, :, :41], caches[1][:, :, :41] = k8, v8
        new = torch.randn(2, Hkv, 1, D, generator=g), torch.randn(2, Hkv, 1, D, generator=g)
        out[f"{D} step"] = decode_kernel.step(q, *new, None, None, *caches, None, 41, D**-0.5)  # (2, 1, H * D)
        out[f"{D} written"] = torch.stack([caches[0][:, :, 41:], caches[1][:, :, 41:]])
        out[f"{D} rounded"] = torch.stack([quantize_rows(new[0]), quantize_rows(new[1])])
        out[f"{D} want"] = variant_attention(q.double(), dequantize_rows(k8).double(), dequantize_rows(v8).double(), causal=False)
    return out


@pytest.mark.slow  # a build of headwise's C++ for AVX2 (once a machine), in a process of its own
def test_the_avx2_build_reads_and_writes_8_bit_rows_as_the_avx512_build(tmp_path):
    if not decode_kernel.available():
        pytest.skip("headwise's C++ kernels are not built here")
    from helpers import outputs_under_avx2

    here, avx2 = outputs(), outputs_under_avx2("test_cache_int8", "outputs", tmp_path)
    for D in (64, 128, 80, 20):
        for got in (here, avx2):
            assert torch.equal(got[f"{D} written"], got[f"{D} rounded"])  # the step rounds as quantize_rows
            assert torch.equal(got[f"{D} rows"], got[f"{D} read back"])
            torch.testing.assert_close(got[f"{D} rows"].double(), got[f"{D} want"], atol=1e-5, rtol=1e-5)
        assert torch.equal(avx2[f"{D} rows"], here[f"{D} rows"]) and torch.equal(avx2[f"{D} step"], here[f"{D} step"])


@pytest.mark.parametrize("schedule", [[5, 1, 1, 1], [1, 1, 3, 1], [2, 2]], ids=["prompt, then one token a step", "mixed", "runs"])
@pytest.mark.parametrize("paged", [False, True], ids=["KVCache", "PagedKVCache"])
def test_a_bfloat16_models_keys_are_the_rows_of_their_values_widened(schedule, paged):
    """bfloat16 queries, keys and values over 8-bit rows: the rows and the context of the same values in float32,
    bit for bit (rounded to bfloat16), whether a step reads the rows in place (one token) or back (several)."""
    torch.manual_seed(4)
    B, H, Hkv, D, T = 1, 8, 2, 64, sum(schedule)
    q, k, v = (torch.randn(B, h, T, D).bfloat16() for h in (H, Hkv, Hkv))
    if paged:
        caches = [hw.PagedKVCache(8, 4, Hkv, D, dtype=torch.int8) for _ in range(2)]
        for c in caches:
            c.add(0)
    else:
        caches = [hw.KVCache(B, Hkv, T, D, dtype=torch.int8) for _ in range(2)]
    start = 0
    for n in schedule:
        part = slice(start, start + n)
        calls = [c.batch([0], [n]) for c in caches] if paged else caches
        got = hw.attention(*(t[:, :, part] for t in (q, k, v)), causal=True, cache=calls[0])  # (B, H, n, D)
        want = hw.attention(*(t[:, :, part].float() for t in (q, k, v)), causal=True, cache=calls[1])
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
        start += n
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    torch.testing.assert_close(dequantize_rows(caches[1].k[..., :T, :] if not paged else caches[1].k[:, :T]).double(),
                               read_back(k.float() if not paged else k[0].float()), rtol=0, atol=0)
