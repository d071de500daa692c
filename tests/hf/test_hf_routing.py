"""Models whose attention does not call transformers' ``AttentionInterface``: refused by name, never run silently.

Three ways a model can bypass ``attn_implementation="headwise"``, each with its own refusal:
every attention layer computes attention itself (Bloom: it still builds its masks through
``headwise.hf.mask``, which refuses the architecture), the model picks its attention class from
a table of its own (Falcon: transformers' bare ``KeyError``, named by ``load``), or only some
layers do (CLAP's audio tower: ``check``).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from architectures import ENCODER, SMALL
from torch import nn

import headwise
from headwise.hf import routing

NAME = headwise.hf.register()
BLOOM = dict(hidden_size=32, n_layer=2, n_head=4, vocab_size=100)
GPT_NEO = dict(hidden_size=32, num_layers=2, num_heads=4, vocab_size=100, attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
               bos_token_id=1, eos_token_id=None)  # fmt: skip


def test_an_architecture_that_never_calls_the_interface_is_refused_at_its_first_forward():
    """Bloom builds its masks through headwise's mask function but adds them to scores of its own."""
    model = tf.AutoModelForCausalLM.from_config(tf.BloomConfig(**BLOOM), attn_implementation=NAME).eval()
    with pytest.raises(TypeError, match=r"attn_implementation='headwise' cannot run 'bloom' models: their attention layers \(BloomAttention\) "
                                        r"compute attention themselves .* load the model with attn_implementation='eager' or 'sdpa'"):  # fmt: skip
        model(input_ids=torch.randint(2, 100, (1, 5)))


def test_never_routed_names_the_classes_of_such_an_architecture_and_none_of_one_that_routes():
    tf.AutoModelForCausalLM.from_config(tf.BloomConfig(**BLOOM))  # its model file is loaded
    tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**SMALL))
    assert routing.never_routed(tf.BloomConfig) == ("BloomAttention",)
    assert routing.never_routed(tf.LlamaConfig) == ()
    assert routing.never_routed(tf.ClapConfig) == ()  # its text tower calls the interface, its audio tower does not


def test_load_names_an_architecture_that_looks_its_attention_class_up_in_a_table_of_its_own():
    with pytest.raises(TypeError, match=r"GPTNeoAttention \(transformers.models.gpt_neo.modeling_gpt_neo\) picks its attention class from a "
                                        r"table of its own, .* no entry for 'headwise', so this architecture cannot run on headwise"):  # fmt: skip
        headwise.hf.load(tf.AutoModelForCausalLM, tf.GPTNeoConfig(**GPT_NEO))


class _Raises:
    """A model class whose ``from_config`` raises the KeyError it is given."""

    key = "headwise"

    @classmethod
    def from_config(cls, config, **kwargs):
        raise KeyError(cls.key)


def test_load_names_the_lookup_only_for_its_own_name_and_passes_other_key_errors_on():
    with pytest.raises(TypeError, match=r"attn_implementation='headwise': its layers pick"):
        headwise.hf.load(_Raises, tf.BertConfig(**ENCODER))
    _Raises.key = "something_else"
    with pytest.raises(KeyError, match="something_else"):
        headwise.hf.load(_Raises, tf.BertConfig(**ENCODER))


def test_check_names_the_layers_of_a_model_that_compute_attention_themselves():
    config = tf.ClapConfig(text_config=dict(**ENCODER), audio_config=dict(hidden_size=32, depths=[1, 1], num_attention_heads=[2, 2]))
    torch.manual_seed(0)
    model = tf.ClapModel(config)
    model.set_attn_implementation(NAME)
    with pytest.raises(TypeError, match=r"ClapModel does not run every attention layer on headwise: its layers of class ClapAudioSelfAttention "
                                        r"compute attention themselves .*\(allow=\{'ClapAudioSelfAttention'\} accepts them\)"):  # fmt: skip
        headwise.hf.check(model)
    assert headwise.hf.check(model.text_model) is model.text_model  # the text tower alone runs on headwise
    assert headwise.hf.check(model, allow={"ClapAudioSelfAttention"}) is model  # accepted by name
    with pytest.raises(TypeError, match=r"allow must be an iterable of class names \(str\), got 'ClapAudioSelfAttention'"):
        headwise.hf.check(model, allow="ClapAudioSelfAttention")


def test_check_names_an_architecture_that_never_reaches_headwise_at_all():
    """DeBERTa builds its masks itself: nothing reaches headwise, nothing fails, and check says so."""
    model = tf.AutoModel.from_config(tf.DebertaV2Config(**ENCODER), attn_implementation=NAME).eval()
    calls = []
    with headwise.observe(lambda step, t: calls.append(step)):
        model(input_ids=torch.randint(2, 100, (1, 5)))
    assert calls == []  # headwise was never called
    with pytest.raises(
        TypeError, match=r"DebertaV2Model does not run every attention layer on headwise: its layers of class DisentangledSelfAttention"
    ):
        headwise.hf.check(model)


