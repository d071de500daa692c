"""KVCache: a static buffer written in place; cached decoding equals the full forward.

Oracles: the float64 reference (tests/reference.py, which does not import headwise) for
float64 modules, and the same module's full, non-cached forward for float32 ones.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BACKENDS, decode, make, new_cache, on, reference_weights, tol
from hypothesis import given
from hypothesis import strategies as st
from reference import reference_mha
from reference_variants import variant_attention

import headwise as hw

# ----------------------------------------------------------------------------- the buffer


def test_preallocated_and_written_in_place():
    cache = hw.KVCache(2, 3, 10, 4)
    assert cache.k.shape == cache.v.shape == (2, 3, 10, 4)
    assert cache.k.numel() + cache.v.numel() == 2 * 2 * 3 * 10 * 4  # exactly 2·B·Hkv·max_len·D
    assert len(cache) == 0 and cache.max_len == 10
    k_ptr, v_ptr = cache.k.data_ptr(), cache.v.data_ptr()
    k1, v1 = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    k2, v2 = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    cache.update(k1, v1)
    keys, values, kpm = cache.update(k2, v2)
    assert len(cache) == 5 and kpm is None
    assert keys.data_ptr() == k_ptr and values.data_ptr() == v_ptr  # views of the buffers, no torch.cat
    assert cache.k.data_ptr() == k_ptr and cache.v.data_ptr() == v_ptr
    torch.testing.assert_close(keys, torch.cat([k1, k2], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v1, v2], dim=2), rtol=0, atol=0)
    cache.reset()
    assert len(cache) == 0 and cache.k.data_ptr() == k_ptr
    keys, _, _ = cache.update(k2, v2)
    torch.testing.assert_close(keys, k2, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["plain", "sliding", "int8"])
def test_a_cache_made_under_inference_mode_takes_writes_outside_it(kind):
    """A cache made at a server's start-up (often under ``torch.inference_mode``) decodes in ``no_grad`` later: torch
    refuses in-place writes to inference tensors outside that mode, so the buffers are made as ordinary ones."""
    torch.manual_seed(0)
    m = hw.MultiHeadAttention(16, 16, 32, 0.0, num_heads=4, window=3 if kind == "sliding" else None).eval()
    x = torch.randn(1, 6, 16)

    def new():
        if kind == "sliding":
            return hw.KVCache.sliding(1, 4, 3, 4)
        return hw.KVCache(1, 4, 16, 4, dtype=torch.int8 if kind == "int8" else torch.float32)

    with torch.inference_mode():
        made_there = new()
    here = new()
    with torch.no_grad():
        for cache in (made_there, here):
            m(x[:, :4], cache=cache)
        assert torch.equal(m(x[:, 4:], cache=made_there), m(x[:, 4:], cache=here))


def test_full_cache_and_bad_writes_are_clear_errors():
    cache = hw.KVCache(1, 2, 4, 3)
    cache.update(torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3))
    with pytest.raises(ValueError, match=r"cache is full: it holds 3 of max_len=4 tokens and cannot take 2 more"):
        cache.update(torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 3))
    assert len(cache) == 3  # nothing written
    with pytest.raises(ValueError, match=r"cache holds \(B=1, Hkv=2, \*, D=3\); k has shape \(1, 4, 1, 3\)"):
        cache.update(torch.randn(1, 4, 1, 3), torch.randn(1, 4, 1, 3))
    with pytest.raises(TypeError, match=r"cache holds torch.float32; v is torch.float64"):
        cache.update(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(B, T\) = \(1, 1\), got \(1, 2\)"):
        cache.update(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 1, 3), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"k and v must hold the same tokens, got T=1 keys and T=2 values"):
        cache.update(torch.randn(1, 2, 1, 3), torch.randn(1, 2, 2, 3))
    with pytest.raises(ValueError, match=r"k is on meta but the cache is on cpu"):
        cache.update(torch.randn(1, 2, 1, 3, device="meta"), torch.randn(1, 2, 1, 3))
    assert len(cache) == 3  # still nothing written
    with pytest.raises(ValueError, match=r"max_len must be a positive int, got 0"):
        hw.KVCache(1, 2, 0, 3)
    with pytest.raises(TypeError, match=r"batch_size must be a positive int, got 1.5"):
        hw.KVCache(1.5, 2, 4, 3)


def test_a_step_that_writes_the_cache_itself_gets_the_slot_and_a_full_cache_is_an_error_first():
    cache = hw.KVCache(2, 2, 4, 3)
    cache.update(torch.randn(2, 2, 3, 3), torch.randn(2, 2, 3, 3))
    seen = []
    out = cache.write_one_unchecked(lambda k, v, real, slot: seen.append((k, v, real, slot)) or torch.ones(1))
    assert torch.equal(out, torch.ones(1)) and len(cache) == 4
    assert seen[0][0] is cache.k and seen[0][1] is cache.v and seen[0][2] is None and seen[0][3] == 3
    with pytest.raises(ValueError, match=r"cache is full: it holds 4 of max_len=4 tokens and cannot take 1 more"):
        cache.write_one_unchecked(lambda *args: seen.append(args))
    assert len(seen) == 1 and len(cache) == 4  # the op never ran
    padded = hw.KVCache(2, 2, 4, 3)
    padded.update(torch.randn(2, 2, 2, 3), torch.randn(2, 2, 2, 3), torch.tensor([[False, True], [True, True]]))
    padded.write_one_unchecked(lambda k, v, real, slot: seen.append((real, slot)))
    assert seen[-1][0] is padded.is_token and seen[-1][1] == 2 and len(padded) == 3


def test_crop_rewinds():
    cache = hw.KVCache(1, 1, 6, 2)
    k = torch.randn(1, 1, 5, 2)
    cache.update(k, k)
    cache.crop(3)
    assert len(cache) == 3
    new = torch.randn(1, 1, 1, 2)
    keys, _, _ = cache.update(new, new)
    torch.testing.assert_close(keys, torch.cat([k[:, :, :3], new], dim=2), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"length must be an int in \[0, len\(cache\)=4\], got 5"):
        cache.crop(5)
    cache.reset()
    cache.update(k[:, :, :3], k[:, :, :3], torch.tensor([[True, False, False]]))  # right padding
    cache.crop(1)
    _, _, kpm = cache.update(new, new)  # the dropped positions' padding is forgotten
    assert kpm.tolist() == [[True, True]]
    with pytest.raises(ValueError, match=r"a sliding cache \(window=3\) cannot be cropped"):
        hw.KVCache.sliding(1, 1, 3, 2).crop(0)


def test_module_errors_name_the_cache_problem():
    m = make("mha", ctx=8)
    with pytest.raises(ValueError, match=r"got 9 tokens \(6 cached \+ 3 new\), more than context_length=8"):
        cache = new_cache(m, 1, 8)
        m(torch.randn(1, 6, 16), cache=cache)
        m(torch.randn(1, 3, 16), cache=cache)
    with pytest.raises(ValueError, match=r"cache holds \(B=1, Hkv=2, \*, D=4\); k has shape \(1, 4, 2, 4\)"):
        m(torch.randn(1, 2, 16), cache=hw.KVCache(1, 2, 8, 4))  # a cache for another module
    with pytest.raises(ValueError, match=r"a sliding cache of window=3 needs attention with window=3, got window=None"):
        m(torch.randn(1, 2, 16), cache=hw.KVCache.sliding(1, 4, 3, 4))



def test_a_forward_counts_each_rows_real_tokens_against_context_length_as_a_cache_does():
    """Left padding takes no position: 10 slots of which 7 real fit context_length=8 in one forward, as in a forward
    through a cache (a padded row's real tokens are what count); 9 real tokens in a row do not."""
    m = make("mha", ctx=8).eval()
    x = torch.randn(2, 10, 16)
    mask = torch.arange(10)[None].expand(2, 10) >= torch.tensor([[3], [4]])  # (2, 10): 7 and 6 real tokens
    with torch.no_grad():
        torch.testing.assert_close(m(x, attention_mask=mask), m(x, attention_mask=mask, cache=new_cache(m, 2, 10)))
        with pytest.raises(ValueError, match=r"got 9 tokens in a row, padding not counted \(10 slots\), more than context_length=8"):
            m(x, attention_mask=torch.arange(10)[None].expand(2, 10) >= 1)


# ----------------------------------------------------------------------------- decoding = full forward


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_steps_and_chunk_equal_the_full_forward(kind, backend, device):
    m = make(kind, backend=backend, ctx=16, device=device)
    x = torch.randn(2, 13, 16).to(device)
    schedule = [5, 1, 1, 1, 4, 1]  # prefill, one at a time, a chunk, one more
    with torch.no_grad():
        want = m(x)  # (B, T, C): one causal forward over everything
        cache = new_cache(m, 2, 16)
        got = decode(m, x, schedule, cache)
    assert len(cache) == 13
    torch.testing.assert_close(got, want, **tol(device, torch.float32))


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@given(
    schedule=st.lists(st.integers(1, 5), min_size=1, max_size=6), B=st.integers(1, 3), Hkv=st.sampled_from([1, 2, 4]),
    left_pad=st.lists(st.integers(0, 4), min_size=3, max_size=3), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**16),
)
def test_cached_decoding_matches_the_float64_reference(kind, schedule, B, Hkv, left_pad, backend, seed, device):
    m = make(kind, Hkv=Hkv, ctx=32, backend=backend, dtype=torch.float64, seed=seed, device=device)
    T = sum(schedule)
    x = torch.randn(B, T, 16, dtype=torch.float64)
    pads = torch.tensor(left_pad[:B]).clamp(max=min(schedule[0], T) - 1)  # padding lies inside the prefill
    kpm = torch.arange(T) >= pads[:, None]  # (B, T) True = real token, left padded
    with torch.no_grad():
        got = decode(m, x.to(device), schedule, new_cache(m, B, 32, torch.float64), kpm.to(device)).cpu()
        want = reference_mha(x, **on("cpu", reference_weights(m)), num_heads=4, num_kv_heads=Hkv, causal=True, attention_mask=kpm)
    torch.testing.assert_close(got, want, **tol(device, torch.float64))


