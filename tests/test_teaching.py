"""The book's classes: faithful to ``llms_from_scratch.ch03`` and right by the float64 reference.

Three oracles, each independent of headwise: the book's own package (same seed, same
numbers, same state dicts), the float64 reference in ``reference.py`` (every extra the book
lacks), and ``torch.nn.MultiheadAttention`` (a second implementation of the same layer).
"""

from __future__ import annotations

import pytest
import torch
from helpers import on, reference_weights, tol
from hypothesis import given, settings
from hypothesis import strategies as st
from llms_from_scratch import ch03 as book
from reference import reference_mha
from torch import nn

import headwise as hw

#: "Your journey starts with one step", the book's 3-d embeddings (section 3.3.1).
INPUTS = torch.tensor(
    [[0.43, 0.15, 0.89], [0.55, 0.87, 0.66], [0.57, 0.85, 0.64], [0.22, 0.58, 0.33], [0.77, 0.25, 0.10], [0.05, 0.80, 0.55]]
)
BATCH = torch.stack((INPUTS, INPUTS))  # (2, 6, 3)

#: What the book prints (sections 3.6.1 and 3.6.2, torch.manual_seed(123)), every row.
PRINTED_WRAPPER = torch.tensor(
    [
        [-0.4519, 0.2216, 0.4772, 0.1063],
        [-0.5874, 0.0058, 0.5891, 0.3257],
        [-0.6300, -0.0632, 0.6202, 0.3860],
        [-0.5675, -0.0843, 0.5478, 0.3589],
        [-0.5526, -0.0981, 0.5321, 0.3428],
        [-0.5299, -0.1081, 0.5077, 0.3493],
    ]
)
PRINTED_MHA = torch.tensor([[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593], [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]])


# ----------------------------------------------------------------------------- the printed numbers


def test_the_books_printed_tensors_all_six_rows():
    torch.manual_seed(123)
    wrapper = hw.MultiHeadAttentionWrapper(3, 2, BATCH.shape[1], 0.0, num_heads=2)
    context_vecs = wrapper(BATCH)
    assert context_vecs.shape == (2, 6, 4)
    for row in context_vecs.detach():
        torch.testing.assert_close(row, PRINTED_WRAPPER, atol=5e-5, rtol=0)  # "to 4 decimals"
    torch.manual_seed(123)
    mha = hw.MultiHeadAttention(3, 2, BATCH.shape[1], 0.0, num_heads=2)
    context_vecs = mha(BATCH)
    assert context_vecs.shape == (2, 6, 2)
    for row in context_vecs.detach():
        torch.testing.assert_close(row, PRINTED_MHA, atol=5e-5, rtol=0)


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
def test_printed_numbers_hold_in_every_backend(backend, device):
    torch.manual_seed(123)
    mha = hw.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2, backend=backend).to(device)
    torch.testing.assert_close(mha(BATCH.to(device))[0].detach().cpu(), PRINTED_MHA, atol=5e-5, rtol=0)


def test_exercise_3_2_two_dimensional_output():
    torch.manual_seed(123)
    wrapper = hw.MultiHeadAttentionWrapper(3, 1, 6, 0.0, num_heads=2)
    assert wrapper(BATCH).shape == (2, 6, 2)


def test_exercise_3_3_gpt2_size_parameter_count():
    mha = hw.MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12)
    n = sum(p.numel() for p in mha.parameters())
    assert n == 2_360_064 == 4 * 768 * 768 + 768  # W_query/W_key/W_value without bias, out_proj with
    assert n == sum(p.numel() for p in book.MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12).parameters())


# ----------------------------------------------------------------------------- the book as oracle


@st.composite
def book_configs(draw):
    num_heads = draw(st.integers(1, 4))
    context_length = draw(st.integers(1, 8))
    return {
        "d_in": draw(st.integers(1, 8)),
        "head_dim": draw(st.integers(1, 5)),
        "num_heads": num_heads,
        "context_length": context_length,
        "qkv_bias": draw(st.booleans()),
        "tokens": draw(st.integers(1, context_length)),
        "batch": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "backend": draw(st.sampled_from(["math", "sdpa", "auto"])),
    }


