"""Tensors on different devices are refused with both devices named, never computed from data that is not there.

The meta device stands in for a second device: a CPU-only machine has it too.
"""

from __future__ import annotations

import pytest
import torch

import headwise as hw

META = torch.device("meta")


def qkv(device_q="cpu", device_k="cpu", device_v="cpu"):
    return (torch.randn(1, 2, 3, 4, device=d) for d in (device_q, device_k, device_v))


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize(("devices", "named"), [(("meta", "cpu", "cpu"), "q on meta, k on cpu, v on cpu"), (("cpu", "cpu", "meta"), "v on meta")])
def test_core_refuses_q_k_v_on_different_devices(backend, devices, named):
    q, k, v = qkv(*devices)
    with pytest.raises(ValueError, match=f"q, k and v must be on one device, got .*{named}"):
        hw.attention(q, k, v, backend=backend)


def test_core_refuses_masks_on_another_device():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"mask is on meta but q, k and v are on cpu"):
        hw.attention(q, k, v, mask=torch.ones(3, 3, dtype=torch.bool, device=META))
    with pytest.raises(ValueError, match=r"attention_mask is on meta but k and v are on cpu"):
        hw.attention(q, k, v, attention_mask=torch.ones(1, 3, dtype=torch.bool, device=META))
    with pytest.raises(ValueError, match=r"attention_mask is on meta but k is on cpu"):
        hw.attention_weights(q, k, attention_mask=torch.ones(1, 3, dtype=torch.bool, device=META))


@pytest.mark.parametrize(
    "module",
    [
        lambda: hw.MultiHeadAttention(8, 8, 16, 0.0, 2),
        lambda: hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=16)),
        lambda: hw.CausalAttention(8, 8, 16, 0.0),
    ],
)
def test_module_refuses_input_on_another_device(module):
    m = module()
    name = "hidden_states" if isinstance(m, hw.GPT2MultiHeadAttention) else "x"
    with pytest.raises(ValueError, match=f"{name} is on meta but {type(m).__name__}'s parameters are on cpu"):
        m(torch.randn(1, 3, 8, device=META))
    with pytest.raises(ValueError, match=f"{name} is on cpu but {type(m).__name__}'s parameters are on meta"):
        m.to(META)(torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match=f"attention_mask is on cpu but {name} is on meta"):
        m(torch.randn(1, 3, 8, device=META), attention_mask=torch.ones(1, 3, dtype=torch.bool))


def test_cache_on_another_device_is_refused_naming_both():
    m = hw.MultiHeadAttention(8, 8, 16, 0.0, 2)
    cache = hw.KVCache(1, 2, 16, 4, device=META)
    with torch.no_grad(), pytest.raises(ValueError, match=r"k is on cpu but the cache is on meta"):
        m(torch.randn(1, 3, 8), cache=cache)
    cache = hw.KVCache(1, 2, 16, 4)
    _, k, v = qkv()
    with pytest.raises(ValueError, match=r"attention_mask is on meta but the cache is on cpu"):
        cache.update(k[:, :2], v[:, :2], torch.ones(1, 3, dtype=torch.bool, device=META))


def test_models_refuse_ids_on_another_device():
    from headwise.models import BertModel, GPT2LMHeadModel
    from headwise.models.bert import BertConfig

    gpt2 = GPT2LMHeadModel(hw.GPT2Config(vocab_size=10, n_positions=8, n_embd=8, n_layer=1, n_head=2))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids is on meta but the model's embeddings are on cpu"):
        gpt2(ids.to(META))
    with pytest.raises(ValueError, match=r"attention_mask is on meta but input_ids is on cpu"):
        gpt2(ids, attention_mask=torch.ones(1, 3, dtype=torch.long, device=META))
    bert = BertModel(BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))
    with pytest.raises(ValueError, match=r"token_type_ids is on meta but the model's embeddings are on cpu"):
        bert(ids, token_type_ids=ids.to(META))


def test_module_refuses_input_of_another_dtype_outside_autocast():
    m = hw.MultiHeadAttention(8, 8, 16, 0.0, 2)
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but MultiHeadAttention's parameters are torch.float32: convert one"):
        m(torch.randn(1, 3, 8, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts inside: a bf16 input is fine there
        assert m(torch.randn(1, 3, 8, dtype=torch.bfloat16)).shape == (1, 3, 8)