@given(schedule=st.lists(st.integers(1, 4), min_size=2, max_size=5), backend=st.sampled_from(BACKENDS), seed=st.integers(0, 2**16))
def test_padding_given_with_any_chunk_is_remembered(schedule, backend, seed):
    m = make("gpt2", Hkv=2, ctx=32, backend=backend, dtype=torch.float64, seed=seed)
    T = sum(schedule)
    x = torch.randn(3, T, 16, dtype=torch.float64)
    kpm = torch.rand(3, T, generator=torch.Generator().manual_seed(seed)) > 0.3  # (B, T) padding anywhere, any chunk
    with torch.no_grad():
        got = decode(m, x, schedule, new_cache(m, 3, 32, torch.float64), kpm, every_chunk=True)
        want = reference_mha(x, **reference_weights(m), num_heads=4, num_kv_heads=2, causal=True, attention_mask=kpm)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_left_padded_batch_decodes_like_each_sequence_alone(kind, backend, device):
    m = make(kind, backend=backend, ctx=16, device=device)
    lengths = [6, 3, 1]  # real prompt tokens per row; the prompt is left padded to 6
    P, steps = 6, 4
    prompt = torch.randn(3, P, 16).to(device)
    tokens = torch.randn(3, steps, 16).to(device)
    kpm = torch.arange(P, device=device) >= P - torch.tensor(lengths, device=device)[:, None]  # (B, P) True = real
    with torch.no_grad():
        cache = new_cache(m, 3, 16)
        out = [m(prompt, attention_mask=kpm, cache=cache)]  # prefill: the cache remembers the padding
        out += [m(tokens[:, i : i + 1], cache=cache) for i in range(2)]  # steps: no mask of their own
        out.append(m(tokens[:, 2:], cache=cache))  # and a chunk
        got = torch.cat(out, dim=1)  # (B, P + steps, C)
        assert not got.isnan().any()
        for b, n in enumerate(lengths):
            alone = torch.cat([prompt[b : b + 1, P - n :], tokens[b : b + 1]], dim=1)  # (1, n + steps, C), unpadded
            torch.testing.assert_close(got[b : b + 1, P - n :], m(alone), **tol(device, torch.float32))
        # a pad query sees only padding: a zero context, so its output is the projection's bias
        bias = (m.out_proj if kind == "mha" else m.c_proj).bias
        torch.testing.assert_close(got[2, : P - 1], bias.expand(P - 1, 16), atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_gpt2_small_width_decoding_equals_the_full_forward(kind):
    """At GPT-2 small's width the projections may take other kernels for one row than for many
    (headwise.linear); decoding must still equal the full forward."""
    torch.manual_seed(1)
    if kind == "mha":
        m = hw.MultiHeadAttention(768, 768, 64, 0.0, num_heads=12, qkv_bias=True).eval()
    else:
        m = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0)).eval()
    x = torch.randn(1, 40, 768)
    with torch.no_grad():
        got = decode(m, x, [33, 1, 1, 5], new_cache(m, 1, 40))
        torch.testing.assert_close(got, m(x), atol=1e-5, rtol=0)