def _pair(cls_ours, cls_book, c: dict, d_out: int, with_heads: bool):
    args = (c["d_in"], d_out, c["context_length"], 0.0) + ((c["num_heads"],) if with_heads else ())
    torch.manual_seed(c["seed"])
    ours = cls_ours(*args, c["qkv_bias"], backend=c["backend"])
    torch.manual_seed(c["seed"])
    theirs = cls_book(*args, c["qkv_bias"])
    x = torch.rand(c["batch"], c["tokens"], c["d_in"], generator=torch.Generator().manual_seed(c["seed"]))
    return ours.eval(), theirs.eval(), x


def _same_parameters_same_numbers(ours: nn.Module, theirs: nn.Module, x: torch.Tensor) -> None:
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(p, q), name  # the same seed drew the same weights
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)


@settings(max_examples=100)  # the book's claim: many configurations
@given(c=book_configs())
def test_mha_same_seed_same_numbers_as_the_book(c):
    ours, theirs, x = _pair(hw.MultiHeadAttention, book.MultiHeadAttention, c, c["num_heads"] * c["head_dim"], True)
    _same_parameters_same_numbers(ours, theirs, x)


@settings(max_examples=100)  # the book's claim: many configurations
@given(c=book_configs())
def test_wrapper_same_seed_same_numbers_as_the_book(c):
    ours, theirs, x = _pair(hw.MultiHeadAttentionWrapper, book.MultiHeadAttentionWrapper, c, c["head_dim"], True)
    _same_parameters_same_numbers(ours, theirs, x)


@settings(max_examples=100)  # the book's claim: many configurations
@given(c=book_configs())
def test_causal_attention_same_seed_same_numbers_as_the_book(c):
    ours, theirs, x = _pair(hw.CausalAttention, book.CausalAttention, c, c["head_dim"], False)
    _same_parameters_same_numbers(ours, theirs, x)


# ----------------------------------------------------------------------------- state dicts


MODULES = [
    pytest.param(lambda m: m.CausalAttention(4, 3, 5, 0.0, True), id="CausalAttention"),
    pytest.param(lambda m: m.MultiHeadAttentionWrapper(4, 3, 5, 0.0, 2), id="MultiHeadAttentionWrapper"),
    pytest.param(lambda m: m.MultiHeadAttention(4, 6, 5, 0.0, 3, True), id="MultiHeadAttention"),
]


@pytest.mark.parametrize("make", MODULES)
def test_state_dict_keys_are_the_books(make):
    ours, theirs = make(hw).state_dict(), make(book).state_dict()
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].shape == theirs[key].shape, key
    mask_keys = [k for k in theirs if k.endswith("mask")]
    assert mask_keys and all(torch.equal(ours[k], theirs[k]) for k in mask_keys)


@pytest.mark.parametrize("make", MODULES)
def test_book_state_dict_loads_strictly_both_ways(make):
    torch.manual_seed(0)
    theirs = make(book).eval()
    ours = make(hw).eval()
    assert ours.load_state_dict(theirs.state_dict(), strict=True) == nn.modules.module._IncompatibleKeys([], [])
    x = torch.rand(2, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)
    torch.manual_seed(1)
    ours2, theirs2 = make(hw).eval(), make(book).eval()
    theirs2.load_state_dict(ours2.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(theirs2(x), ours2(x), atol=1e-6, rtol=1e-5)


def test_book_state_dict_saved_and_reloaded_from_disk(tmp_path):
    torch.manual_seed(0)
    theirs = book.MultiHeadAttention(4, 6, 5, 0.0, 3)
    torch.save(theirs.state_dict(), tmp_path / "mha.pt")
    ours = hw.MultiHeadAttention(4, 6, 5, 0.0, 3)
    ours.load_state_dict(torch.load(tmp_path / "mha.pt", weights_only=True), strict=True)
    assert torch.equal(ours.W_key.weight, theirs.W_key.weight)


def test_mask_is_not_stored_but_matches_the_books_buffer():
    ours = hw.MultiHeadAttention(3, 2, 6, 0.0, 2)
    assert "mask" not in dict(ours.named_buffers())
    assert torch.equal(ours.mask, book.MultiHeadAttention(3, 2, 6, 0.0, 2).mask)


def test_a_long_contexts_weights_load_without_the_books_mask():
    """The book's mask entry is ctx² floats at every ``state_dict()``: the weights alone load strictly, as the docs say."""
    ours = hw.MultiHeadAttention(8, 8, 1 << 17, 0.0, num_heads=2, sinks=True)  # a state dict would build 64 GiB
    weights = {name: p.detach().clone() for name, p in ours.named_parameters()}
    fresh = hw.MultiHeadAttention(8, 8, 1 << 17, 0.0, num_heads=2, sinks=True)
    assert fresh.load_state_dict(weights, strict=True) == nn.modules.module._IncompatibleKeys([], [])
    assert all(torch.equal(p, weights[name]) for name, p in fresh.named_parameters())


@pytest.mark.parametrize("cast", ["half", "bfloat16", "double"])
def test_the_mask_follows_a_cast_as_the_books_buffer_does(cast):
    ours, theirs = getattr(hw.MultiHeadAttention(3, 2, 6, 0.0, 2), cast)(), getattr(book.MultiHeadAttention(3, 2, 6, 0.0, 2), cast)()
    assert ours.state_dict()["mask"].dtype == theirs.state_dict()["mask"].dtype == ours.W_query.weight.dtype
    assert torch.equal(ours.mask, theirs.mask)


def test_a_mask_of_the_wrong_context_length_is_refused():
    """The book's state dict of another context length: refused whole (its weights fit, and are not copied)."""
    ours = hw.MultiHeadAttention(3, 2, 6, 0.0, 2)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    state = book.MultiHeadAttention(3, 2, 4, 0.0, 2).state_dict()
    with pytest.raises(RuntimeError, match=r"nothing was loaded:\n  wrong shape: mask: expected \(6, 6\), got \(4, 4\)$"):
        ours.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())


