"""``compiled_step.structure``: what a compiled step reads from a model besides its weights' values, compared once a
``generate`` call in place of Dynamo's checks of the modules before every step. Equal across calls where nothing
changed (an eager call's caches, RoPE's tables, are left out); different after each kind of change a traced step
could depend on; None where a model holds something it cannot compare (then Dynamo's checks stay).
"""

import copy
import dataclasses
import functools
import threading

import pytest
import torch
from torch import nn

from headwise import GPT2Config
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.compiled_step import structure
from headwise.models.llama import DecoderLayer
from headwise.models.llama_config import LlamaConfig
from headwise.quantize import int8_weights


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


MODELS = {"gpt2": gpt2, "llama": llama, "llama-int8": lambda: int8_weights(llama()), "gpt2-bf16": lambda: gpt2().to(torch.bfloat16)}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


@pytest.mark.parametrize("name", MODELS)
def test_the_same_across_calls_forwards_and_generation(name):
    model = MODELS[name]()
    before = structure(model)
    assert before is not None
    with torch.no_grad():
        model.generate(IDS, max_new_tokens=3)  # RoPE's tables grow (an eager call's cache), the steps kept on the model
        model(torch.randint(0, 97, (1, 40)))
    assert structure(model) == before


@pytest.mark.parametrize("name", MODELS)
def test_the_same_after_the_model_is_copied_or_its_classes_annotations_read(name):
    """``copy.deepcopy`` (or pickling) caches ``__slotnames__`` on the classes of what it copies, the config's among
    them, the first time, and reading ``__annotations__`` of a class that has none writes an empty one: not changes a
    step sees (a compiled step was compiled again after a float64 copy)."""
    model = MODELS[name]()
    classes = {type(m) for m in model.modules()} | {type(m.config) for m in model.modules() if hasattr(m, "config")}
    for cls in classes:  # as in a process that never copied one
        if "__slotnames__" in vars(cls):
            delattr(cls, "__slotnames__")
        if vars(cls).get("__annotations__") == {}:  # an empty one written by an earlier read
            delattr(cls, "__annotations__")
    unannotated = [cls for cls in classes if "__annotations__" not in vars(cls)]
    before = structure(model)
    copy.deepcopy(model)
    assert any("__slotnames__" in vars(cls) for cls in classes)  # what the copy wrote on a class
    assert unannotated and all(cls.__annotations__ == {} for cls in unannotated)  # written on each
    assert structure(model) == before


def _hook(module, args, out):
    return out


def _set(obj, name, value):
    setattr(obj, name, value)


CHANGES = {
    "an attribute's value": lambda m: _set(m.transformer.ln_f, "eps", 0.5),
    "an attribute added": lambda m: _set(m.transformer.h[0].attn, "softcap", 30.0),
    "a forward hook": lambda m: m.transformer.h[1].mlp.register_forward_hook(_hook),
    "a pre-hook on the model": lambda m: m.register_forward_pre_hook(lambda mod, args: None),
    "training mode": lambda m: m.transformer.h[0].train(),
    "a submodule replaced by an equal one": lambda m: _set(m.transformer, "ln_f", nn.LayerNorm(32)),
    "a config replaced by another": lambda m: _set(m, "config", dataclasses.replace(m.config, n_positions=32)),
    "a forward set on the instance": lambda m: _set(m.transformer.h[0].mlp, "forward", lambda x: x),
    "a buffer written in place": lambda m: m.register_buffer("scale", torch.ones(1)) or m.scale.mul_(2),
}


@pytest.mark.parametrize("change", CHANGES)
def test_each_kind_of_change_is_seen(change):
    model = gpt2()
    model.register_buffer("scale", torch.ones(1))
    before = structure(model)
    CHANGES[change](model)
    assert structure(model) != before


def test_a_method_replaced_on_a_class_is_seen(monkeypatch):
    model = llama()
    before = structure(model)
    monkeypatch.setattr(DecoderLayer, "forward", lambda self, *args, **kwargs: None)
    assert structure(model) != before


def test_a_plain_tensor_attribute_written_in_place_is_seen():
    model = llama()
    before = structure(model)
    with torch.no_grad():
        model.rotary.inv_freq.mul_(1.0)  # the same values, a new version: a traced step may have read the old ones
    assert structure(model) != before


def test_a_method_replaced_on_a_shared_helper_is_seen(monkeypatch):
    model = llama()
    before = structure(model)
    monkeypatch.setattr(type(model.rotary), "at", lambda self, *args: None)
    assert structure(model) != before


def test_a_partial_kept_as_an_attribute_is_compared_by_its_arguments():
    model = gpt2()
    model.transformer.h[0].mlp.act2 = functools.partial(torch.clamp, min=0.0)
    before = structure(model)
    model.transformer.h[0].mlp.act2.keywords["min"] = 1.0  # a partial's keywords can be changed in place
    assert structure(model) != before


def _closure(value):
    return lambda x: x * value


class _Scale:
    def __init__(self):
        self.by = 2.0

    def apply(self, x):
        return x * self.by


@pytest.mark.parametrize("what", ["a lock", "an inference tensor", "a function with a closure", "another object's method"])
def test_none_for_what_it_cannot_compare(what):
    model = gpt2()
    attn = model.transformer.h[0].attn
    if what == "a lock":
        attn.lock = threading.Lock()
    elif what == "an inference tensor":
        with torch.inference_mode():
            attn.table = torch.ones(3)
    elif what == "a function with a closure":
        attn.scaled = _closure([2.0])  # the list in its cell can change without the function changing
    else:
        attn.scaled = _Scale().apply  # its object's ``by`` can change without the method changing
    assert structure(model) is None
