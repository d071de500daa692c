"""Errors that used to escape as raw Python / torch errors (or not at all) now name the argument, what was expected, what was given."""

from __future__ import annotations

import math

import pytest
import torch

import headwise as hw


def test_head_size_zero():
    z = torch.randn(1, 2, 3, 0)
    with pytest.raises(ValueError, match=r"q and k must have a head size D >= 1, got q of shape \(1, 2, 3, 0\)"):
        hw.attention(z, z, z)  # ZeroDivisionError in 1/sqrt(D) before


@pytest.mark.parametrize("backend", [[], None, 3])
def test_backend_that_is_not_a_str(backend):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"backend must be one of \['auto', 'math', 'sdpa'\] \(a str\), got"):
        hw.attention(q, q, q, backend=backend)  # "unhashable type: 'list'" before
    with pytest.raises(TypeError, match=r"backend must be one of \['auto', 'math', 'sdpa'\] \(a str\), got"):
        hw.MultiHeadAttention(4, 4, 8, 0.0, 2, backend=backend)


def test_sliding_cache_window_is_named():
    with pytest.raises(ValueError, match=r"window must be a positive int, got 0"):
        hw.KVCache.sliding(1, 1, 0, 2)  # named max_len before


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_or_plus_inf_in_an_additive_mask(bad):
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"mask \(additive float\) must hold finite numbers or -inf \(= may not attend\), got NaN or \+inf"):
        hw.attention(q, q, q, mask=torch.tensor([0.0, bad, 0.0]))
    out = hw.attention(q, q, q, mask=torch.tensor([0.0, -math.inf, 0.0]))  # -inf is the way to forbid a key
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("q_dtype, mask", [(torch.float32, torch.tensor([0.0, 1e39, 0.0], dtype=torch.float64)),
                                           (torch.float16, torch.tensor([0.0, 7e4, 0.0]))])
def test_an_additive_mask_past_qs_dtype_is_refused_not_nan(q_dtype, mask):
    """A value finite in the mask's dtype but past q's would be +inf where a kernel reads it in q's dtype (NaN rows)."""
    q = torch.randn(1, 2, 3, 4).to(q_dtype)
    with pytest.raises(ValueError, match=rf"mask \(additive float\) must hold finite numbers or -inf \(= may not attend\), got a value "
                                         rf"above .*, past q's {q_dtype}"):
        hw.attention(q, q, q, mask=mask)
    assert torch.isfinite(hw.attention(q, q, q, mask=mask.clamp(max=1e4))).all()


def test_a_float32_mask_under_bfloat16_queries_is_not_rounded_before_the_scores():
    """A relative-position bias with a constant offset (which softmax cancels) given as a float32 mask: bfloat16 queries
    read it at float32's precision, as the same bias given as ALiBi slopes is read (rounded to bfloat16 first, the offset
    of -200 leaves steps of 1.0 and an error of 0.4)."""
    from reference import reference_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 32).bfloat16() for _ in range(3))
    pos = torch.arange(64)
    bias = -hw.scores.alibi_slopes(4)[:, None, None] * (pos[:, None] - pos[None]).abs() - 200.0  # (H, T, S) float32
    want = reference_attention(q, k, v, causal=True, mask=bias[None].double())  # (B, H, T, Dv) float64
    for backend in ("auto", "math", "sdpa"):
        got = hw.attention(q, k, v, causal=True, mask=bias, backend=backend)
        assert (got.double() - want).abs().max() < 0.02, backend


@pytest.mark.parametrize(
    ("convert", "module", "match"),
    [
        (hw.wrapper_to_mha, lambda: hw.MultiHeadAttention(4, 4, 8, 0.0, 2), r"wrapper_to_mha converts a MultiHeadAttentionWrapper: wrapper must be one, got MultiHeadAttention; for a MultiHeadAttention use mha_to_gpt2"),
        (hw.gpt2_to_mha, lambda: hw.MultiHeadAttention(4, 4, 8, 0.0, 2), r"gpt2_to_mha converts a GPT2MultiHeadAttention: attn must be one, got MultiHeadAttention; for a MultiHeadAttention use mha_to_gpt2"),
        (hw.mha_to_gpt2, lambda: hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=4, n_head=2)), r"mha_to_gpt2 converts a MultiHeadAttention: mha must be one, got GPT2MultiHeadAttention; for a GPT2MultiHeadAttention use gpt2_to_mha"),
        (hw.mha_to_gpt2, lambda: torch.nn.Linear(2, 2), r"mha_to_gpt2 converts a MultiHeadAttention: mha must be one, got Linear$"),
    ],
)
def test_conversions_name_the_module_type_they_need(convert, module, match):
    with pytest.raises(TypeError, match=match):
        convert(module())  # AttributeError ('heads', 'config', 'd_out') before


@pytest.mark.parametrize(
    ("name", "ours"),
    [("is_causal", "causal"), ("attn_mask", "mask"), ("key_padding_mask", "attention_mask"), ("softmax_scale", "scale"), ("enable_gqa", "grouped-query")],
)
def test_another_librarys_keyword_names_headwises(name, ours):
    q = torch.randn(1, 2, 3, 4)
    for call in (hw.attention, hw.plan):
        with pytest.raises(TypeError, match=rf"{call.__name__}\(\) got unexpected keyword argument\(s\) '{name}' \(headwise's: [^)]*{ours}"):
            call(q, q, q, **{name: True})  # Python's bare "unexpected keyword argument" before
    with pytest.raises(TypeError, match=rf"attention_weights\(\) got unexpected keyword argument\(s\) '{name}' \(headwise's: [^)]*{ours}.*; it takes causal, window"):
        hw.attention_weights(q, q, **{name: True})


def test_an_unknown_keyword_is_named_beside_the_ones_taken():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=r"attention\(\) got unexpected keyword argument\(s\) 'causl'; it takes q, k, v, causal, window, mask"):
        hw.attention(q, q, q, causl=True)
    assert torch.equal(hw.attention(q=q, k=q, v=q, causal=True), hw.attention(q, q, q, causal=True))  # q, k, v by name still


def test_a_float64_input_under_cpu_autocast_is_named():
    """autocast casts float32 and the half dtypes, not float64: a float64 x into a float32 layer is the same TypeError
    as outside it (it failed inside torch's matmul); a float32 x under autocast still runs."""
    m = hw.MultiHeadAttention(32, 32, context_length=40, dropout=0.0, num_heads=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(TypeError, match=r"x has dtype torch.float64 but MultiHeadAttention's parameters are torch.float32"):
            m(torch.randn(2, 5, 32, dtype=torch.float64))
        assert m(torch.randn(2, 5, 32)).dtype == torch.bfloat16