@pytest.mark.parametrize("make", [lambda: hw.CausalAttention(3, 2, 6, 0.0), lambda: hw.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2),
                                  lambda: hw.MultiHeadAttention(3, 4, 6, 0.0, 2)], ids=["CausalAttention", "Wrapper", "MultiHeadAttention"])  # fmt: skip
def test_the_books_classes_load_all_or_nothing(make):
    """A state dict with one weight of the wrong shape changes none of the others (torch's own load copies those)."""
    ours, other = make(), make()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    state = other.state_dict()
    last = [k for k in state if k.endswith("weight")][-1]
    state[last] = state[last][:1]
    with pytest.raises(RuntimeError, match=rf"wrong shape: {last}"):
        ours.load_state_dict(state)
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
    ours.load_state_dict(other.state_dict())  # and a fitting one loads, the book's mask with it
    assert all(torch.equal(v, w) for v, w in zip(ours.state_dict().values(), other.state_dict().values(), strict=True))


# ----------------------------------------------------------------------------- the float64 reference


@st.composite
def extra_configs(draw):
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    D = draw(st.integers(1, 4))
    T = draw(st.integers(1, 6))
    B = draw(st.integers(1, 3))
    causal = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    kpm = None
    if draw(st.booleans()):
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        pos = torch.arange(T)
        left = draw(st.booleans())
        kpm = pos >= T - lengths[:, None] if left else pos < lengths[:, None]  # (B, T) True = real token
    return {
        "H": H, "Hkv": Hkv, "D": D, "T": T, "B": B, "d_in": draw(st.integers(1, 6)), "causal": causal,
        "window": draw(st.none() | st.integers(1, 4)) if causal else None, "qkv_bias": draw(st.booleans()),
        "kpm": kpm, "g": g, "backend": draw(st.sampled_from(["math", "sdpa", "auto"])),
    }


@given(c=extra_configs())
def test_mha_with_every_extra_matches_the_reference(c, device):
    mha = hw.MultiHeadAttention(
        c["d_in"], c["H"] * c["D"], 8, 0.0, c["H"], c["qkv_bias"],
        causal=c["causal"], window=c["window"], num_kv_heads=c["Hkv"], backend=c["backend"],
    ).double().eval()
    x = torch.randn(c["B"], c["T"], c["d_in"], generator=c["g"], dtype=torch.float64)
    want = reference_mha(
        x, **reference_weights(mha), num_heads=c["H"], num_kv_heads=c["Hkv"], causal=c["causal"], window=c["window"], attention_mask=c["kpm"]
    )
    got = mha.to(device)(x.to(device), attention_mask=on(device, c["kpm"])).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, **tol(device, torch.float64))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("cls", ["wrapper", "causal_attention"])
