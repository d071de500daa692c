"""``headwise.hf``: what ``register`` puts into transformers, what ``attend`` refuses, dropout in training."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as tf
from architectures import SMALL
from torch import nn

import headwise
import headwise.hf


def test_register_puts_both_the_attention_and_its_mask_into_transformers():
    assert headwise.hf.register() == "headwise"
    assert tf.AttentionInterface._global_mapping["headwise"] is headwise.hf.attend
    # without the mask function under the same name transformers silently passes no mask at all
    assert tf.AttentionMaskInterface._global_mapping["headwise"] is headwise.hf.mask


def test_register_under_another_name_and_a_model_runs_on_it():
    name = headwise.hf.register("headwise_other")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)).eval()
    seen = []
    with headwise.observe(lambda step, t: seen.append(step)):
        model.set_attn_implementation(name)
        model(input_ids=torch.randint(2, 100, (1, 5)))
    assert model.config._attn_implementation == name
    assert seen.count("context") == SMALL["num_hidden_layers"]  # each layer's attention ran on headwise.attention


def test_without_the_mask_function_transformers_passes_no_mask():
    """Why ``register`` registers both: an attention function alone gets None for a padded batch."""
    masks = []

    def spy(module, q, k, v, attention_mask, **kwargs):
        masks.append(attention_mask)
        return headwise.hf.attend(module, q, k, v, attention_mask, **kwargs)

    tf.AttentionInterface.register("headwise_spy", spy)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)).eval()
    model.set_attn_implementation("headwise_spy")
    padding = torch.tensor([[0, 1, 1, 1]])
    model(input_ids=torch.randint(2, 100, (1, 4)), attention_mask=padding)
    assert masks and all(m is None for m in masks)
    headwise.hf.register("headwise_spy")  # now with the mask: the padding arrives
    masks.clear()
    tf.AttentionInterface.register("headwise_spy", spy)
    model(input_ids=torch.randint(2, 100, (1, 4)), attention_mask=padding)
    assert all(m is not None and m.dtype == torch.bool and not m[0, 0, :, 0].any() for m in masks)


class _Layer(nn.Module):
    is_causal = True


def _qkv():
    return torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("cu_seq_lens_q", torch.tensor([0, 3]), r"does not support packed sequences given as cumulative lengths .*'cu_seq_lens_q'"),
        ("indices", torch.zeros(1, 3, 2, dtype=torch.long), r"does not support sparse attention over selected key indices: .*'indices'"),
        ("cache", object(), r"does not support a paged KV cache"),
        ("sinks", torch.zeros(1, 2, 3, 1), r"does not support a sink logit per query \(headwise's sinks are one per head.*'sinks'"),
        ("some_new_bias", torch.zeros(1), r"got an argument it does not know, 'some_new_bias' \(Tensor\): rather than ignore"),
    ],
)
def test_an_argument_that_would_change_the_result_is_refused_by_name(name, value, match):
    with pytest.raises(TypeError, match=match):
        headwise.hf.attend(_Layer(), *_qkv(), None, **{name: value})


def test_bookkeeping_arguments_pass_and_the_output_is_b_t_h_dv():
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 5)  # GQA, Dv != D
    out, weights = headwise.hf.attend(_Layer(), q, k, v, None, position_ids=torch.arange(3)[None], use_cache=True, sliding_window=None)
    assert out.shape == (2, 3, 4, 5) and weights is None
    want = headwise.attention(q, k, v, causal=True).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_every_argument_transformers_passes_down_is_inert_refused_or_attends_own():
    # TransformersKwargs reach every layer's attention function (the Trainer's num_items_in_batch with every batch)
    from transformers.utils.generic import TransformersKwargs

    own = {"attention_mask", "dropout", "scaling", "is_causal", "softcap", "s_aux", "position_bias", "output_attentions"}
    assert set(TransformersKwargs.__annotations__) <= headwise.hf.INERT | set(headwise.hf.REFUSED) | own


def test_a_llama_trained_through_the_loss_normaliser_gives_eagers_loss():
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)).eval()
    ids = torch.randint(2, 100, (2, 7))
    losses = []
    for name in ("eager", headwise.hf.register()):
        model.set_attn_implementation(name)
        losses.append(model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(12)).loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)


def test_bad_tensors_reach_the_core_checks():
    with pytest.raises(ValueError, match=r"k must have shape \(B=1, Hkv, S, D=4\)"):
        headwise.hf.attend(_Layer(), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 5), torch.randn(1, 2, 3, 4), None)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_a_query_key_or_value_that_is_not_a_tensor_is_named(which):
    qkv = [torch.randn(1, 2, 3, 4) for _ in range(3)]
    qkv[which] = "q"  # (an AttributeError on .shape)
    with pytest.raises(TypeError, match=rf"{['query', 'key', 'value'][which]} must be a torch.Tensor of shape \(B, H, T, D\), got str"):
        headwise.hf.attend(_Layer(), *qkv, None)


def test_load_names_a_model_class_or_allow_that_is_not_one_before_building():
    config = tf.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=100)
    with pytest.raises(TypeError, match=r"model_class must be a transformers model class \(AutoModelForCausalLM, LlamaForCausalLM, ...\), got None"):
        headwise.hf.load(None, config)
    with pytest.raises(TypeError, match=r"allow must be an iterable of class names \(str\), got 1"):
        headwise.hf.load(tf.AutoModel, config, allow=1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_an_integer_4d_mask_is_named_as_the_models_attention_mask(dtype):
    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match=rf"attention_mask \(the 4D mask the model passed\) must be bool .* got dtype {dtype}"):
        headwise.hf.attend(_Layer(), q, k, v, torch.ones(1, 1, 3, 3, dtype=dtype))


@pytest.mark.parametrize("mask", [None, torch.ones(1, 1, 3, 3, dtype=torch.bool)], ids=["no mask", "a mask"])
@pytest.mark.parametrize("shape", [(1, 2, 3, 5), (3, 4), (2, 2, 3, 3)])
def test_a_position_bias_of_the_wrong_shape_is_named(shape, mask):
    with pytest.raises(
        ValueError, match=rf"position_bias must broadcast to \(B, H, T, S\) = \(1, 2, 3, 3\), got shape {re.escape(str(shape))}"
    ):
        headwise.hf.attend(_Layer(), *_qkv(), mask, position_bias=torch.randn(shape))


def test_a_position_bias_that_is_not_floating_point_is_named():
    with pytest.raises(TypeError, match=r"position_bias must be a floating-point torch.Tensor \(an additive bias\), got dtype torch.int64"):
        headwise.hf.attend(_Layer(), *_qkv(), None, position_bias=torch.zeros(1, 2, 3, 3, dtype=torch.long))


def test_a_position_bias_that_broadcasts_is_added_to_the_scores():
    q, k, v = _qkv()
    bias = torch.randn(1, 1, 3, 3)  # (1, 1, T, S): one bias for every head
    out, _ = headwise.hf.attend(_Layer(), q, k, v, None, position_bias=bias)
    causal = torch.ones(3, 3, dtype=torch.bool).tril()  # (T, S)
    want = headwise.attention(q, k, v, mask=bias.masked_fill(~causal, float("-inf"))).transpose(1, 2)  # (B, T, H, D)
    torch.testing.assert_close(out, want)


def test_register_refuses_a_name_that_is_not_a_string_or_is_transformers_own():
    with pytest.raises(TypeError, match=r"name must be a non-empty str, got 3"):
        headwise.hf.register(3)
    sdpa = tf.AttentionInterface._global_mapping["sdpa"]
    for name in ("sdpa", "eager", "flash_attention_2", "paged|eager", "paged|sdpa"):  # (transformers reads paged|sdpa as sdpa)
        with pytest.raises(ValueError, match=rf"name '{re.escape(name)}' is an attention implementation transformers already has"):
            headwise.hf.register(name)
    with pytest.raises(ValueError, match=r"name 'paged\|mine': transformers reads a name starting with 'paged\|' as the name after it "
                                         r"\('mine'\), so a model loaded with 'paged\|mine' would not run on what is registered under it; "
                                         r"register 'mine'"):
        headwise.hf.register("paged|mine")
    assert tf.AttentionInterface._global_mapping["sdpa"] is sdpa  # nothing replaced
    assert "paged|sdpa" not in tf.AttentionInterface._global_mapping and "paged|mine" not in tf.AttentionInterface._global_mapping
    assert headwise.hf.register("headwise") == "headwise"  # again: its own name


def test_attend_names_transformers_arguments_where_it_refuses_one():
    q, k, v = (torch.randn(1, 4, 3, 8) for _ in range(3))
    with pytest.raises(ValueError, match=r"sinks must have shape .*as q, k, v, mask, dropout_p, scale and sinks\)$"):
        headwise.hf.attend(_Layer(), q, k, v, None, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match=r"scale must be .*hands transformers' query, key, value, attention_mask \(with position_bias\), "
                                         r"dropout, scaling and s_aux"):  # fmt: skip
        headwise.hf.attend(_Layer(), q, k, v, None, scaling=-1.0)


def _dropout_logits(implementation: str, p: float, *, train: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL, attention_dropout=p))
    model.set_attn_implementation(implementation)
    model.train(train)
    ids = torch.randint(2, 100, (2, 7))
    torch.manual_seed(5)
    with headwise.observe(lambda step, t: None):  # observed: headwise's math backend, which drops weights as eager does
        return model(input_ids=ids).logits


def test_dropout_in_training_drops_the_same_weights_as_eager():
    name = headwise.hf.register()
    got, want = _dropout_logits(name, 0.5, train=True), _dropout_logits("eager", 0.5, train=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(got, _dropout_logits(name, 0.5, train=False), atol=1e-3)  # and something was dropped


def test_a_model_headwise_cannot_run_fails_at_the_first_forward_naming_what_it_lacks():
    """DeepSeek-V3.2 hands any attention but eager and sdpa the keys its indexer selected: sparse attention."""
    name = headwise.hf.register()
    config = tf.DeepseekV32Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                  vocab_size=100, max_position_embeddings=64, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                  moe_intermediate_size=16, n_group=1, topk_group=1, index_n_heads=2, index_head_dim=16, index_topk=4)  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()
    padding = torch.tensor([[0, 1, 1, 1, 1, 1]])
    with pytest.raises(TypeError, match=r"does not support sparse attention over selected key indices: transformers passed 'indices'"):
        model(input_ids=torch.randint(2, 100, (1, 6)), attention_mask=padding)


def test_a_static_cache_prefills_weights_span_the_whole_cache_as_eagers_do():
    """A prefill into an empty StaticCache without padding (the mask skipped, keys cut to the prompt's): the weights
    asked for still cover every slot, (B, H, T, max_cache_len), the empty ones 0, as eager gives them."""
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2)
    ids = torch.randint(0, 300, (1, 5))
    eager = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ours = tf.AutoModelForCausalLM.from_config(config, attn_implementation=headwise.hf.register()).eval()
    ours.load_state_dict(eager.state_dict())
    got, want = (m(ids, past_key_values=tf.StaticCache(config=config, max_cache_len=16), use_cache=True, output_attentions=True)
                 for m in (ours, eager))
    assert got.attentions[0].shape == want.attentions[0].shape == (1, 4, 5, 16)
    torch.testing.assert_close(got.attentions[0], want.attentions[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