def test_gqa_cache_holds_only_the_kv_heads():
    m = make("gpt2", H=4, Hkv=2)
    cache = new_cache(m, 1, 8)
    assert cache.k.shape == (1, 2, 8, 4)
    with torch.no_grad():
        m(torch.randn(1, 3, 16), cache=cache)
    assert len(cache) == 3


def test_a_cache_belongs_to_the_first_module_that_uses_it():
    torch.manual_seed(0)
    layer0, layer1 = make("mha"), make("mha")
    cache = new_cache(layer0, 1, 16)
    with torch.no_grad():
        layer0(torch.randn(1, 3, 16), cache=cache)
        with pytest.raises(ValueError, match=r"this KVCache belongs to MultiHeadAttention at 0x[0-9a-f]+, not to MultiHeadAttention at 0x"):
            layer1(torch.randn(1, 3, 16), cache=cache)  # would have attended over layer0's keys
        assert len(cache) == 3  # nothing was written
        cache.reset()  # forgets the tokens, keeps the owner
        with pytest.raises(ValueError, match=r"this KVCache belongs to"):
            layer1(torch.randn(1, 3, 16), cache=cache)
        layer0(torch.randn(1, 3, 16), cache=cache)
        gpt2 = make("gpt2")
        with pytest.raises(ValueError, match=r"belongs to MultiHeadAttention at 0x[0-9a-f]+, not to GPT2MultiHeadAttention"):
            gpt2(torch.randn(1, 1, 16), cache=cache)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_training_through_a_cache_gives_the_full_forwards_gradients(kind, window, backend):
    """Prefill, single steps and a chunk with gradients on, then backward: the gradients of one full forward, twice over."""
    m = make(kind, Hkv=2, ctx=32, window=window, backend=backend, dtype=torch.float64, seed=5).train()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    w = torch.randn(2, 8, 16, dtype=torch.float64)

    def grads(out_fn):
        m.zero_grad()
        xg = x.clone().requires_grad_(True)
        out = out_fn(xg)
        (out * w).sum().backward()
        return [out.detach(), xg.grad, *[p.grad.clone() for p in m.parameters()]]

    want = grads(lambda xg: m(xg))
    cache = hw.KVCache(2, 2, 16, 4, dtype=torch.float64) if window is None else hw.KVCache.sliding(2, 2, window, 4, dtype=torch.float64)
    for _ in range(2):  # a second training step after reset() starts clean
        cache.reset()
        got = grads(lambda xg: torch.cat([m(xg[:, :3], cache=cache), m(xg[:, 3:4], cache=cache), m(xg[:, 4:5], cache=cache), m(xg[:, 5:], cache=cache)], 1))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert cache.k.grad_fn is None and not cache.k.requires_grad  # the buffers never join a graph