def test_wrapper_and_causal_attention_match_the_reference(cls, causal, device):
    torch.manual_seed(11)
    kpm = torch.tensor([[False, False, True, True, True], [True, True, True, True, False]])  # left and right padding
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    if cls == "wrapper":
        m = hw.MultiHeadAttentionWrapper(4, 3, 5, 0.0, 3, True, causal=causal).double().eval()
        want = torch.cat([reference_mha(x, **reference_weights(h), num_heads=1, causal=causal, attention_mask=kpm) for h in m.heads], -1)
    else:
        m = hw.CausalAttention(4, 3, 5, 0.0, causal=causal).double().eval()
        want = reference_mha(x, **reference_weights(m), num_heads=1, causal=causal, attention_mask=kpm)
    got = m.to(device)(x.to(device), attention_mask=kpm.to(device)).cpu()
    torch.testing.assert_close(got, want, **tol(device, torch.float64))


def test_bidirectional_sees_the_future():
    torch.manual_seed(12)
    mha = hw.MultiHeadAttention(3, 4, 6, 0.0, 2, causal=False).eval()
    x = torch.rand(1, 6, 3)
    y = mha(x)
    x2 = x.clone()
    x2[0, -1] += 1.0  # change only the last token
    assert not torch.allclose(mha(x2)[0, 0], y[0, 0])  # the first token notices
    causal = hw.MultiHeadAttention(3, 4, 6, 0.0, 2).eval()
    assert torch.equal(causal(x2)[0, :-1], causal(x)[0, :-1])  # causal: it does not


def test_padding_leaves_real_tokens_as_if_unpadded():
    """Right padding: the real tokens' outputs equal those of the unpadded sequence."""
    torch.manual_seed(13)
    mha = hw.MultiHeadAttention(3, 4, 6, 0.0, 2).eval()
    x = torch.rand(1, 4, 3)
    padded = torch.cat([x, torch.rand(1, 2, 3)], dim=1)
    kpm = torch.tensor([[True] * 4 + [False] * 2])
    torch.testing.assert_close(mha(padded, attention_mask=kpm)[:, :4], mha(x))
    bi = hw.MultiHeadAttention(3, 4, 6, 0.0, 2, causal=False).eval()
    bi.load_state_dict(mha.state_dict())
    torch.testing.assert_close(bi(padded, attention_mask=kpm)[:, :4], bi(x))


# ----------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize(
    ("ours", "theirs", "heads"),
    [
        (hw.CausalAttention, book.CausalAttention, ()),
        (hw.MultiHeadAttentionWrapper, book.MultiHeadAttentionWrapper, (2,)),
        (hw.MultiHeadAttention, book.MultiHeadAttention, (2,)),
    ],
    ids=["CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention"],
)
def test_dropout_one_drops_every_weight_as_the_book(ours, theirs, heads, backend):
    """nn.Dropout(1.0) zeroes every weight in training: zero context vectors (out_proj's bias after them),
    zero gradients for W_query, W_key, W_value; in eval dropout does nothing."""
    args = (3, 4, 6, 1.0, *heads, True)  # d_in, d_out, context_length, dropout, [num_heads,] qkv_bias
    torch.manual_seed(5)
    mine = ours(*args, backend=backend).train()
    torch.manual_seed(5)
    book_module = theirs(*args).train()
    x = torch.rand(2, 6, 3)
    out, expected = mine(x), book_module(x)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(mine.named_parameters(), book_module.parameters(), strict=True):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(mine.eval()(x), book_module.eval()(x), atol=1e-6, rtol=1e-5)



@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_dropout_train_vs_eval(backend):
    torch.manual_seed(14)
    mha = hw.MultiHeadAttention(8, 8, 16, 0.5, 2, backend=backend)
    ref = hw.MultiHeadAttention(8, 8, 16, 0.0, 2, backend=backend)
    ref.load_state_dict(mha.state_dict())
    x = torch.rand(2, 16, 8)
    mha.train()
    a, b = mha(x), mha(x)
    assert not torch.allclose(a, b) and not torch.allclose(a, ref(x))
    mha.eval()
    assert torch.equal(mha(x), mha(x))
    torch.testing.assert_close(mha(x), ref(x))


