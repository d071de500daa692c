"""parallelize's argument errors, on a one-rank gloo group inside the test process (no spawn needed)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate  # noqa: E402

from headwise import GPT2Config, GPT2MultiHeadAttention, MultiHeadAttention, MultiHeadAttentionWrapper  # noqa: E402
from headwise.parallel import parallelize  # noqa: E402


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def mha() -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(16, 16, 8, 0.0, num_heads=4)


def sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def test_one_rank_is_the_module_itself(mesh):
    ref = GPT2MultiHeadAttention(GPT2Config(n_embd=32, n_head=4, n_positions=8, attn_pdrop=0.0, resid_pdrop=0.0))
    tp = parallelize(copy.deepcopy(ref), mesh)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(tp(x), ref(x))
    assert sharded(tp)


def test_mesh_must_be_a_device_mesh(mesh):
    with pytest.raises(TypeError, match=r"device_mesh must be a torch\.distributed\.device_mesh\.DeviceMesh, got str"):
        parallelize(mha(), "cpu")


def test_mesh_must_be_one_dimensional(mesh):
    two_d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"device_mesh must be 1-D .* got a 2-D mesh of shape \(1, 1\); pass its tensor-parallel slice"):
        parallelize(mha(), two_d)
    parallelize(mha(), two_d["tp"])  # its slice is fine


def test_hooks_the_plan_would_hand_shards_to_are_refused_before_anything_changes(mesh):
    m = mha()
    m.W_value.register_forward_hook(lambda mod, args, out: None)
    with pytest.raises(ValueError, match=r"MultiHeadAttention\.W_value has forward_hooks: sharded, it would see DTensors"):
        parallelize(m, mesh)
    assert not sharded(m)
    m = mha()
    m.out_proj.register_full_backward_hook(lambda mod, gin, gout: None)
    with pytest.raises(ValueError, match=r"MultiHeadAttention\.out_proj has backward_hooks"):
        parallelize(m, mesh)


def test_hooks_on_the_attention_module_itself_see_full_tensors(mesh):
    m = mha()
    seen = []
    m.register_forward_hook(lambda mod, args, out: seen.append((args[0], out)))
    x = torch.randn(2, 3, 16)
    out = parallelize(m, mesh)(x)
    (given, returned), = seen
    assert isinstance(given, DTensor) and given.placements == (Replicate(),)  # the shared input: every rank holds all of it
    assert torch.equal(given.full_tensor(), x)
    assert type(returned) is torch.Tensor and torch.equal(returned, out)


def test_a_replaced_projection_is_a_type_error(mesh):
    m = mha()
    m.W_query = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(TypeError, match=r"MultiHeadAttention\.W_query: the plan shards nn\.Linear layers, got Sequential"):
        parallelize(m, mesh)


def test_nothing_to_shard(mesh):
    with pytest.raises(ValueError, match=r"CausalAttention is one head and MultiHeadAttentionWrapper has no output projection"):
        parallelize(MultiHeadAttentionWrapper(4, 2, 8, 0.0, num_heads=2), mesh)
    with pytest.raises(ValueError, match=r"Linear holds no module with a tensor-parallel plan; plans exist for \["):
        parallelize(nn.Linear(4, 4), mesh)


def test_already_parallelized(mesh):
    m = parallelize(mha(), mesh)
    with pytest.raises(ValueError, match=r"W_query\.weight is already a DTensor: the module is already parallelized"):
        parallelize(m, mesh)


def test_parameters_on_another_device_type(mesh):
    with torch.device("meta"):
        m = mha()
    with pytest.raises(ValueError, match=r"W_query\.weight is on meta but device_mesh is a cpu mesh"):
        parallelize(m, mesh)


def test_int8_weights_refuses_a_sharded_model_and_leaves_it_as_it_was(mesh):
    """int8 weights and tensor parallelism do not combine (parallelize refuses an Int8Linear; int8_weights a DTensor):
    named before anything is replaced, where the sharded model's forward failed deep inside torch."""
    from headwise.models import GPT2LMHeadModel
    from headwise.quantize import int8_weights

    torch.manual_seed(0)
    model = parallelize(GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4)).eval(), mesh)
    ids = torch.tensor([[1, 2, 3]])
    want = model(ids)
    with pytest.raises(TypeError, match=r"transformer.h.0.attn.c_attn: weight is a DTensor .* do not combine.*; the model is unchanged"):
        int8_weights(model)
    assert type(model.transformer.h[0].attn.c_attn) is nn.Linear
    torch.testing.assert_close(model(ids), want, rtol=0, atol=0)


def test_a_layer_shared_by_two_modules_is_refused_before_anything_changes(mesh):
    """torch shards a layer once: the second owner's sharding failed with the first already sharded (heads halved)."""
    a, b = mha(), mha()
    b.W_query = a.W_query
    both = nn.ModuleList([a, b])
    with pytest.raises(ValueError, match=r"1\.W_query is also 0\.W_query: a layer shared by two modules cannot be sharded for each"):
        parallelize(both, mesh)
    assert not sharded(both) and a.num_heads == b.num_heads == 4


def test_a_weight_tied_across_sharded_layers_is_refused(mesh):
    """Sharded, each place would hold its own copy: one training step would untie them, unlike one process."""
    a, b = mha(), mha()
    b.W_key.weight = a.W_key.weight
    both = nn.Sequential(a, b)
    with pytest.raises(ValueError, match=r"0\.W_key\.weight and 1\.W_key\.weight are one tied parameter: sharded, each place would hold its own copy"):
        parallelize(both, mesh)
    assert not sharded(both)
    from headwise.models import GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    assert sharded(parallelize(gpt2, mesh))  # its LM head reads the token embedding (replicated): taken
