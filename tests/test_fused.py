"""GPT2MultiHeadAttention: GPT-2's head-split shapes, the float64 reference, and HuggingFace parity."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import on, reference_weights, tol
from hypothesis import given
from hypothesis import strategies as st
from reference import linear, reference_mha
from reference_variants import variant_attention
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

import headwise as hw
from headwise.bench.models import cache_keyword
from headwise.functional import merge_heads, split_heads

# ----------------------------------------------------------------------------- GPT-2 shapes


def test_gpt2_head_split_shapes():
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config()).eval()
    x = torch.randn(2, 8, 768)
    query = attn.c_attn(x).split(768, dim=-1)[0]  # (2, 8, 768)
    heads = split_heads(query, attn.head_dim)
    assert heads.shape == (2, 12, 8, 64)
    assert merge_heads(heads).shape == (2, 8, 768)
    torch.testing.assert_close(merge_heads(heads), query)
    assert attn(x).shape == (2, 8, 768)
    seen = {}
    with hw.observe(lambda name, t: seen.setdefault(name, t.shape)):
        attn(x)
    assert seen["queries.transpose"] == seen["keys.transpose"] == seen["context"] == (2, 12, 8, 64)
    assert seen["output"] == (2, 8, 768)


def test_layout_c_attn_and_c_proj():
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config())
    assert list(attn.state_dict()) == ["c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"]
    assert attn.c_attn.weight.shape == (3 * 768, 768) and attn.c_proj.weight.shape == (768, 768)  # PyTorch (out, in)


# ----------------------------------------------------------------------------- float64 reference


@given(
    Hkv=st.integers(1, 3), group=st.integers(1, 3), D=st.integers(1, 4), T=st.integers(1, 6), B=st.integers(1, 3),
    window=st.none() | st.integers(1, 4), padding=st.sampled_from(["none", "left", "right"]),
    backend=st.sampled_from(["math", "sdpa", "auto"]), seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_reference(Hkv, group, D, T, B, window, padding, backend, seed, device):
    H = Hkv * group
    config = hw.GPT2Config(n_embd=H * D, n_head=H, n_kv_head=Hkv, n_positions=8, attn_pdrop=0.0, resid_pdrop=0.0)
    torch.manual_seed(seed)
    attn = hw.GPT2MultiHeadAttention(config, window=window, backend=backend).double().eval()
    with torch.no_grad():
        attn.c_attn.bias.normal_()  # a zero-initialised bias would hide a mis-split
    x = torch.randn(B, T, H * D, dtype=torch.float64)
    kpm = None
    if padding != "none":
        lengths = torch.randint(1, T + 1, (B,))
        pos = torch.arange(T)
        kpm = pos >= T - lengths[:, None] if padding == "left" else pos < lengths[:, None]  # (B, T) True = real
    want = reference_mha(x, **reference_weights(attn), num_heads=H, num_kv_heads=Hkv, causal=True, window=window, attention_mask=kpm)
    got = attn.to(device)(x.to(device), attention_mask=on(device, kpm)).cpu()
    torch.testing.assert_close(got, want, **tol(device, torch.float64))


def test_resid_dropout_only_in_training():
    torch.manual_seed(16)
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=16, n_head=2, attn_pdrop=0.0, resid_pdrop=0.5))
    x = torch.randn(1, 4, 16)
    y = attn(x)
    assert (y == 0).any()  # dropped outputs
    attn.eval()
    assert torch.equal(attn(x), attn(x)) and not (attn(x) == 0).any()


# ----------------------------------------------------------------------------- HuggingFace parity


def _hf_pair(n_embd=64, n_head=4, seed=17):
    config = transformers.GPT2Config(n_embd=n_embd, n_head=n_head, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    config._attn_implementation = "eager"  # probabilities as tensors; the mask comes in materialised
    torch.manual_seed(seed)
    theirs = GPT2Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)  # HF initialises biases to zero: random ones test the layout
    ours = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=n_embd, n_head=n_head, n_positions=32)).eval()
    return config, theirs, ours


def _hf_mask(config, x, attention_mask):
    """The 4-D additive mask GPT2Model itself builds (transformers.masking_utils)."""
    T = x.shape[1]
    no_cache = {cache_keyword(create_causal_mask): None}
    return create_causal_mask(config=config, inputs_embeds=x, attention_mask=attention_mask, **no_cache, position_ids=torch.arange(T)[None])


def test_loads_hf_attention_and_matches_without_padding():
    config, theirs, ours = _hf_pair()
    hw.gpt2_attention_from_hf(ours, theirs.state_dict())
    torch.testing.assert_close(ours.c_attn.weight, theirs.c_attn.weight.T)  # Conv1D (in, out) -> Linear (out, in)
    x = torch.randn(3, 9, 64)
    with torch.no_grad():
        want, _ = theirs(x, attention_mask=_hf_mask(config, x, None))
        for backend in ("math", "sdpa", "auto"):
            ours.backend = backend
            torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_matches_hf_with_a_padding_mask(side):
    config, theirs, ours = _hf_pair()
    hw.gpt2_attention_from_hf(ours, theirs.state_dict())
    x = torch.randn(3, 7, 64)
    lengths = torch.tensor([7, 4, 2])
    pos = torch.arange(7)
    real = pos >= 7 - lengths[:, None] if side == "left" else pos < lengths[:, None]  # (B, T) True = real token
    with torch.no_grad():
        want, _ = theirs(x, attention_mask=_hf_mask(config, x, real.long()))
        got = ours(x, attention_mask=real)
    # queries that see no real key: HF's finfo.min mask gives them a uniform average; we give
    # a zero context (c_proj's bias). Every other query must agree.
    sees = (torch.ones(7, 7, dtype=torch.bool).tril()[None] & real[:, None, :]).any(-1)  # (B, T)
    assert (~sees).any() == (side == "left")
    torch.testing.assert_close(got[sees], want[sees], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[~sees], ours.c_proj.bias.detach().expand(int((~sees).sum()), 64))


@pytest.mark.parametrize("saved_prefix", ["", "transformer."])  # checkpoints are saved with or without it
def test_loads_a_layer_of_a_random_gpt2_model_with_legacy_buffers(saved_prefix):
    config = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, n_positions=16, vocab_size=50, attn_pdrop=0.0, resid_pdrop=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(18)
    model = transformers.GPT2Model(config).eval()
    prefix = "h.1.attn."
    state = {saved_prefix + k: v for k, v in model.state_dict().items() if k.startswith(prefix)}
    prefix = saved_prefix + prefix
    state[prefix + "bias"] = torch.tril(torch.ones(1, 1, 16, 16, dtype=torch.bool))  # old checkpoints carry these
    state[prefix + "masked_bias"] = torch.tensor(-1e4)
    ours = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=32, n_head=4, n_positions=16)).eval()
    hw.gpt2_attention_from_hf(ours, state)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        want, _ = model.h[1].attn(x, attention_mask=_hf_mask(config, x, None))
        torch.testing.assert_close(ours(x), want, atol=1e-5, rtol=1e-5)


def test_a_mismatched_dict_names_every_bad_key_and_changes_nothing():
    _, theirs, ours = _hf_pair()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    state = dict(theirs.state_dict())
    del state["c_proj.bias"]
    state["c_attn.weight"] = state["c_attn.weight"][:, :-1]
    state["q_attn.weight"] = torch.zeros(64, 64)
    with pytest.raises(ValueError, match=r"nothing was loaded") as err:
        hw.gpt2_attention_from_hf(ours, state)
    msg = str(err.value)
    assert "missing: c_proj.bias" in msg
    assert "unexpected: q_attn.weight" in msg
    assert "wrong shape: c_attn.weight: expected (64, 192), got (64, 191) (stored transposed: (in, out))" in msg  # in the file's layout
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())


# ----------------------------------------------------------------------------- config and misuse


def test_config_presets_and_errors():
    assert hw.GPT2Config.from_preset("gpt2-medium").n_embd == 1024
    assert hw.GPT2Config.from_preset("gpt2", n_positions=64).n_positions == 64
    assert hw.GPT2Config().head_dim == 64 and hw.GPT2Config(n_kv_head=4).kv_heads == 4
    assert hw.GPT2Config.from_dict({"n_embd": 64, "n_head": 2, "architectures": ["GPT2LMHeadModel"]}).n_embd == 64
    with pytest.raises(ValueError, match=r"unknown preset 'gpt3'; valid: \['gpt2', 'gpt2-large', 'gpt2-medium', 'gpt2-xl'\]"):
        hw.GPT2Config.from_preset("gpt3")
    with pytest.raises(ValueError, match=r"n_embd \(100\) must be divisible by n_head \(12\)"):
        hw.GPT2Config(n_embd=100)
    with pytest.raises(ValueError, match=r"attn_pdrop must be a number in \[0, 1\], got 1.5"):
        hw.GPT2Config(attn_pdrop=1.5)
    with pytest.raises(Exception, match=r"cannot assign"):
        hw.GPT2Config().n_embd = 3  # frozen


def test_bad_input():
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=16, n_head=2, n_positions=4))
    with pytest.raises(TypeError, match=r"config must be a GPT2Config, got dict"):
        hw.GPT2MultiHeadAttention({"n_embd": 16})
    with pytest.raises(ValueError, match=r"hidden_states must have shape \(batch, tokens, d_in=16\), got \(2, 3, 8\)"):
        attn(torch.randn(2, 3, 8))
    with pytest.raises(ValueError, match=r"got 5 tokens, more than context_length=4"):
        attn(torch.randn(1, 5, 16))
    with pytest.raises(ValueError, match=r"attention_mask must have shape \(batch, tokens\) = \(1, 3\)"):
        attn(torch.randn(1, 3, 16), attention_mask=torch.ones(1, 4, dtype=torch.bool))


# ----------------------------------------------------------------------------- cross-attention


def _cross_reference(attn: hw.GPT2MultiHeadAttention, x: torch.Tensor, memory: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Queries from x through c_attn's query rows, keys/values from the memory through its other rows, head by head (float64)."""
    w = reference_weights(attn)
    heads = lambda y, n: torch.stack(y.split(attn.head_dim, dim=-1), dim=1)  # noqa: E731  (B, n, T, D)
    q = heads(linear(x, w["wq"], w["bq"]), attn.num_heads)
    k = heads(linear(memory, w["wk"], w["bk"]), attn.num_kv_heads)
    v = heads(linear(memory, w["wv"], w["bv"]), attn.num_kv_heads)
    ctx = variant_attention(q, k, v, attention_mask=real)  # (B, H, T, D): every real context token visible
    return linear(torch.cat(ctx.unbind(1), dim=-1), w["wo"], w["bo"])


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_cross_attention_uses_c_attn_rows_and_matches_the_reference(backend, n_kv_head):
    torch.manual_seed(0)
    config = hw.GPT2Config(n_embd=16, n_head=4, n_kv_head=n_kv_head, n_positions=32, attn_pdrop=0.0, resid_pdrop=0.0)
    attn = hw.GPT2MultiHeadAttention(config, causal=False, backend=backend).double().eval()
    x, memory = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(2, 7, 16, dtype=torch.float64)
    real = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    memory[1, 4:] = float("nan")  # padding is inert
    got = attn(x, context=memory, context_mask=real)
    want = _cross_reference(attn, x, torch.where(real[..., None], memory, 0.0), real)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    cache = hw.ContextCache()  # decode steps reuse the context's keys and values
    steps = [attn(x[:, :3], context=memory, context_mask=real, cache=cache), attn(x[:, 3:], cache=cache)]
    torch.testing.assert_close(torch.cat(steps, dim=1), got, atol=1e-12, rtol=1e-12)


def test_cross_attention_needs_a_module_built_without_causal():
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=16, n_head=4, n_positions=32))
    with pytest.raises(ValueError, match=r"cross-attention .* is not causal.*causal=False, got causal=True"):
        attn(torch.randn(1, 3, 16), context=torch.randn(1, 4, 16))
    with pytest.raises(TypeError, match=r"causal must be a bool, got str 'yes'"):
        hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=16, n_head=4, n_positions=32), causal="yes")