@pytest.mark.parametrize("window", [None, 3])
def test_after_a_backward_a_recording_step_is_refused_until_detach(window):
    """A backward frees the graph of the keys the cache recorded: the next forward that records is refused by name
    (before it writes: torch's own error would come in its backward); ``detach()`` goes on from the tokens' values,
    with the gradients of a step whose earlier tokens were cached without autograd; no_grad steps go on as they are."""
    m = make("mha", Hkv=2, ctx=32, window=window, dtype=torch.float64, seed=5).train()
    x = torch.randn(2, 6, 16, dtype=torch.float64)

    def new():
        return hw.KVCache(2, 2, 16, 4, dtype=torch.float64) if window is None else hw.KVCache.sliding(2, 2, window, 4, dtype=torch.float64)

    cache = new()
    m(x[:, :5], cache=cache).sum().backward()
    with pytest.raises(ValueError, match=r"a backward has gone through .* call cache.detach\(\) to go on from their values"):
        m(x[:, 5:], cache=cache)
    assert len(cache) == 5  # nothing written
    with torch.no_grad():
        m(x[:, 5:], cache=cache)  # evaluation needs no graph
    cache.detach()
    m.zero_grad()
    m(x[:, 5:], cache=cache).pow(2).sum().backward()
    got = [p.grad.clone() for p in m.parameters()]
    plain = new()
    with torch.no_grad():
        m(x[:, :5], cache=plain)
        m(x[:, 5:], cache=plain)
    m.zero_grad()
    m(x[:, 5:], cache=plain).pow(2).sum().backward()
    for a, b in zip(got, [p.grad for p in m.parameters()], strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_update_refuses_what_is_not_a_tensor():
    cache = hw.KVCache(1, 2, 8, 3)
    with pytest.raises(TypeError, match=r"k must be a torch.Tensor of shape \(B=1, Hkv=2, T, D=3\), got list"):
        cache.update([[0.0]], torch.zeros(1, 2, 1, 3))
    with pytest.raises(TypeError, match=r"v must be a torch.Tensor of shape \(B=1, Hkv=2, T, D=3\), got NoneType"):
        cache.update(torch.zeros(1, 2, 1, 3), None)


# ----------------------------------------------------------------------------- a refused call changes nothing


def snapshot(cache: hw.KVCache) -> tuple:
    return len(cache), cache.k.clone(), cache.v.clone(), cache.is_token.clone(), cache._padded, cache._owner


def unchanged(before: tuple, after: tuple) -> bool:
    return all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in zip(before, after, strict=True))


