"""Every architecture of ``architectures.ARCHS`` on ``attn_implementation="headwise"`` against transformers' "eager".

"eager" is the attention transformers keeps for every model, written out in each model's file
(repeated keys and values, an additive finfo.min mask, softcap and sinks by hand): an
implementation independent of headwise's. Per architecture:

- logits (hidden states, for a model without a head) on a padded batch within 1e-4 of the
  largest logit (padded positions are not compared: eager gives a query that sees no key
  uniform weights, headwise zeros), the same on a batch with nothing padded (where transformers
  may skip building a mask), and the attention weights the model returns when asked;
- greedy ``generate`` tokens identical, with a DynamicCache and with a StaticCache;
- a packed row (position_ids restarting at 0, no attention_mask) equals each sequence run alone;
- one backward (of the real outputs weighted by fixed random numbers: a mean square would be
  nearly constant after a final LayerNorm, and its gradients rounding noise): the gradient of
  every parameter within 1e-4 of that parameter's largest.
"""

from __future__ import annotations

import pytest
import torch
from architectures import ARCHS, batch, build, output, real_rows

import headwise.hf

NAME = headwise.hf.register()
TOL = 1e-4
# A gradient sums over every token of the batch and every later layer: float32 rounding in two
# orders of summation reaches ~1e-4 of a small gradient's largest value (BART's q_proj.bias: 1.1e-4).
GRAD_TOL = 3e-4

DECODERS = [a for a in ARCHS if a.kind == "decoder"]
GENERATORS = [a for a in ARCHS if a.kind != "encoder" and a.model is None]  # a model without its head does not generate


def ids(arch) -> str:
    return arch.name


def close(got: torch.Tensor, want: torch.Tensor, what: str, floor: float = 1e-12, tol: float = TOL) -> None:
    """``got`` within ``tol`` of the largest value of ``want`` (or of ``floor``, if larger)."""
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), floor)
    assert err <= tol * scale, f"{what}: max error {err:.3g} against largest {scale:.3g}"


@pytest.fixture(scope="module", params=ARCHS, ids=ids)
def pair(request):
    """(arch, eager model, headwise model): the same weights under both implementations."""
    arch = request.param
    return arch, build(arch, "eager"), build(arch, NAME)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_logits_match_eager(pair, padded):
    arch, eager, ours = pair
    inputs = batch(arch, padded)
    real = real_rows(arch, inputs)  # (B, T)
    with torch.no_grad():
        want, got = output(eager(**inputs)), output(ours(**inputs))  # (B, T, vocab)
    close(got[real], want[real], f"{arch.name} logits")


def test_attention_weights_match_eager_when_asked(pair):
    arch, eager, ours = pair
    inputs = batch(arch)
    with torch.no_grad():
        want, got = eager(**inputs, output_attentions=True), ours(**inputs, output_attentions=True)
    # the real query rows of each kind of weights (a padded query sees no key: eager spreads it evenly, headwise zeroes it)
    rows = {"attentions": real_rows(arch, inputs), "encoder_attentions": inputs.get("attention_mask"), "decoder_attentions": None,
            "cross_attentions": None}  # fmt: skip
    names = ["attentions"] if arch.kind != "seq2seq" else ["encoder_attentions", "decoder_attentions", "cross_attentions"]
    if not arch.weights:  # its layers do not say they want weights: None for each layer, as transformers' sdpa gives
        assert all(g is None for g in got["attentions"]) and all(w is not None for w in want["attentions"])
        return
    for name in names:
        assert len(got[name]) == len(want[name]) > 0 and all(w is not None for w in got[name]), name
        for layer, (g, w) in enumerate(zip(got[name], want[name], strict=True)):  # (B, H, T, S) each
            if rows[name] is not None:
                g, w = g.transpose(1, 2)[rows[name].bool()], w.transpose(1, 2)[rows[name].bool()]  # (real queries, H, S)
            close(g, w, f"{arch.name} {name}[{layer}]")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", GENERATORS, ids=ids)
def test_greedy_generation_matches_eager(arch, cache):
    inputs = batch(arch)
    prompt = {k: v for k, v in inputs.items() if not k.startswith("decoder_")}
    tokens = {}
    for implementation in ("eager", NAME):
        model = build(arch, implementation)
        tokens[implementation] = model.generate(
            **prompt, max_new_tokens=6, do_sample=False, cache_implementation="static" if cache == "static" else None
        )
    assert torch.equal(tokens[NAME], tokens["eager"])


@pytest.mark.parametrize("arch", [a for a in DECODERS if a.packs], ids=ids)
def test_a_packed_row_equals_each_sequence_alone(arch):
    model = build(arch, NAME)
    g = torch.Generator().manual_seed(2)
    lengths = [3, 5, 4]
    seqs = [torch.randint(2, 100, (1, n), generator=g) for n in lengths]
    packed = torch.cat(seqs, dim=1)  # (1, 12)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, 12): 0 1 2 0 1 2 3 4 0 1 2 3
    with torch.no_grad():
        got = output(model(input_ids=packed, position_ids=positions, use_cache=False))[0]  # (12, vocab): packing needs no cache
        want = torch.cat([output(model(input_ids=s))[0] for s in seqs])  # (12, vocab)
    close(got, want, f"{arch.name} packed row")


def test_gradients_of_every_parameter_match_eager(pair):
    arch, eager, ours = pair
    inputs = batch(arch)
    real = real_rows(arch, inputs)  # (B, T)
    grads, probe = {}, None
    for name, model in (("eager", eager), (NAME, ours)):
        model.zero_grad(set_to_none=True)
        logits = output(model(**inputs))[real]  # (real tokens, vocab)
        if probe is None:
            probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))  # (real tokens, vocab)
        (logits * probe).mean().backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    assert grads[NAME].keys() == grads["eager"].keys() and grads[NAME]
    # a gradient that is zero but for rounding (a key bias: softmax ignores a constant per row) is
    # compared at a thousandth of the model's largest gradient
    floor = 1e-3 * max(g.abs().max().item() for g in grads["eager"].values())
    for n, want in grads["eager"].items():
        close(grads[NAME][n], want, f"{arch.name} grad of {n}", floor, GRAD_TOL)
