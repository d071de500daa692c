"""``load_state_dict`` on headwise's causal models: all-or-nothing when strict, torch's rules otherwise."""

import pytest
import torch

from headwise import GPT2Config
from headwise.convert import StateDictError
from headwise.models import GPT2LMHeadModel, LlamaForCausalLM
from headwise.models.llama_config import LlamaConfig
from headwise.quantize import int8_weights


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=32, n_embd=32, n_layer=2, n_head=4)).eval()


def llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=32)).eval()  # fmt: skip


MODELS = {"gpt2": gpt2, "llama": llama}


def snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model, before):
    return model.state_dict().keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", MODELS)
def test_a_state_dict_that_does_not_fit_changes_nothing_and_names_every_problem(name):
    torch.manual_seed(0)
    model, other = MODELS[name](), MODELS[name]()
    before = snapshot(model)
    bad = other.state_dict()
    first, second = list(bad)[:2]
    bad.pop(first)  # missing
    bad[second] = bad[second][:1]  # wrong shape
    bad["extra.weight"] = torch.zeros(2)  # unexpected
    with pytest.raises(StateDictError, match=rf"(?s)nothing was loaded:.*missing: {first}.*unexpected: extra\.weight.*wrong shape: {second}"):
        model.load_state_dict(bad)
    assert unchanged(model, before)  # torch's own load copies every entry that fits before it raises
    with pytest.raises(RuntimeError):  # a RuntimeError too, as torch's load_state_dict raises
        model.load_state_dict(bad)


def test_an_int8_state_dict_into_a_float_model_is_refused_whole():
    """The int8 model's weights are int8 and it has scales: every key named, no int8 value cast into a float weight."""
    torch.manual_seed(0)
    model, quantized = gpt2(), int8_weights(gpt2())
    before = snapshot(model)
    with pytest.raises(StateDictError, match=r"(?s)unexpected: transformer\.h\.0\.attn\.c_attn\.scales.*wrong dtype: transformer\.h\.0\.attn\.c_attn\.weight"):
        model.load_state_dict(quantized.state_dict())
    assert unchanged(model, before)
    again = int8_weights(gpt2())
    again.load_state_dict(quantized.state_dict())  # into an int8 model: loads
    assert unchanged(again, quantized.state_dict())


@pytest.mark.parametrize("name", MODELS)
def test_a_fitting_state_dict_loads_and_strict_false_keeps_torchs_rules(name):
    torch.manual_seed(0)
    model, other = MODELS[name](), MODELS[name]()
    model.load_state_dict(other.state_dict())
    assert unchanged(model, other.state_dict())
    partial = MODELS[name]().state_dict()
    dropped = next(iter(partial))
    partial.pop(dropped)
    result = model.load_state_dict(partial, strict=False)
    assert result.missing_keys == [dropped] and result.unexpected_keys == []