REFUSED = {  # attention arguments refused only once the cache's keys would be known
    "softcap": ({"softcap": -1.0}, r"softcap must be"),
    "sinks": ({"sinks": torch.randn(3)}, r"sinks must have shape"),
    "alibi": ({"alibi_slopes": torch.randn(5)}, r"alibi_slopes must have shape"),
    "mask": ({"mask": torch.ones(7, 7, dtype=torch.bool)}, r"mask must broadcast to"),
    "bad keys": ({"k": torch.randn(1, 2, 3, 4, dtype=torch.float64)}, r"q, k and v must share one dtype"),
    "kept keys' mask": ({"mask": torch.ones(4, dtype=torch.bool)}, r"mask must broadcast to \(B, H, T, cached \+ T_kv\) = \(1, 2, 3, 6\)"),
}


@pytest.mark.parametrize("sliding", [False, True], ids=["linear", "ring"])
@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_attention_call_leaves_the_cache_as_it_was(case, sliding):
    torch.manual_seed(0)
    cache = hw.KVCache.sliding(1, 2, 4, 4) if sliding else hw.KVCache(1, 2, 16, 4)
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    hw.attention(q, k, v, causal=True, window=cache.window, cache=cache, attention_mask=torch.tensor([[False, True, True]]))
    before = snapshot(cache)
    kwargs, match = REFUSED[case]
    args = {"k": k, "v": v} | kwargs
    with pytest.raises((ValueError, TypeError), match=match):
        hw.attention(q, args.pop("k"), args.pop("v"), causal=True, window=cache.window, cache=cache, **args)
    assert unchanged(before, snapshot(cache))
    hw.attention(q, k, v, causal=True, window=cache.window, cache=cache)  # and it still takes what fits
    assert len(cache) == 6