# ----------------------------------------------------------------------------- misuse


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: hw.MultiHeadAttention(3, 5, 6, 0.0, num_heads=2), r"d_out \(5\) must be divisible by num_heads \(2\)"),
        (lambda: hw.MultiHeadAttention(3, 4, 6, 1.01, num_heads=2), r"dropout must be a number in \[0, 1\], got 1.01"),
        (lambda: hw.MultiHeadAttention(3, 4, 6, -0.1, num_heads=2), r"dropout must be a number in \[0, 1\], got -0.1"),
        (lambda: hw.CausalAttention(3, 2, 6, 1.5), r"dropout must be a number in \[0, 1\], got 1.5"),
        (lambda: hw.MultiHeadAttentionWrapper(3, 2, 6, 2, 2), r"dropout must be a number in \[0, 1\], got 2"),
        (lambda: hw.MultiHeadAttention(3, 4, 6, 0.0, num_heads=0), r"num_heads must be a positive int, got 0"),
        (lambda: hw.MultiHeadAttention(3, 4, 6, 0.0, 4, num_kv_heads=3), r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
        (lambda: hw.MultiHeadAttention(3, 4, 6, 0.0, 2, causal=False, window=2), r"window .* needs causal=True"),
        (lambda: hw.MultiHeadAttention(3, 4, 6, 0.0, 2, backend="flash"), r"backend must be one of .*got 'flash'"),
        (lambda: hw.CausalAttention(0, 2, 6, 0.0), r"d_in must be a positive int, got 0"),
        (lambda: hw.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=0), r"num_heads must be a positive int, got 0"),
    ],
)
def test_bad_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


MODULES_3_TO_4 = [
    pytest.param(lambda: hw.MultiHeadAttention(3, 4, 6, 0.0, 2), id="MultiHeadAttention"),
    pytest.param(lambda: hw.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2), id="MultiHeadAttentionWrapper"),
    pytest.param(lambda: hw.CausalAttention(3, 4, 6, 0.0), id="CausalAttention"),
]


@pytest.mark.parametrize("make", MODULES_3_TO_4)
@pytest.mark.parametrize(
    ("x", "kpm", "error", "match"),
    [
        (torch.rand(6, 3), None, ValueError, r"x must have shape \(batch, tokens, d_in=3\), got \(6, 3\)"),
        (torch.rand(2, 6, 4), None, ValueError, r"x must have shape \(batch, tokens, d_in=3\), got \(2, 6, 4\)"),
        (torch.rand(1, 7, 3), None, ValueError, r"got 7 tokens, more than context_length=6"),
        (torch.ones(1, 2, 3, dtype=torch.long), None, TypeError, r"x must be a floating-point tensor"),
        (torch.rand(2, 4, 3), torch.ones(2, 5, dtype=torch.bool), ValueError, r"attention_mask must have shape \(batch, tokens\) = \(2, 4\)"),
        (torch.rand(2, 4, 3), torch.ones(2, 4), TypeError, r"attention_mask must be a bool or 0/1 int tensor"),
    ],
)
def test_bad_input(make, x, kpm, error, match):
    with pytest.raises(error, match=match):
        make()(x, attention_mask=kpm)


# ----------------------------------------------------------------------------- torch.nn.MultiheadAttention


def _torch_mha_pair(d=8, h=2, seed=15):
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(d, h, bias=True, batch_first=True).eval()
    ours = hw.MultiHeadAttention(d, d, 16, 0.0, h, qkv_bias=True).eval()
    with torch.no_grad():
        for layer, w, b in zip((ours.W_query, ours.W_key, ours.W_value), theirs.in_proj_weight.chunk(3), theirs.in_proj_bias.chunk(3), strict=True):
            layer.weight.copy_(w)
            layer.bias.copy_(b)
        ours.out_proj.load_state_dict(theirs.out_proj.state_dict())
    return ours, theirs


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_matches_torch_multiheadattention(causal):
    ours, theirs = _torch_mha_pair()
    ours.causal = causal
    x = torch.randn(3, 7, 8)
    attn_mask = torch.ones(7, 7, dtype=torch.bool).triu(1) if causal else None  # torch: True = NOT allowed
    with torch.no_grad():
        want, _ = theirs(x, x, x, attn_mask=attn_mask, need_weights=False)
        torch.testing.assert_close(ours(x), want, atol=1e-6, rtol=1e-5)


