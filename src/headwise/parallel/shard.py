"""``parallelize``: apply ``PLANS`` to every headwise module inside a model, after checking all of them."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..layer import AttentionLayer
from ..loadable import keeps_keys
from ..teaching import CausalAttention, MultiHeadAttentionWrapper
from .plan import PER_HEAD_SHARED, PLANS, Plan, rowwise
from .qkv import FusedQKVParallel

M = TypeVar("M", bound=nn.Module)

_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def parallelize(module: M, device_mesh: DeviceMesh) -> M:
    """Shard a headwise module or model across the ranks of a 1-D mesh by heads (tensor parallelism).

    Every module of a class in ``PLANS`` inside ``module`` (the module itself included) is
    sharded with ``torch.distributed.tensor.parallel.parallelize_module``: Q/K/V projections
    column-wise by whole heads (GPT-2's fused ``c_attn`` reordered so each rank holds its own
    heads' q, k and v), output projections row-wise, MLPs column- then row-wise. Each
    attention module then computes with its local heads: its ``num_heads`` and
    ``num_kv_heads`` become H/n and Hkv/n, and a ``KVCache`` for it holds Hkv/n heads.
    Everything else (embeddings, LayerNorms, the LM head) stays replicated and is broadcast
    from the mesh's first rank, as the sharded weights are scattered from it.

    Every rank must call this with the same module (same weights, or at least the first
    rank's are used) and must then feed it the same inputs; outputs are (B, T, C) plain
    tensors, equal on every rank. ``state_dict()`` has the single-process keys and layout
    (sharded tensors are DTensors: ``.full_tensor()`` gathers one); ``load_state_dict``
    takes a single-process state dict. Works with ``gloo`` (CPU) and ``nccl`` (GPUs: move
    the model to the rank's device first; the mesh's device type must match).

    Args:
        module: a headwise attention module, ``GPT2LMHeadModel``, ``BertModel``, or any
            ``nn.Module`` containing them; changed in place.
        device_mesh: a 1-D ``DeviceMesh`` (e.g. ``init_device_mesh("cpu", (2,))``; from a
            larger mesh pass its tensor-parallel slice, ``mesh["tp"]``).

    Returns:
        ``module``, sharded.

    Raises:
        TypeError: device_mesh is not a DeviceMesh; a layer the plan shards is not an
            ``nn.Linear``.
        ValueError: a mesh of more than one dimension; heads or KV heads (or an MLP's width)
            not divisible by the mesh size; a sharded layer with forward/backward hooks (they
            would see per-rank shards instead of the tensors they were written for); a module
            already parallelized; parameters on another device type than the mesh; nothing
            to shard.
    """
    _check_mesh(device_mesh)
    n = device_mesh.size()
    found = [(path, sub, PLANS[type(sub)]) for path, sub in module.named_modules() if type(sub) in PLANS]
    if not found:
        raise ValueError(_nothing_to_shard(module))
    _check_devices(module, device_mesh)
    for path, sub, plan in found:  # every check before anything changes
        _check(path or type(module).__name__, sub, plan, n)
    _check_untied(module, found)
    for _, sub, plan in found:
        styles = {name: make(sub) for name, make in plan.items()}
        parallelize_module(sub, device_mesh, styles)
        if "" in plan:  # the module's own input laid out (``plan.shared_input``), which torch reads from positional inputs only
            sub.register_forward_pre_hook(_x_first, with_kwargs=True, prepend=True)
        for name, style in styles.items():
            if isinstance(style, (ColwiseParallel, RowwiseParallel)) and not isinstance(style, FusedQKVParallel):
                sub.get_submodule(name).register_load_state_dict_pre_hook(_distribute_loaded)
        if isinstance(sub, AttentionLayer):
            sub.num_heads //= n  # the heads this rank computes
            sub.num_kv_heads //= n
        for name in PER_HEAD_SHARED.get(type(sub), ()):
            shared = getattr(sub, name, None)
            if shared is not None:
                shared.through = _SummedOver(device_mesh.get_group())
    _broadcast_replicated(module, device_mesh)
    for _, sub, _ in found:
        if isinstance(sub, AttentionLayer):
            _shard_per_head_terms(sub, device_mesh)
    module.register_forward_hook(_plain_output)
    return module


def _x_first(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """``forward(x=...)`` as ``forward(x, ...)``: torch's ``PrepareModuleInput`` lays out positional inputs only."""
    if args or "x" not in kwargs:
        return None
    rest = dict(kwargs)
    return (rest.pop("x"),), rest


def _plain_output(module: nn.Module, args: object, output: object) -> object:
    """The module's output as a plain tensor: a row-wise layer's all-reduce hands on a tensor that waits for the sum when
    an op first reads it (torch's ``AsyncCollectiveTensor``), which pickling or ``torch.save`` would take before the wait
    (this rank's partial sum). Under autograd a copy (the wait alone would leave the graph), else the wait."""
    if not isinstance(output, AsyncCollectiveTensor):
        return output
    return output.clone() if torch.is_grad_enabled() and output.requires_grad else output.wait()


def _shard_per_head_terms(layer: AttentionLayer, mesh: DeviceMesh) -> None:
    """A module's terms of one value per query head, split as its query heads are (whole, contiguous blocks): each
    rank's slice of the ALiBi slopes (a buffer outside the state dict, the same on every rank), and the sink logits as
    a DTensor sharded on the heads (``score_terms`` hands attention the local part; the state dict and the gradient
    stay whole)."""
    rank, n = mesh.get_local_rank(), mesh.size()
    slopes = getattr(layer, "alibi_slopes", None)
    if slopes is not None:
        local = slopes.shape[0] // n
        layer.alibi_slopes = slopes[rank * local : (rank + 1) * local].clone()  # (H/n,)
        layer._alibi_of = (slopes.shape[0], rank * local)  # what a later ``to_empty`` refills
    sinks = getattr(layer, "sinks", None)
    if isinstance(sinks, nn.Parameter) and not isinstance(sinks, DTensor):
        layer.sinks = nn.Parameter(distribute_tensor(sinks.detach(), mesh, [Shard(0)]), requires_grad=sinks.requires_grad)  # (H,) of H/n a rank
        layer.register_load_state_dict_pre_hook(_distribute_loaded)


class _SumGrad(torch.autograd.Function):
    """The identity forward; backward, the gradient summed over ``group``'s ranks."""

    @staticmethod
    def forward(ctx: object, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SummedOver:
    """A replicated weight applied to every head alike (``RMSNorm.through``): its gradient on a rank covers that rank's
    heads, summed over every rank's in the backward. Applied in the forward, not as a hook on the parameter, which a
    parameter swapped in later (FSDP2's ``fully_shard``) would not carry."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return _SumGrad.apply(weight, self.group)

    def __deepcopy__(self, memo: dict) -> _SummedOver:
        return self  # the same ranks (a process group cannot be copied)


def _check_mesh(mesh: object) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"device_mesh must be 1-D (the tensor-parallel ranks), got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}; "
            "pass its tensor-parallel slice, e.g. mesh['tp']"
        )
    ranks = mesh.mesh.flatten().tolist()
    if ranks != sorted(ranks):  # torch scatters shard i to the group's i-th rank, and the group sorts them
        raise ValueError(f"device_mesh must list its ranks in ascending order, got {ranks}: shards would be placed in one "
                         "order and gathered, loaded and broadcast in the other")
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in device_mesh {mesh.mesh.tolist()}: call parallelize on the "
                         "mesh's ranks only")


def _check_devices(module: nn.Module, mesh: DeviceMesh) -> None:
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if isinstance(t, DTensor):
            raise ValueError(f"{name} is already a DTensor: the module is already parallelized (or sharded by FSDP)")
        if t.device.type != mesh.device_type:
            raise ValueError(f"{name} is on {t.device.type} but device_mesh is a {mesh.device_type} mesh: move the model to the rank's device first")


def _check(where: str, owner: nn.Module, plan: Plan, n: int) -> None:
    if isinstance(owner, AttentionLayer) and (owner.num_heads % n or owner.num_kv_heads % n):
        raise ValueError(
            f"{where}: num_heads ({owner.num_heads}) and num_kv_heads ({owner.num_kv_heads}) must both be divisible "
            f"by the mesh size ({n}): each rank holds whole query and key/value heads"
        )
    for name, make in plan.items():
        if not name:
            continue
        layer = owner.get_submodule(name)
        path = f"{where}.{name}"
        if type(layer) is not nn.Linear:
            raise TypeError(f"{path}: the plan shards nn.Linear layers, got {type(layer).__name__}")
        hooks = [kind.strip("_") for kind in _HOOKS if getattr(layer, kind)]
        if hooks:
            raise ValueError(
                f"{path} has {', '.join(hooks)}: sharded, it would see DTensors and per-rank shards instead of the "
                "tensors its hooks were written for; remove them before parallelize"
            )
        width, what = (layer.in_features, "in_features") if make is rowwise else (layer.out_features, "out_features")
        if width % n:
            raise ValueError(f"{path}: {what} ({width}) must be divisible by the mesh size ({n})")


def _check_untied(module: nn.Module, found: list[tuple[str, nn.Module, Plan]]) -> None:
    """A layer the plan shards, or one of its weights, must belong to it alone: torch shards a layer once (a second
    owner's sharding would fail halfway), and a weight tied to another place would be split into copies that no longer
    train as one."""
    places: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        places.setdefault(id(p), []).append(name)
    owners: dict[int, str] = {}
    for path, sub, plan in found:
        for name in filter(None, plan):
            layer, where = sub.get_submodule(name), ".".join(filter(None, (path, name)))
            if id(layer) in owners:
                raise ValueError(f"{where} is also {owners[id(layer)]}: a layer shared by two modules cannot be sharded for "
                                 "each; give each module its own layer before parallelize")
            owners[id(layer)] = where
    for p in (p for path, sub, plan in found for name in filter(None, plan) for p in sub.get_submodule(name).parameters()):
        if len(places[id(p)]) > 1:
            raise ValueError(f"{' and '.join(places[id(p)])} are one tied parameter: sharded, each place would hold its "
                             "own copy and they would no longer train as one; untie it before parallelize")


def _nothing_to_shard(module: nn.Module) -> str:
    kinds = {type(m) for m in module.modules()}
    if kinds & {CausalAttention, MultiHeadAttentionWrapper}:
        return (
            f"{type(module).__name__}: CausalAttention is one head and MultiHeadAttentionWrapper has no output projection "
            "to sum the heads in; convert the wrapper with headwise.wrapper_to_mha and parallelize the MultiHeadAttention"
        )
    return f"{type(module).__name__} holds no module with a tensor-parallel plan; plans exist for {sorted(c.__name__ for c in PLANS)}"


@keeps_keys  # the same key, a DTensor of the same global shape: the all-or-nothing check runs first
def _distribute_loaded(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
    """load_state_dict pre-hook: a full (single-process) tensor, or a DTensor laid out otherwise (another mesh's, another
    sharding's), -> a DTensor laid out like the parameter, before any parameter is written."""
    for name, param in module.named_parameters(recurse=False):
        value = state_dict.get(prefix + name)
        if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor) or value.shape != param.shape:
            continue  # missing or mis-shaped: load_state_dict reports it
        if isinstance(value, DTensor):
            if value.device_mesh == param.device_mesh and value.placements == param.placements:
                continue
            value = value.full_tensor()  # (a collective over the value's mesh: every rank of it loads)
        state_dict[prefix + name] = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


@torch.no_grad()
def _broadcast_replicated(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give every rank the first rank's copy of what stays replicated (sharded weights came from it too)."""
    if mesh.size() == 1:
        return
    src = int(mesh.mesh.flatten()[0])  # global rank of the mesh's first member
    group = mesh.get_group()
    for t in [*module.parameters(), *module.buffers()]:
        if not isinstance(t, DTensor):
            dist.broadcast(t.detach(), src=src, group=group)