def test_a_refused_module_call_leaves_a_fresh_cache_free_for_its_layer():
    torch.manual_seed(0)
    wide, narrow = make("mha", H=4, Hkv=4), make("mha", H=4, Hkv=2)
    cache = new_cache(narrow, 1, 8)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"cache holds \(B=1, Hkv=2, \*, D=4\); k has shape \(1, 4, 2, 4\)"):
            wide(torch.randn(1, 2, 16), cache=cache)  # the wrong layer: refused before anything is written
        with pytest.raises(TypeError, match=r"position_ids must be an integer tensor"):
            narrow(torch.randn(1, 2, 16), cache=cache, position_ids=torch.zeros(1, 2))
        assert len(cache) == 0 and cache._owner is None
        narrow(torch.randn(1, 2, 16), cache=cache)  # its own layer takes it
    assert len(cache) == 2


def test_caches_hold_floating_point_numbers_only():
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype .*got torch.int64"):
        hw.KVCache(1, 2, 4, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"dtype must be a floating-point torch.dtype .*got 'float32'"):
        hw.KVCache.sliding(1, 2, 4, 3, dtype="float32")


# ----------------------------------------------------------------------------- a bfloat16 cache under float32 keys

TERMS = {
    "plain": {},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])},
}


def bf16(t: torch.Tensor) -> torch.Tensor:
    """t rounded to bfloat16, held as float64 (what a bfloat16 cache stores, exactly)."""
    return t.to(torch.bfloat16).double()


@pytest.mark.parametrize("terms", TERMS)
@pytest.mark.parametrize("window", [None, 3], ids=["linear", "ring"])
@pytest.mark.parametrize("backend", BACKENDS)
@given(schedule=st.lists(st.integers(1, 4), min_size=1, max_size=5), Hkv=st.sampled_from([1, 2, 4]), seed=st.integers(0, 2**16))
def test_a_bfloat16_cache_under_float32_keys_attends_over_them_rounded(terms, window, backend, schedule, Hkv, seed, device):
    torch.manual_seed(seed)
    B, H, D, T = 2, 4, 8, sum(schedule)
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    cache = hw.KVCache.sliding(B, Hkv, window, D, dtype=torch.bfloat16, device=device) if window else \
        hw.KVCache(B, Hkv, T, D, dtype=torch.bfloat16, device=device)
    outs, start, extra = [], 0, {name: t.to(device) if torch.is_tensor(t) else t for name, t in TERMS[terms].items()}
    for n in schedule:
        part = slice(start, start + n)
        outs.append(hw.attention(*(t[:, :, part].to(device) for t in (q, k, v)), causal=True, window=window, cache=cache, backend=backend, **extra))
        start += n
    got = torch.cat(outs, dim=2).cpu()  # (B, H, T, D)
    assert got.dtype == torch.float32 and cache.dtype == torch.bfloat16
    if window is None:
        assert torch.equal(cache.k.cpu(), k.to(torch.bfloat16)) and torch.equal(cache.v.cpu(), v.to(torch.bfloat16))  # stored rounded, nothing else
    want = variant_attention(bf16(q), bf16(k), bf16(v), causal=True, window=window, **TERMS[terms])  # float64 over the rounded keys
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)  # bfloat16's tolerance: the attention runs in bfloat16