def test_check_names_the_encoder_layers_of_a_model_whose_decoder_alone_calls_the_interface():
    """BigBird-Pegasus's encoder reads the mask headwise builds as eager's additive one: check is what says so."""
    config = tf.BigBirdPegasusConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    assert routing.never_routed(tf.BigBirdPegasusConfig) == ()  # its decoder layers call attend: not refused as a whole
    model = tf.AutoModel.from_config(config, attn_implementation=NAME)
    with pytest.raises(TypeError, match=r"BigBirdPegasusModel does not run every attention layer on headwise: its layers of class "
                                        r"BigBirdPegasusBlockSparseAttention"):  # fmt: skip
        headwise.hf.check(model)


def test_check_names_a_model_on_another_implementation():
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**SMALL), attn_implementation="sdpa")
    with pytest.raises(
        TypeError, match=r"LlamaForCausalLM does not run on headwise: LlamaForCausalLM runs attention on 'sdpa'; load it with"
    ):
        headwise.hf.check(model)
    model.set_attn_implementation(NAME)
    assert headwise.hf.check(model) is model


def test_check_refuses_what_is_not_a_transformers_model():
    with pytest.raises(TypeError, match=r"model must be a transformers PreTrainedModel \(an nn.Module\), got int"):
        headwise.hf.check(3)
    with pytest.raises(TypeError, match=r"model must be a transformers PreTrainedModel or hold one, got Linear holding none"):
        headwise.hf.check(nn.Linear(2, 2))


def test_load_checks_what_it_loads_and_keeps_the_implementation_to_itself():
    model = headwise.hf.load(tf.AutoModel, tf.BertConfig(**ENCODER))
    assert type(model).__name__ == "BertModel" and model.config._attn_implementation == NAME
    with pytest.raises(TypeError, match=r"load sets attn_implementation itself \(to headwise\), got attn_implementation='eager'"):
        headwise.hf.load(tf.AutoModel, tf.BertConfig(**ENCODER), attn_implementation="eager")
    for allow in ((), {"BloomAttention"}):  # its masks are headwise's, its layers never call it: refused whatever allow says
        with pytest.raises(TypeError, match=r"attn_implementation='headwise' cannot run 'bloom' models: their attention layers "
                                            r"\(BloomAttention\) compute attention themselves"):  # fmt: skip
            headwise.hf.load(tf.AutoModelForCausalLM, tf.BloomConfig(**BLOOM), allow=allow)
    assert routing.masks_through_interface(tf.BloomConfig) and not routing.masks_through_interface(tf.DebertaV2Config)


def test_load_refuses_a_checkpoint_that_leaves_weights_at_their_random_start(tmp_path):
    """A checkpoint missing a tensor: ``from_pretrained`` would initialise it at random and say so in a log line;
    ``load`` names it (every one) unless ``strict=False``. Tensors the model has no place for are ignored as
    transformers ignores them (a causal LM's head under ``AutoModel``); the loaded weights are the checkpoint's."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)
    source = tf.LlamaForCausalLM(config)
    source.save_pretrained(tmp_path)
    model = headwise.hf.load(tf.AutoModelForCausalLM, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values(), strict=True))
    assert type(headwise.hf.load(tf.AutoModel, tmp_path)).__name__ == "LlamaModel"  # lm_head.weight: unexpected, ignored
    model, info = headwise.hf.load(tf.AutoModelForCausalLM, tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    state = load_file(tmp_path / "model.safetensors")
    gone = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    save_file({k: v for k, v in state.items() if k not in gone}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"(?s)left weights at their random start \(strict=True\):\n  missing: "
                       r"model.layers.1.mlp.up_proj.weight\n  missing: model.norm.weight\npass strict=False"):
        headwise.hf.load(tf.AutoModelForCausalLM, tmp_path)
    assert type(headwise.hf.load(tf.AutoModelForCausalLM, tmp_path, strict=False)).__name__ == "LlamaForCausalLM"
    save_file({**state, "model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"(?s)left weights at their random start \(strict=True\):\n  wrong shape: "
                       r"model.layers.0.mlp.up_proj.weight: checkpoint \(3, 3\), model \(64, 32\)"):  # (a RuntimeError naming none)
        headwise.hf.load(tf.AutoModelForCausalLM, tmp_path)
    with pytest.raises(TypeError, match=r"strict must be True or False, got int 1"):
        headwise.hf.load(tf.AutoModelForCausalLM, tmp_path, strict=1)


def test_how_a_class_is_judged_from_its_source():
    assert routing.routes(tf.models.llama.modeling_llama.LlamaAttention)
    assert not routing.computes_attention_itself(tf.models.llama.modeling_llama.LlamaAttention)
    assert routing.computes_attention_itself(tf.models.bloom.modeling_bloom.BloomAttention)
    assert routing.computes_attention_itself(nn.MultiheadAttention)
    # a softmax by another name: Reformer's exp(x - logsumexp(x)), ESMFold's softmax_no_cast (check passed them)
    assert routing.computes_attention_itself(tf.models.reformer.modeling_reformer.LSHSelfAttention)
    assert routing.computes_attention_itself(tf.models.esm.modeling_esmfold.EsmFoldAttention)
    assert not routing.computes_attention_itself(tf.models.bert.modeling_bert.BertAttention)  # holds the layer that routes
    namespace: dict = {}
    exec("import torch\nclass MyAttention(torch.nn.Module):\n    def forward(self, s):\n        return s.softmax(-1)\n", namespace)
    assert not routing.computes_attention_itself(namespace["MyAttention"])  # no source to read: not judged
