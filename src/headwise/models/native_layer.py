"""A Llama-family decoder layer's one-token decode step in one C++ op (``models/decoder_layer.cpp``).

``generate``'s flat step (``models.flat_step``) runs a block as some forty calls from Python: RMSNorm, the stacked
q/k/v projection and its split, the heads' views, the rotation's tables, the attention op, o_proj, the residual,
RMSNorm again, the gate/up projection, SiLU times up, down_proj, the residual. At B = 1 the Python between those
calls costs more than most of them. Where every part of a layer runs on headwise's own ops — both norms on
RMSNorm's C++ op (``llama._native_rows``), each projection group's kept call on the panels GEMM (a
``projection.Ready`` whose function is a panels op), the attention on the C++ decode kernel over a whole cache
(``functional.decode_kernel_call``) after a plain rotation (``LlamaAttention.rotation``) — ``llama_decode_layer``
calls the same ops on the same tensors in the same order from C++: the same bits, one call a layer.

Each step still asks what the Python step asks: each projection group's kept call (``projection._ready``, valid
while the group's tensors keep their ``state``) and whether the norms take the op; any other answer runs the
layer in Python for that step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..backends import decode_kernel  # noqa: F401  (defines headwise::decode_step, which the op calls)
from ..cache import KVCache
from ..functional import KernelCall
from ..linear import panels  # noqa: F401  (defines the panels ops the op calls)
from ..linear.projection import Ready, _ready
from .llama import MLP, LlamaAttention, RMSNorm, _native_rows

torch.library.define(
    "headwise::llama_decode_layer",
    "(Tensor x, Tensor norm1, Tensor norm2, float eps1, float eps2, int[] kinds, Tensor[] panels, Tensor?[] scales, "
    "Tensor?[] biases, int[] ns, int[] qkv_sizes, int head_dim, Tensor? cos, Tensor? sin, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor? real, int start, float scale) -> Tensor",
)

#: The kept calls' functions the op runs, by its code for each.
_KINDS = {
    torch.ops.headwise.panels_linear: 0,
    torch.ops.headwise.panels_int8_scaled: 1,
    torch.ops.headwise.panels_int8_rows_scaled: 2,
}


def native_layer(parts: tuple[nn.Module, ...], call: KernelCall | None, x: Tensor) -> NativeLayer | None:
    """A ``NativeLayer`` for a block's (norm1, attention, norm2, mlp) whose attention's steps take the decode kernel
    (``call``) and whose parts are exactly the Llama family's, for steps of x's shape (B, 1, C); else None."""
    norm1, attn, norm2, mlp = parts
    if call is None or type(norm1) is not RMSNorm or type(norm2) is not RMSNorm or type(mlp) is not MLP:
        return None
    if type(attn) is not LlamaAttention or attn.rotation() is None or not _native_rows(x, norm1.weight):
        return None
    return NativeLayer(norm1, attn, norm2, mlp, call, x)


class NativeLayer:
    """One layer's one-token step in ``llama_decode_layer``: (B, 1, C) -> (B, 1, C), or None where a part does not take
    its op this step (then the caller runs the layer in Python)."""

    def __init__(self, norm1: RMSNorm, attn: LlamaAttention, norm2: RMSNorm, mlp: MLP, call: KernelCall, x: Tensor) -> None:
        B, _, C = x.shape
        self.norm1, self.attn, self.norm2, self.call = norm1, attn, norm2, call
        width = attn.num_heads * attn.head_dim
        inter = mlp.gate_proj.out_features
        # each projection group and an x of the shape it gets (what its kept call is looked up by)
        self.groups = (
            ((attn.q_proj, attn.k_proj, attn.v_proj), x.new_empty(B, 1, C)),
            ((attn.o_proj,), x.new_empty(B, 1, width)),
            ((mlp.gate_proj, mlp.up_proj), x.new_empty(B, 1, C)),
            ((mlp.down_proj,), x.new_empty(B, 1, inter)),
        )

    def __call__(self, x: Tensor, cache: KVCache, position_ids: Tensor | None) -> Tensor | None:
        norm1, norm2, attn = self.norm1, self.norm2, self.attn
        if not (_native_rows(x, norm1.weight) and _native_rows(x, norm2.weight)):
            return None
        readies = [_ready(layers, like) for layers, like in self.groups]
        args = _panel_args(readies)
        if args is None:
            return None
        kinds, packed, scales, biases, ns = args
        cos, sin = attn.rotary.at(cache.start(1) if position_ids is None else position_ids, 1, x.device)  # (1, R) or (B, 1, 1, R)
        sizes, D, scale = readies[0].sizes, attn.head_dim, self.call.scale
        return cache.write_one_unchecked(lambda k, v, real, slot: torch.ops.headwise.llama_decode_layer(
            x, norm1.weight, norm2.weight, norm1.eps, norm2.eps, kinds, packed, scales, biases, ns, sizes, D, cos, sin, k, v,
            real, slot, scale))  # (B, 1, C)


def _panel_args(readies: list[Ready | None]) -> tuple[list, list, list, list, list] | None:
    """The kept calls' (kinds, panels, scales, biases, widths) for the op, or None where one is not a panels op."""
    kinds, packed, scales, biases, ns = [], [], [], [], []
    for ready in readies:
        kind = None if ready is None else _KINDS.get(ready.run)
        if kind is None:
            return None
        args = ready.args  # (panels, bias, n) or (panels, scales, bias, n)
        kinds.append(kind)
        packed.append(args[0])
        scales.append(None if kind == 0 else args[1])
        biases.append(args[-2])
        ns.append(args[-1])
    return kinds, packed, scales, biases, ns