def test_a_bfloat16_paged_pool_under_float32_keys_attends_over_them_rounded():
    torch.manual_seed(0)
    H, Hkv, D = 4, 2, 8
    pool = hw.PagedKVCache(16, 4, Hkv, D, dtype=torch.bfloat16)
    lengths = {0: [5, 1, 1], 1: [2, 3, 1]}  # each sequence's chunks, fed side by side
    seen = {s: ([], [], []) for s in lengths}  # each sequence's queries, keys and values so far
    for s in lengths:
        pool.add(s)
    for step in range(3):
        counts = [lengths[s][step] for s in lengths]
        q, k, v = torch.randn(1, H, sum(counts), D), torch.randn(1, Hkv, sum(counts), D), torch.randn(1, Hkv, sum(counts), D)
        got = hw.attention(q, k, v, causal=True, cache=pool.batch(list(lengths), counts))  # (1, H, T, D)
        assert got.dtype == torch.float32
        start = 0
        for s, n in zip(lengths, counts, strict=True):
            for held, new in zip(seen[s], (q, k, v), strict=True):
                held.append(new[:, :, start : start + n])
            sq, sk, sv = (torch.cat(t, dim=2) for t in seen[s])
            want = variant_attention(bf16(sq[:, :, -n:]), bf16(sk), bf16(sv), causal=True)  # (1, H, n, D)
            torch.testing.assert_close(got[:, :, start : start + n].double(), want, atol=2e-2, rtol=2e-2)
            start += n


