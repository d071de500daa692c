"""torch.func's transforms (grad, vmap, functional_call ensembles) over the layers and the core: torch's own ops run
under them (the C++ kernels, packed weights and the library's autograd Functions step aside), the same numbers as
autograd and as each call alone; and oneDNN's one-time probe is not fooled by the caller's transform or default dtype."""

import copy
import warnings

import pytest
import torch
from reference_variants import variant_attention
from torch.func import functional_call, grad, stack_module_state, vmap

import headwise as hw
from headwise.linear import onednn, path_for


def _mha(d=512, seed=0, **kwargs):
    torch.manual_seed(seed)
    return hw.MultiHeadAttention(d, d, context_length=16, dropout=0.0, num_heads=8, **kwargs).eval()


def test_grad_of_a_layer_equals_autograds():
    m = _mha()
    x = torch.randn(2, 7, 512)
    got = grad(lambda t: m(t).square().sum())(x)
    xr = x.clone().requires_grad_()
    m(xr).square().sum().backward()
    torch.testing.assert_close(got, xr.grad, rtol=1e-4, atol=1e-5)


def test_vmap_of_a_layer_equals_each_call_alone():
    m = _mha()
    x = torch.randn(3, 2, 7, 512)
    with torch.no_grad():
        got = vmap(m)(x)
        want = torch.stack([m(xi) for xi in x])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("terms", [{"softcap": 5.0}, {"sinks": "sinks"}])
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_grad_through_softcap_and_sinks_equals_the_math_backends_autograd(terms, backend):
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g, dtype=torch.float64) for _ in range(3))
    kw = {"sinks": torch.randn(4, generator=g, dtype=torch.float64)} if "sinks" in terms else terms
    got = grad(lambda t: hw.attention(t, k, v, causal=True, backend=backend, **kw).sum())(q)
    qr = q.clone().requires_grad_()
    hw.attention(qr, k, v, causal=True, backend="math", **kw).sum().backward()
    torch.testing.assert_close(got, qr.grad)


@pytest.mark.parametrize("kwargs", [{}, {"sinks": True}, {"alibi": True}])
def test_an_ensemble_by_stack_module_state_and_vmap_equals_each_model(kwargs):
    # with sinks or slopes: their value checks cannot read a batched tensor and step aside under vmap, as for meta tensors
    models = [_mha(64, seed=s, **kwargs) for s in range(3)]
    for m in models if "sinks" in kwargs else ():
        with torch.no_grad():
            m.sinks.normal_()
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = torch.randn(3, 2, 7, 64)
    with torch.no_grad():
        got = vmap(lambda p, b, xx: functional_call(base, (p, b), (xx,)))(params, buffers, x)
        want = torch.stack([m(xi) for m, xi in zip(models, x, strict=True)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["vmap", "float64 default"])
def test_onednns_probe_runs_in_its_own_float32_whatever_the_caller_runs(where):
    """The probe, run once at the first float32 call that asks it, gives the machine's answer from inside a vmap or under
    another default dtype (it used to fail there, and turn oneDNN off for the whole process)."""
    answer = onednn.ops_error(torch.float32)  # this machine's, from a plain context
    onednn.ops_error.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error" if answer is None else "ignore")
            if where == "vmap":
                vmap(lambda t: t * float(onednn.ops_error(torch.float32) is None))(torch.ones(2))
            else:
                previous = torch.get_default_dtype()
                torch.set_default_dtype(torch.float64)
                try:
                    onednn.ops_error(torch.float32)
                finally:
                    torch.set_default_dtype(previous)
        assert onednn.ops_error(torch.float32) == answer
    finally:
        onednn.ops_error.cache_clear()
    x, w = torch.randn(4, 512), torch.randn(512, 512)
    assert path_for(x, w) == path_for(x.clone(), w)  # the rule answers as before


@pytest.mark.parametrize("t", [1, 10])
@pytest.mark.parametrize("term", ["sinks", "alibi_slopes", "mask"])
def test_a_forward_mode_tangent_on_a_term_alone_gives_the_derivative(term, t):
    # q, k and v plain, the tangent on sinks, ALiBi's slopes or a float mask only: the call takes torch's ops (the C++
    # kernels detach those terms), the derivative a float64 central difference of the reference gives
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(1, 4, n, 16, generator=g) for n in (t, 12, 12))
    value = {"sinks": torch.randn(4, generator=g), "alibi_slopes": torch.rand(4, generator=g),
             "mask": torch.randn(1, 1, t, 12, generator=g)}[term]
    tangent = torch.randn(value.shape, generator=g)
    with fwAD.dual_level():
        out = hw.attention(q, k, v, causal=True, **{term: fwAD.make_dual(value, tangent)})
        got = fwAD.unpack_dual(out).tangent
    assert got is not None
    eps = 1e-6
    plus, minus = (variant_attention(q, k, v, causal=True, **{term: value.double() + s * eps * tangent.double()}) for s in (1, -1))
    torch.testing.assert_close(got.double(), (plus - minus) / (2 * eps), rtol=1e-4, atol=1e-5)


def test_vmap_over_a_float_mask_and_an_int_padding_mask_equals_each_call():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 1, 4, 10, 16, generator=g) for _ in range(3))
    mask = torch.randn(3, 1, 1, 10, 10, generator=g)
    got = vmap(lambda a, b, c, d: hw.attention(a, b, c, mask=d))(q, k, v, mask)
    want = torch.stack([torch.nn.functional.scaled_dot_product_attention(a, b, c, attn_mask=d) for a, b, c, d in zip(q, k, v, mask, strict=True)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    m = _mha(64)
    x = torch.randn(3, 2, 7, 64)
    padding = torch.ones(3, 2, 7, dtype=torch.long)
    padding[0, 0, :2] = 0
    with torch.no_grad():
        got = vmap(lambda xx, a: m(xx, attention_mask=a))(x, padding)
        want = torch.stack([m(xi, attention_mask=ai) for xi, ai in zip(x, padding, strict=True)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_over_documents_alone_equals_each_call():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    docs = torch.tensor([[[0, 0, 0, 1, 1, 1]], [[0, 1, 1, 1, 2, 2]], [[0, 0, 0, 0, 0, 0]]])  # (N, B, T)
    got = vmap(lambda d: hw.attention(q, k, v, causal=True, documents=d))(docs)
    want = torch.stack([hw.attention(q, k, v, causal=True, documents=d) for d in docs])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grad_keeps_the_value_checks():
    # grad's wrapped tensors hold one value each: a NaN sink, a 2 in a padding mask, an id past the vocabulary are
    # still refused by name (only vmap's batched values step aside)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"sinks must hold finite numbers or -inf"):
        grad(lambda s: hw.attention(q, k, v, sinks=s).sum())(torch.tensor([float("nan"), 0.0]))
    m = _mha(64)
    with pytest.raises(ValueError, match=r"attention_mask must hold only 0 \(padding\) and 1 \(real token\)"):
        grad(lambda x: m(x, attention_mask=torch.tensor([[1, 2, 1]])).sum())(torch.randn(1, 3, 64))
    model = hw.models.GPT2LMHeadModel(hw.GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=1, n_head=2)).eval()
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match=r"input_ids must hold ids in \[0, vocab_size=50\)"):
        grad(lambda p: functional_call(model, p, (torch.tensor([[1, 60]]),)).sum())(params)
