"""A Llama-family layer's decode step in one C++ op (``models/native_layer.py``): where it runs, the flat step's logits and
caches are the unchecked forward's bit for bit; it runs at every one-token step after a layer's first where each part
takes its op, and the layer runs in Python where one does not."""

from __future__ import annotations

import pytest
import torch
from test_flat_step import model_of, steps_both_ways

from headwise.backends import decode_kernel
from headwise.backends.spec import Spec
from headwise.linear import onednn, panels
from headwise.models import native_layer
from headwise.models.gpt2 import GPT2LMHeadModel
from headwise.models.llama import LlamaForCausalLM, Qwen3ForCausalLM
from headwise.quantize import int8_weights

pytestmark = pytest.mark.skipif(not decode_kernel.available(), reason="the C++ decode kernel could not be built here")

WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)  # every projection on the panels
GPT2_WIDE = dict(n_embd=512, n_head=8)


@pytest.fixture
def ran(monkeypatch):
    """The steps the op ran (``NativeLayer`` answered a tensor), counted."""
    runs = []
    call = native_layer.NativeLayer.__call__

    def counted(self, *args):
        out = call(self, *args)
        runs.append(out is not None)
        return out

    monkeypatch.setattr(native_layer.NativeLayer, "__call__", counted)
    return runs


def _takes_op(model, batch: int) -> bool:
    """Whether every projection group of the first layer keeps a call the op runs for a step of ``batch`` rows."""
    from headwise.functional import KernelCall

    block = model.blocks[0]
    parts = tuple(getattr(block, name) for name in type(block).flat_parts)
    x = torch.zeros(batch, 1, parts[1].d_in, dtype=parts[0].weight.dtype)
    layer = native_layer.native_layer(parts, KernelCall(None, Spec(1, 1, scale=1.0)), x)
    with torch.no_grad():
        return layer._call_args(x) is not None


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int8 activations"])
@pytest.mark.parametrize("batch,padded", [(1, False), (3, False), (3, True)])
def test_the_layer_in_one_op_gives_the_forwards_logits_and_caches_bit_for_bit(cls, precision, batch, padded, ran):
    wide = WIDE if cls is LlamaForCausalLM else GPT2_WIDE
    model = model_of(cls, wide, torch.bfloat16 if precision == "bf16" else torch.float32)
    if precision.startswith("int8"):
        model = int8_weights(model, activations="int8" if precision == "int8 activations" else "bf16")
    for got, want, flat_caches, plain_caches in steps_both_ways(model, batch, steps=5, padded=padded):
        assert torch.equal(got, want)
        for a, b in zip(flat_caches, plain_caches, strict=True):
            assert len(a) == len(b) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    expected = _takes_op(model, batch)
    assert expected or precision.startswith("int8") or not panels.available(), "float layers of these sizes take the panels where they run"
    assert ran == [True] * (4 * 2) if expected else not any(ran)  # steps 2-5, two layers


def test_where_a_part_takes_no_op_the_layer_runs_in_python(ran):
    """QK-norm and a partial rotation have no op: those layers run in Python, with the same logits. Projections forced
    onto torch's ``F.linear`` or oneDNN's packed weights: the op runs them too."""
    from headwise.linear import rule

    for cls, kw in [(Qwen3ForCausalLM, dict(qk_norm=True, head_dim=32)), (LlamaForCausalLM, dict(partial_rotary_factor=0.5))]:
        for got, want, _, _ in steps_both_ways(model_of(cls, {**WIDE, **kw}, torch.float32), 2, steps=3):
            assert torch.equal(got, want)
    assert ran == []  # no layer was given the op
    with rule.use_path("torch"):
        for got, want, _, _ in steps_both_ways(model_of(LlamaForCausalLM, WIDE, torch.float32), 2, steps=3):
            assert torch.equal(got, want)
    assert ran == [True] * (2 * 2)  # steps 2 and 3, two layers
    if onednn.ops_error(torch.float32) is None:
        for cls, wide in [(LlamaForCausalLM, WIDE), (GPT2LMHeadModel, GPT2_WIDE)]:  # GPT-2's GELU inside oneDNN's GEMM
            ran.clear()
            with rule.use_path("onednn"):
                for got, want, _, _ in steps_both_ways(model_of(cls, wide, torch.float32), 2, steps=3):
                    assert torch.equal(got, want)
            assert ran == [True] * (2 * 2)


def test_weights_changed_between_steps_are_seen_by_the_op(ran):
    """A projection's weight written in place, a norm's weight written and a projection replaced between steps: the
    op runs on what the layers hold now (the kept calls asked again), the forward's logits."""
    model = model_of(LlamaForCausalLM, WIDE, torch.float32)
    gen = steps_both_ways(model, 2, steps=5)
    layer = model.model.layers[1]
    edits = [lambda: layer.mlp.down_proj.weight.mul_(-1.5), lambda: layer.post_attention_layernorm.weight.add_(0.25),
             lambda: setattr(layer.self_attn.o_proj, "weight", torch.nn.Parameter(torch.randn_like(layer.self_attn.o_proj.weight)))]
    for i, (got, want, _, _) in enumerate(gen):
        assert torch.equal(got, want)
        if 1 <= i <= len(edits):
            with torch.no_grad():
                edits[i - 1]()
    assert ran == [True] * (4 * 2)


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_a_projection_module_replaced_between_steps_runs_its_layer_in_python(cls, ran):
    """A layer's projection swapped for another module (a LoRA wrapper, a new ``nn.Linear``) between steps: the op was made
    from the old one, so that layer runs in Python from then on, on the new module: the forward's logits."""
    model = model_of(cls, WIDE if cls is LlamaForCausalLM else GPT2_WIDE, torch.float32)
    mlp = model.blocks[1].mlp
    name = "down_proj" if cls is LlamaForCausalLM else "c_proj"
    old = getattr(mlp, name)
    new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
    for i, (got, want, _, _) in enumerate(steps_both_ways(model, 2, steps=5)):
        assert torch.equal(got, want)
        if i == 2:
            setattr(mlp, name, new)  # after step 3
    assert ran == [True] * 4 + [True, False] * 2  # steps 2-3 both layers in the op; steps 4-5 the second in Python


def test_the_rotary_tables_are_made_once_a_step_for_the_layers_that_share_them(monkeypatch):
    """The Llama's layers share one ``RotaryEmbedding``: a flat step asks it for its tables once, not once a layer."""
    from headwise import rope

    model = model_of(LlamaForCausalLM, WIDE, torch.float32)
    calls = []
    at = rope.RotaryEmbedding.at
    monkeypatch.setattr(rope.RotaryEmbedding, "at", lambda self, *a: calls.append(a[0]) or at(self, *a))
    for padded in (False, True):
        calls.clear()
        for got, want, _, _ in steps_both_ways(model, 2, steps=3, padded=padded):
            assert torch.equal(got, want)
        # the prompt's forward: one a layer; then each step one from the flat step, one a layer from the forward it is held against
        assert len(calls) == len(model.blocks) + 3 * (1 + len(model.blocks))


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_a_model_made_in_inference_mode_steps_in_python(cls, ran):
    """Weights made under ``torch.inference_mode`` have no version counter to watch: no kept call, so the layers run in
    Python every step (no op, no error), the forward's logits."""
    with torch.inference_mode():
        model = model_of(cls, WIDE if cls is LlamaForCausalLM else GPT2_WIDE, torch.float32)
        for got, want, _, _ in steps_both_ways(model, 2, steps=3):
            assert torch.equal(got, want)
    assert not any(ran)
