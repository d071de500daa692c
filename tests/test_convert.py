"""Conversions keep the function exactly; state-dict remapping is all-or-nothing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import headwise as hw
from headwise.convert import HF_GPT2_TRANSPOSED, is_legacy_gpt2_buffer, load_checked, remap


def _randomise(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)  # a zero bias would hide a mis-placed one
    return module.eval()


# ----------------------------------------------------------------------------- module conversions


@given(
    d_in=st.integers(1, 8), head_dim=st.integers(1, 6), heads=st.integers(1, 4), tokens=st.integers(1, 6),
    qkv_bias=st.booleans(), causal=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_wrapper_to_mha_keeps_the_function(d_in, head_dim, heads, tokens, qkv_bias, causal, seed):
    torch.manual_seed(seed)
    wrapper = _randomise(hw.MultiHeadAttentionWrapper(d_in, head_dim, 6, 0.0, heads, qkv_bias, causal=causal).double())
    mha = hw.wrapper_to_mha(wrapper).eval()
    assert isinstance(mha, hw.MultiHeadAttention) and mha.d_out == heads * head_dim and mha.causal == causal
    x = torch.randn(2, tokens, d_in, dtype=torch.float64)
    kpm = torch.rand(2, tokens) < 0.8
    with torch.no_grad():  # float64: equal up to rounding, far below the 1e-6 promised in float32
        torch.testing.assert_close(mha(x), wrapper(x), atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(mha(x, attention_mask=kpm), wrapper(x, attention_mask=kpm), atol=1e-12, rtol=1e-12)


@given(
    kv_heads=st.integers(1, 3), group=st.integers(1, 3), head_dim=st.integers(1, 5), tokens=st.integers(1, 6),
    qkv_bias=st.booleans(), window=st.none() | st.integers(1, 4), causal=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_mha_to_gpt2_and_back_keep_the_function(kv_heads, group, head_dim, tokens, qkv_bias, window, causal, seed):
    heads = kv_heads * group
    C = heads * head_dim
    torch.manual_seed(seed)
    window = window if causal else None
    mha = _randomise(hw.MultiHeadAttention(C, C, 6, 0.0, heads, qkv_bias, window=window, num_kv_heads=kv_heads, causal=causal).double())
    gpt2 = hw.mha_to_gpt2(mha).eval()
    assert gpt2.num_kv_heads == kv_heads and gpt2.window == window and gpt2.causal == causal
    back = hw.gpt2_to_mha(gpt2).eval()
    x = torch.randn(2, tokens, C, dtype=torch.float64)
    kpm = torch.rand(2, tokens) < 0.8
    with torch.no_grad():
        want = mha(x, attention_mask=kpm)
        torch.testing.assert_close(gpt2(x, attention_mask=kpm), want, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(back(x, attention_mask=kpm), want, atol=1e-12, rtol=1e-12)
    for name in ("W_query", "W_key", "W_value"):
        assert torch.equal(getattr(back, name).weight, getattr(mha, name).weight)
        if qkv_bias:
            assert torch.equal(getattr(back, name).bias, getattr(mha, name).bias)
        else:
            assert not getattr(back, name).bias.any()  # no bias became a zero bias


@pytest.mark.parametrize(
    ("d", "heads", "kv_heads", "tokens"), [(4, 2, 2, 3), (24, 4, 2, 9), (64, 8, 1, 16), (768, 12, 12, 32), (768, 12, 4, 8)]
)
def test_outputs_agree_in_float32(d, heads, kv_heads, tokens):
    """The three layouts of one attention give the same float32 outputs but for the rounding of their sums: each
    form's projections may run another kernel (MKL's blocked sums, the panels' k in turn), and a sum of d products
    rounds differently by about sqrt(d) ulps; 1e-6 up to d = 64."""
    torch.manual_seed(19)
    x = torch.randn(2, tokens, d)
    tol = 1e-6 * max(1.0, (d / 64) ** 0.5)
    if kv_heads == heads:  # the wrapper has no GQA form
        wrapper = _randomise(hw.MultiHeadAttentionWrapper(d, d // heads, 32, 0.0, heads, True))
        mha = hw.wrapper_to_mha(wrapper)
        with torch.no_grad():
            torch.testing.assert_close(mha(x), wrapper(x), atol=tol, rtol=0)
    mha = _randomise(hw.MultiHeadAttention(d, d, 32, 0.0, heads, True, num_kv_heads=kv_heads))
    gpt2 = hw.mha_to_gpt2(mha)
    with torch.no_grad():
        y = mha(x)
        torch.testing.assert_close(gpt2(x), y, atol=tol, rtol=0)
        torch.testing.assert_close(hw.gpt2_to_mha(gpt2)(x), y, atol=tol, rtol=0)


def test_conversions_keep_dtype():
    mha = hw.MultiHeadAttention(8, 8, 4, 0.0, 2).double()
    assert hw.mha_to_gpt2(mha).c_attn.weight.dtype == torch.float64
    assert hw.gpt2_to_mha(hw.mha_to_gpt2(mha)).W_query.weight.dtype == torch.float64
    assert hw.wrapper_to_mha(hw.MultiHeadAttentionWrapper(3, 2, 4, 0.0, 2).double()).out_proj.weight.dtype == torch.float64


@pytest.mark.parametrize(
    ("mha", "match"),
    [
        (hw.MultiHeadAttention(3, 4, 6, 0.0, 2), r"one width: d_in == d_out == kv_dim; got d_in=3, d_out=4, kv_dim=3"),
        (hw.MultiHeadAttention(4, 4, 6, 0.0, 2, causal=False, kv_dim=5), r"got d_in=4, d_out=4, kv_dim=5"),
        (hw.MultiHeadAttention(4, 4, 6, 0.0, 2, softcap=30.0), r"GPT-2's layout has no softcap: mha_to_gpt2 would drop it"),
        (hw.MultiHeadAttention(4, 4, 6, 0.0, 2, sinks=True, alibi=True), r"has no sinks, alibi: .* with sinks, alibi"),
    ],
)
def test_mha_to_gpt2_refuses_what_gpt2_cannot_express(mha, match):
    with pytest.raises(ValueError, match=match):
        hw.mha_to_gpt2(mha)


# ----------------------------------------------------------------------------- remap / load_checked


def test_remap_renames_transposes_and_ignores():
    state = {"p.attn.c_attn.weight": torch.arange(6.0).view(2, 3), "p.attn.bias": torch.ones(1), "p.attn.c_attn.bias": torch.zeros(3)}
    out = remap(
        state, {"c_attn.weight": (3, 2), "c_attn.bias": (3,)},
        rename=lambda k: k.removeprefix("p.attn."), transposed=("c_attn.weight",), ignore=is_legacy_gpt2_buffer,
    )
    assert list(out) == ["c_attn.weight", "c_attn.bias"]
    assert torch.equal(out["c_attn.weight"], state["p.attn.c_attn.weight"].T)
    assert list(state) == ["p.attn.c_attn.weight", "p.attn.bias", "p.attn.c_attn.bias"]  # the input is untouched


def test_remap_lists_every_problem_at_once():
    state = {"a": torch.zeros(2), "b": torch.zeros(3), "extra1": torch.zeros(1), "extra2": torch.zeros(1)}
    with pytest.raises(ValueError, match=r"cannot load ckpt.safetensors; nothing was loaded") as err:
        remap(state, {"a": (2,), "b": (4,), "c": (1,), "d": (1,)}, source="ckpt.safetensors")
    lines = str(err.value).splitlines()[1:]
    assert lines == [
        "  missing: c", "  missing: d", "  unexpected: extra1", "  unexpected: extra2", "  wrong shape: b: expected (4,), got (3,)",
    ]


def test_load_checked_changes_nothing_on_error_and_loads_on_success():
    mha = hw.MultiHeadAttention(4, 4, 3, 0.0, 2)
    before = {k: v.clone() for k, v in mha.state_dict().items()}
    good = {k: torch.randn_like(v) for k, v in mha.state_dict().items()}
    bad = dict(good, **{"W_key.weight": torch.zeros(4, 5)})
    with pytest.raises(ValueError, match=r"wrong shape: W_key.weight: expected \(4, 4\), got \(4, 5\)"):
        load_checked(mha, bad)
    assert all(torch.equal(before[k], v) for k, v in mha.state_dict().items())
    load_checked(mha, good)
    assert torch.equal(mha.W_key.weight, good["W_key.weight"])


def test_a_meta_tensor_is_refused_by_name_before_anything_is_copied():
    """A meta tensor has the right shape and no values: the check names it (torch's copy failed at it, after copying the
    entries before it); a module on the meta device still takes one by assignment (only shapes are read there)."""
    mha = hw.MultiHeadAttention(8, 8, 3, 0.0, 2)
    before = {k: v.clone() for k, v in mha.state_dict().items()}
    state = {k: torch.randn_like(v) for k, v in mha.state_dict().items()}
    state["out_proj.bias"] = torch.empty(8, device="meta")
    for load in (mha.load_state_dict, lambda s: load_checked(mha, s)):
        with pytest.raises(ValueError, match=r"no values: out_proj.bias \(a meta tensor"):
            load(state)
        assert all(torch.equal(before[k], v) for k, v in mha.state_dict().items())
    gpt2 = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=8))
    hf = {"c_attn.weight": torch.randn(8, 24), "c_attn.bias": torch.randn(24), "c_proj.weight": torch.randn(8, 8),
          "c_proj.bias": torch.empty(8, device="meta")}
    kept = {k: v.clone() for k, v in gpt2.state_dict().items()}
    with pytest.raises(ValueError, match=r"no values: c_proj.bias"):
        hw.convert.gpt2_attention_from_hf(gpt2, hf)
    assert all(torch.equal(kept[k], v) for k, v in gpt2.state_dict().items())
    hw.MultiHeadAttention(8, 8, 3, 0.0, 2).to("meta").load_state_dict(state, assign=True)


@pytest.mark.parametrize(
    ("key", "legacy"),
    [("h.0.attn.bias", True), ("h.0.attn.masked_bias", True), ("bias", True), ("masked_bias", True),
     ("h.0.attn.c_attn.bias", False), ("c_proj.bias", False), ("h.0.ln_1.bias", False)],
)
def test_is_legacy_gpt2_buffer(key, legacy):
    assert is_legacy_gpt2_buffer(key) == legacy


def test_hf_transposed_names():
    assert HF_GPT2_TRANSPOSED == ("c_attn.weight", "c_proj.weight", "c_fc.weight")


def test_load_checked_takes_the_books_state_dict_with_its_mask():
    torch.manual_seed(0)
    src, dst = hw.MultiHeadAttention(4, 4, 3, 0.0, 2), hw.MultiHeadAttention(4, 4, 3, 0.0, 2)
    state = src.state_dict()
    assert "mask" in state  # emitted for the book's compatibility, never stored
    load_checked(dst, {k: v for k, v in state.items() if k != "mask"})  # a state dict from elsewhere has none
    load_checked(dst, state)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match=r"wrong shape: mask: expected \(3, 3\), got \(5, 5\)"):
        load_checked(dst, dict(state, mask=torch.zeros(5, 5)))


def test_load_checked_refuses_integer_weights_instead_of_casting_them():
    mha = hw.MultiHeadAttention(4, 4, 3, 0.0, 2)
    state = {k: v.clone() for k, v in mha.state_dict().items()}
    state["W_query.weight"] = torch.ones(4, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"wrong dtype: W_query.weight: expected a floating-point tensor, got torch.int32"):
        load_checked(mha, state)


def test_remap_dtypes_a_float_key_takes_any_float_and_another_key_its_own_dtype_alone():
    dtypes = {"w": torch.float32, "q": torch.int8, "n": torch.int64}
    ok = {"w": torch.zeros(2, dtype=torch.bfloat16), "q": torch.zeros(2, dtype=torch.int8), "n": torch.zeros(2, dtype=torch.int64),
          "free": torch.zeros(2, dtype=torch.int32)}  # a key dtypes does not name takes any dtype
    assert list(remap(ok, dict.fromkeys(ok, (2,)), dtypes=dtypes)) == list(ok)
    bad = {"w": torch.zeros(2, dtype=torch.int32), "q": torch.zeros(2), "n": torch.zeros(2, dtype=torch.int32),
           "f8": torch.zeros(2, dtype=torch.float8_e4m3fn)}  # 8-bit floats: a quantized checkpoint's values, no scales
    with pytest.raises(ValueError, match=r"nothing was loaded") as err:
        remap(bad, dict.fromkeys(bad, (2,)), dtypes={**dtypes, "f8": torch.bfloat16})
    assert str(err.value).splitlines()[1:] == [
        "  wrong dtype: w: expected a floating-point tensor, got torch.int32 (not cast silently)",
        "  wrong dtype: q: expected torch.int8, got torch.float32 (not cast silently)",
        "  wrong dtype: n: expected torch.int64, got torch.int32 (not cast silently)",
        "  wrong dtype: f8: expected a floating-point tensor of 16 bits or more (8-bit floats are a quantized checkpoint's values), "
        "got torch.float8_e4m3fn (not cast silently)",
    ]


def test_two_keys_for_one_parameter_are_refused_naming_both():
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=4))
    hf = {k: v.T if k.endswith("weight") else v for k, v in attn.state_dict().items()}  # Conv1D layout
    layer0 = {f"h.0.attn.{k}": v for k, v in hf.items()}
    layer1 = {f"h.1.attn.{k}": v + 1 for k, v in hf.items()}
    with pytest.raises(ValueError, match=r"duplicate: h.0.attn.c_attn.weight and h.1.attn.c_attn.weight both give c_attn.weight"):
        hw.gpt2_attention_from_hf(attn, layer0 | layer1)
    with pytest.raises(ValueError, match=r"duplicate: transformer.h.0.attn.c_attn.bias and h.0.attn.c_attn.bias both give h.0.attn.c_attn.bias"):
        remap(
            {"transformer.h.0.attn.c_attn.bias": torch.zeros(3), "h.0.attn.c_attn.bias": torch.ones(3)}, {"h.0.attn.c_attn.bias": (3,)},
            rename=lambda k: k.removeprefix("transformer."),
        )


@pytest.mark.parametrize("training", [True, False])
def test_conversions_keep_the_mode_and_in_it_the_function(training):
    torch.manual_seed(0)
    wrapper = hw.MultiHeadAttentionWrapper(4, 3, 8, 0.3, 2).train(training)
    gpt2 = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=8, attn_pdrop=0.3, resid_pdrop=0.0)).train(training)
    x4, x8 = torch.randn(2, 5, 4), torch.randn(2, 5, 8)
    for source, convert, x in ((wrapper, hw.wrapper_to_mha, x4), (gpt2, hw.gpt2_to_mha, x8), (hw.gpt2_to_mha(gpt2), hw.mha_to_gpt2, x8)):
        target = convert(source)
        assert target.training == training
        if not training:  # (in training each draws its own dropout)
            torch.testing.assert_close(target(x), source(x), atol=1e-6, rtol=1e-6)


def test_gpt2_to_mha_refuses_to_drop_the_residual_dropout_in_training():
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=8))  # resid_pdrop 0.1, training mode
    with pytest.raises(ValueError, match=r"would drop GPT-2's resid_dropout.p=0\.1; convert it in eval mode"):
        hw.gpt2_to_mha(attn)
    assert not hw.gpt2_to_mha(attn.eval()).training


def test_gpt2_to_mha_reads_the_dropouts_the_module_runs_not_its_config():
    """The forward drops with the module's ``nn.Dropout``s: a ``.p`` set on them (as ``for m in model.modules(): m.p = 0``
    does) is what the conversion keeps or refuses, whatever the config says."""
    config = hw.GPT2Config(n_embd=8, n_head=2, n_positions=8, attn_pdrop=0.1, resid_pdrop=0.1)
    attn = hw.GPT2MultiHeadAttention(config)  # training mode
    attn.attn_dropout.p, attn.resid_dropout.p = 0.0, 0.0
    mha = hw.gpt2_to_mha(attn)  # converts: nothing is dropped after c_proj
    assert mha.dropout.p == 0.0 and mha.training
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(mha(x), attn(x), atol=1e-6, rtol=1e-6)  # both drop nothing, in training mode too
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=8, attn_pdrop=0.0, resid_pdrop=0.0))
    attn.resid_dropout.p = 0.5
    with pytest.raises(ValueError, match=r"resid_dropout.p=0\.5"):
        hw.gpt2_to_mha(attn)


@torch.no_grad()
def test_conversions_of_projections_without_bias_keep_the_function():
    """A bias-less c_attn, c_proj or out_proj (each module's forward runs without one) converts to the same function."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=8, attn_pdrop=0.0, resid_pdrop=0.0)).double().eval()
    attn.c_attn = torch.nn.Linear(8, 24, bias=False, dtype=torch.float64)
    attn.c_proj = torch.nn.Linear(8, 8, bias=False, dtype=torch.float64)
    mha = hw.gpt2_to_mha(attn)
    assert mha.W_query.bias is None
    torch.testing.assert_close(mha(x), attn(x), atol=1e-12, rtol=1e-12)
    mha.out_proj = torch.nn.Linear(8, 8, bias=False, dtype=torch.float64)
    torch.testing.assert_close(hw.mha_to_gpt2(mha)(x), mha(x), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("layer", ["W_query", "W_key", "W_value"])
@pytest.mark.parametrize("bias", [True, False])
def test_wrapper_to_mha_refuses_heads_whose_three_projections_differ_in_bias(layer, bias):
    """MultiHeadAttention has one ``qkv_bias``: heads whose one projection has a bias the others have not (each head
    alike) are refused by name rather than converted without it (or with a crash)."""
    wrapper = hw.MultiHeadAttentionWrapper(6, 2, 8, 0.0, num_heads=3, qkv_bias=not bias)
    for head in wrapper.heads:
        setattr(head, layer, torch.nn.Linear(6, 2, bias=bias))
    with pytest.raises(ValueError, match=r"one qkv_bias for W_query, W_key and W_value: the heads' biases are \(W_query, W_key, W_value\)"):
        hw.wrapper_to_mha(wrapper)
    wrapper = hw.MultiHeadAttentionWrapper(6, 2, 8, 0.0, num_heads=3)
    for head in wrapper.heads:
        setattr(head, layer, torch.nn.Linear(6, 3))
    with pytest.raises(ValueError, match=r"W_query, W_key and W_value of \(d_out, d_in\) = \(2, 6\)"):
        hw.wrapper_to_mha(wrapper)
    wrapper.heads = torch.nn.ModuleList()
    with pytest.raises(ValueError, match=r"at least one head: wrapper.heads is empty"):
        hw.wrapper_to_mha(wrapper)


@pytest.mark.parametrize(("change", "named"), [
    (lambda w: setattr(w.heads[1], "causal", False), "causal=False"),
    (lambda w: w.heads.__setitem__(1, hw.CausalAttention(4, 3, 8, 0.0, qkv_bias=True)), r"biases=\(True, True, True\)"),
    (lambda w: w.heads.__setitem__(1, hw.CausalAttention(4, 5, 8, 0.0)), "d_out=5"),
    (lambda w: w.heads.__setitem__(1, torch.nn.Identity()), "must be one, got Identity"),
])
def test_wrapper_to_mha_needs_alike_heads(change, named):
    wrapper = hw.MultiHeadAttentionWrapper(4, 3, 8, 0.0, 3)
    change(wrapper)
    with pytest.raises((ValueError, TypeError), match=rf"heads\[1\].*{named}"):
        hw.wrapper_to_mha(wrapper)


def test_gpt2_attention_from_hf_names_its_arguments():
    attn = hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=8))
    with pytest.raises(TypeError, match=r"gpt2_attention_from_hf converts a GPT2MultiHeadAttention: module must be one, got NoneType"):
        hw.gpt2_attention_from_hf(None, {})
    with pytest.raises(TypeError, match=r"state must be a mapping of names to tensors \(a state dict\), got NoneType"):
        hw.gpt2_attention_from_hf(attn, None)