def test_padded_batch_torch_gives_nan_we_give_zeros():
    ours, theirs = _torch_mha_pair()
    x = torch.randn(2, 5, 8)
    kpm = torch.tensor([[True] * 5, [False, False, True, True, True]])  # row 1 left-padded; True = real token
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    with torch.no_grad():
        want, _ = theirs(x, x, x, key_padding_mask=~kpm, attn_mask=causal, need_weights=False)  # torch: True = padding
        got = ours(x, attention_mask=kpm)
    dead = torch.zeros(2, 5, dtype=torch.bool)
    dead[1, :2] = True  # left padding + causal: the first two queries of row 1 see only padding
    assert want[dead].isnan().all() and not want[~dead].isnan().any()  # torch's long-standing NaN (pytorch #41508)
    assert not got.isnan().any()
    torch.testing.assert_close(got[~dead], want[~dead], atol=1e-6, rtol=1e-5)
    # a query that sees nothing has a zero context, so only out_proj's bias remains
    torch.testing.assert_close(got[dead], ours.out_proj.bias.detach().expand(2, 8))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_an_all_padding_sequence_gives_zeros_not_nan(backend, causal):
    torch.manual_seed(20)
    mha = hw.MultiHeadAttention(3, 4, 6, 0.0, 2, causal=causal, backend=backend).eval()
    head = hw.CausalAttention(3, 4, 6, 0.0, causal=causal, backend=backend).eval()
    x = torch.rand(2, 4, 3, requires_grad=True)
    kpm = torch.tensor([[True, True, True, False], [False] * 4])  # the second sequence is all padding
    y = mha(x, attention_mask=kpm)
    assert not y.isnan().any()
    torch.testing.assert_close(y[1], mha.out_proj.bias.detach().expand(4, 4))  # zero context, then out_proj
    assert (head(x, attention_mask=kpm)[1] == 0).all()
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()


@pytest.mark.parametrize("cls", [hw.CausalAttention, hw.MultiHeadAttention])
def test_padding_mask_takes_huggingface_meaning_and_refuses_torch_name(cls):
    """``attention_mask``: 1/True = real token (ints or bools). torch's ``key_padding_mask``
    (True = padding) means the opposite, so the name is not taken at all."""
    m = cls(3, 4, 6, 0.0, *([2] if cls is hw.MultiHeadAttention else [])).eval()
    x = torch.rand(2, 5, 3)
    real = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(m(x, attention_mask=real), m(x, attention_mask=real.bool()), rtol=0, atol=0)
    with pytest.raises(TypeError, match="key_padding_mask"):
        m(x, key_padding_mask=real.bool())


def test_a_strict_load_reads_the_books_mask_for_its_shape_only_and_a_bidirectional_layer_emits_none():
    """The book's (ctx, ctx) mask is made by ``state_dict()`` on demand, never to check a load (a context of 20000 made
    3 GB of it to load five small tensors); a bidirectional layer (an encoder's) gives none, and takes a book's."""
    from unittest import mock

    long = hw.MultiHeadAttention(16, 16, 20000, 0.0, 4)
    weights = {k: v.detach().clone() for k, v in long.named_parameters()}
    with mock.patch.object(hw.MultiHeadAttention, "mask", property(lambda self: pytest.fail("the (ctx, ctx) mask was built"))):
        long.load_state_dict(weights)
    torch.manual_seed(0)
    book = hw.MultiHeadAttention(4, 4, 6, 0.0, 2)
    bi = hw.MultiHeadAttention(4, 4, 6, 0.0, 2, causal=False)
    assert "mask" in book.state_dict() and "mask" not in bi.state_dict()
    bi.load_state_dict(book.state_dict())  # the book's state dict, mask and all
    assert all(torch.equal(a, b) for a, b in zip(bi.parameters(), book.parameters(), strict=True))


def test_alibi_slopes_after_a_meta_build_loaded_with_assign():
    """Built on "meta", loaded with ``assign=True`` (no move runs): the slopes, which no state dict holds, are made on the
    weights' device; the module computes what one built on the CPU does."""
    torch.manual_seed(0)
    plain = hw.MultiHeadAttention(16, 16, 8, 0.0, 4, alibi=True).eval()
    with torch.device("meta"):
        lazy = hw.MultiHeadAttention(16, 16, 8, 0.0, 4, alibi=True).eval()
    lazy.load_state_dict(plain.state_dict(), assign=True)
    assert torch.equal(lazy.alibi_slopes, plain.alibi_slopes)
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(lazy(x), plain(x), rtol=0, atol=0)


def test_a_causal_that_is_not_a_bool_is_named_before_a_window_reads_it():
    with pytest.raises(TypeError, match=r"causal must be True or False, got int 0"):
        hw.MultiHeadAttention(16, 16, 8, 0.0, 4, window=2, causal=0)