@pytest.mark.parametrize("held,given", [(torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
def test_a_cache_takes_its_own_dtype_or_float32_into_bfloat16_only(held, given):
    cache, pool = hw.KVCache(1, 2, 8, 4, dtype=held), hw.PagedKVCache(4, 4, 2, 4, dtype=held)
    pool.add(0)
    q = k = v = torch.randn(1, 2, 3, 4, dtype=given)
    for c in (cache, pool.batch([0], [3])):
        with pytest.raises(TypeError, match=rf"the cache is {held}, but the keys and values are {given}: a cache holds their dtype, or torch.bfloat16 for float32"):
            hw.attention(q, k, v, causal=True, cache=c)
    assert len(cache) == 0 and pool.length(0) == 0  # refused before anything was written


def test_a_written_cache_pickles_and_a_deepcopied_module_and_cache_go_on_together():
    """A cache a module wrote pickles (without its owner: the loaded one belongs to the first module that writes it) and
    ``copy.deepcopy((module, cache))`` gives a pair that goes on as the original does (the copy belonged to the
    original module, and its module was refused)."""
    import copy
    import pickle

    torch.manual_seed(0)
    m = hw.MultiHeadAttention(32, 32, context_length=40, dropout=0.0, num_heads=4).eval()
    cache, x = hw.KVCache(1, 4, 40, 8), torch.randn(1, 6, 32)
    with torch.no_grad():
        m(x[:, :4], cache=cache)
        m2, cache2 = copy.deepcopy((m, cache))
        loaded = pickle.loads(pickle.dumps(cache))  # our own bytes, in this process
        want = m(x[:, 4:6], cache=cache)
        assert torch.equal(m2(x[:, 4:6], cache=cache2), want)
        with pytest.raises(ValueError, match="belongs to"):
            m(x[:, 4:5], cache=cache2)  # the copy is the copied module's
        assert torch.equal(m2(x[:, 4:6], cache=loaded), want)  # nobody's until written


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_paged_pool_pickles_and_deepcopies_with_its_reads_on_its_own_blocks(dtype):
    """A pool loaded from pickle or made by ``deepcopy`` goes on as the original does: several tokens of a
    sequence (read through a view of the whole pool) see the keys written after the load, not a stale copy of them."""
    import copy
    import pickle

    torch.manual_seed(0)
    pool = hw.PagedKVCache(8, 4, 2, 8, dtype=dtype)
    pool.add(0)
    with torch.no_grad():
        hw.attention(torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), causal=True, cache=pool.batch([0], [3]))
    copies = [pickle.loads(pickle.dumps(pool)), copy.deepcopy(pool)]  # (our own bytes, in this process)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    with torch.no_grad():
        want = hw.attention(q, k, v, causal=True, cache=pool.batch([0], [2]))
        for loaded in copies:
            assert torch.equal(hw.attention(q, k, v, causal=True, cache=loaded.batch([0], [2])), want)
            assert torch.equal(loaded.k, pool.k)


def test_a_cache_holding_recorded_keys_deepcopies_as_their_values():
    """``deepcopy`` of a cache whose keys autograd recorded (a training step's ``KVCache``, a ``ContextCache`` of a
    module that learns): the copy holds the same values, not part of the original's graph (a copy cannot share it), so
    the copy goes on as ``detach()`` would, and the original's backward still reaches the module."""
    import copy

    m = make("mha", Hkv=2, ctx=32, dtype=torch.float64, seed=5).train()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    cache = hw.KVCache(2, 2, 16, 4, dtype=torch.float64)
    first = m(x[:, :4], cache=cache)
    copied = copy.deepcopy(cache)
    assert len(copied) == 4 and torch.equal(copied.k, cache.k) and copied._owner is None
    with torch.no_grad():
        torch.testing.assert_close(m(x[:, 4:], cache=copied), m(x)[:, 4:])  # the copy goes on as the whole sequence
    first.sum().backward()  # the original's record is untouched
    assert all(p.grad is not None for p in m.parameters())
    cross = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, causal=False, kv_dim=6).train()
    memory, context = torch.randn(1, 5, 6), hw.ContextCache()
    out = cross(torch.randn(1, 1, 8), context=memory, cache=context)  # projects the context, recorded
    twin = copy.deepcopy(context)
    assert torch.equal(twin.k, context.k) and twin.k.grad_fn is None and context.k.grad_fn is not None
    out.sum().backward()


def test_a_copied_context_cache_projects_its_kept_context_again_unless_it_was_written_before_the_copy():
    """A copy's context is a new tensor, its version counter started anew: the copy (``deepcopy`` alone, with its
    module, or through pickle) projects its kept context again where it must (its module's weights are others, or
    changed), as the original does; a context written in place before the copy is refused by name, as in the original."""
    import copy
    import pickle

    cross = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, causal=False, kv_dim=6).double().eval()
    x, memory = torch.randn(1, 1, 8, dtype=torch.float64), torch.randn(1, 5, 6, dtype=torch.float64)
    cache = hw.ContextCache()
    want = cross(x, context=memory, cache=cache)
    torch.testing.assert_close(cross(x, cache=copy.deepcopy(cache)), want)  # grad on: keys of its own, projected again
    with torch.no_grad():
        twin, twin_cache = copy.deepcopy((cross, cache))
        torch.testing.assert_close(twin(x, cache=twin_cache), want)
        loaded = pickle.loads(pickle.dumps(cache))  # (our own bytes, in this process)
        cross.out_proj.weight.mul_(1.0)  # a write: the weights' version moves, the kept context is projected again
        torch.testing.assert_close(cross(x, cache=loaded), want)
        memory.mul_(2)  # written in place after the keys were projected
        for copied in (copy.deepcopy(cache), pickle.loads(pickle.dumps(cache))):
            with pytest.raises(ValueError, match=r"the context this ContextCache was filled from was written in place since"):
                cross(x, cache=copied)
            torch.testing.assert_close(cross(x, context=memory, cache=copied), cross(x, context=memory))  # passed again


def test_a_shallow_copy_of_a_cache_is_refused_naming_deepcopy():
    """``copy.copy`` would share the buffers: a sliding cache's copy, continued, overwrote the original's ring slots (and
    a linear one's the slots past the original's length) without a word. ``deepcopy`` is the copy that works."""
    import copy

    for cache in (hw.KVCache(1, 2, 8, 4), hw.KVCache.sliding(1, 2, 4, 4), hw.PagedKVCache(4, 4, 2, 4), hw.ContextCache()):
        with pytest.raises(TypeError, match=rf"copy.copy of a {type(cache).__name__} would share its buffers .* take copy.deepcopy"):
            copy.copy(cache)
        assert type(copy.deepcopy(cache)) is type(cache)
