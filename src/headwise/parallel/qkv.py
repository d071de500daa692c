"""A fused Q/K/V projection (GPT-2's ``c_attn``) sharded by heads, not by contiguous rows.

``c_attn`` maps C -> (H + 2·Hkv)·D with its output rows laid out [queries | keys | values].
``ColwiseParallel`` would give each of n ranks a contiguous 1/n of those rows: on 2 ranks
rank 0 would hold every query and half the keys, rank 1 the other keys and every value.
Heads are what may be split, so ``FusedQKVParallel`` first reorders the rows to

    [rank 0's q | k | v,  rank 1's q | k | v,  ...]          (``qkv_rows``)

and shards that with ``Shard(0)``: rank r's contiguous chunk is the q, k and v rows of its
own H/n query heads and Hkv/n key/value heads, and ``GPT2MultiHeadAttention.project_qkv``
splits it by the H/Hkv ratio as it splits the whole.

The reorder lives in the parameter only. ``state_dict()`` gives ``c_attn`` back in
checkpoint order (an all-gather, then a DTensor of the original rows laid out as the parameter), and
``load_state_dict`` takes checkpoint order, full tensors or DTensors, so checkpoints and
their keys are those of the single-process module.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel

from ..loadable import keeps_keys


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, world: int) -> Tensor:
    """The order of c_attn's output rows whose i-th contiguous 1/world holds rank i's heads.

    Args:
        num_heads: H, query heads of the whole module.
        num_kv_heads: Hkv, key/value heads of the whole module.
        head_dim: D.
        world: ranks; must divide H and Hkv.

    Returns:
        ((H + 2·Hkv)·D,) int64 row indices into [queries | keys | values].

    Example:
        >>> qkv_rows(2, 2, 1, 2).tolist()  # q0 k0 v0 | q1 k1 v1
        [0, 2, 4, 1, 3, 5]
    """
    q, kv = num_heads * head_dim, num_kv_heads * head_dim  # widths of the three blocks
    q_part, kv_part = q // world, kv // world  # one rank's share of each
    rows = []
    for r in range(world):
        rows += [
            torch.arange(r * q_part, (r + 1) * q_part),  # its queries
            torch.arange(q + r * kv_part, q + (r + 1) * kv_part),  # its keys
            torch.arange(q + kv + r * kv_part, q + kv + (r + 1) * kv_part),  # its values
        ]
    return torch.cat(rows)  # ((H + 2·Hkv)·D,)


class FusedQKVParallel(ColwiseParallel):
    """``ColwiseParallel`` for a fused [q | k | v] Linear, sharded so each rank holds whole heads.

    Args:
        num_heads: H of the attention module.
        num_kv_heads: Hkv of the attention module.
        head_dim: D.

    The input is replicated and the output is the local (B, T, (H + 2·Hkv)·D / n) tensor,
    as ``ColwiseParallel``'s; only the parameters' row order differs (see the module docstring).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        rows = qkv_rows(self.num_heads, self.num_kv_heads, self.head_dim, device_mesh.size())
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = distribute_tensor(param.detach()[rows], device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(sharded, requires_grad=param.requires_grad))
        module.register_state_dict_post_hook(partial(_checkpoint_order, rows))
        module.register_load_state_dict_pre_hook(partial(_sharded_order, rows))


def _checkpoint_order(rows: Tensor, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict post-hook: c_attn's rows back in [queries | keys | values] order, laid out as the parameter is (on a
    2-D mesh too, FSDP2's over tensor parallelism's: a DTensor of the checkpoint's rows is one whatever its layout)."""
    back = torch.argsort(rows)  # checkpoint row i sits at back[i] in the sharded order
    for name, param in module.named_parameters(recurse=False):
        key = prefix + name
        if isinstance(param, DTensor) and isinstance(state_dict.get(key), DTensor):
            full = state_dict[key].detach().full_tensor()[back]  # an all-gather: ((H + 2·Hkv)·D, ...) (keep_vars: no graph)
            state_dict[key] = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


@keeps_keys  # the same key and global shape, rows reordered: the all-or-nothing check runs first
def _sharded_order(rows: Tensor, module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """load_state_dict pre-hook: a checkpoint-order tensor (full or DTensor) -> the sharded order."""
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if not isinstance(param, DTensor) or not isinstance(value, Tensor) or value.shape != param.shape:
            continue  # missing or mis-shaped: load_state_dict reports it
        full = value.full_tensor() if isinstance(value, DTensor) else value
        state_dict[prefix + name] = distribute_tensor(full[rows], param.device_mesh, param.placements, src_data_rank=None)
