"""A pre-norm decoder layer's one-token decode step in one C++ op (``models/decoder_layer.cpp``): the Llama family's
and GPT-2's.

``generate``'s flat step (``models.flat_step``) runs a block as some forty calls from Python: the norm, the stacked
q/k/v projection and its split, the heads' views, the rotation's tables, the attention op, the output projection,
the residual, the norm again, the MLP's projections and activation, the residual. At B = 1 the Python between those
calls costs more than most of them. Where every part of a layer runs on ops the C++ side can call — each projection
group's kept call on the panels GEMM, torch's linear or oneDNN's (a ``projection.Ready`` whose function is a panels
op, ``F.linear`` or ``onednn.inner_product``), RMSNorm on its C++ op
(``llama._native_rows``) or LayerNorm on torch's, the attention on the C++ decode kernel over a whole cache
(``functional.decode_kernel_call``, with the layer's softcap, sinks and ALiBi slopes where it has them) after a plain
rotation (``AttentionLayer.rotation``) or none — ``decode_layer``
calls the same ops on the same tensors in the same order from C++: the same bits, one call a layer.

Each step asks whether anything the op's arguments follow from changed since they were made (x's kind, autograd's
mode, every tensor the norms and the kept calls read: ``weight_cache.Seen``, one C++ call), and only then what the Python step asks: each
projection group's kept call (``projection.kept_call``), whether the norms take their op. A dropout that would drop,
a submodule replaced since the op was made, or any other answer runs the layer in Python for that step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import decode_kernel  # noqa: F401  (defines headwise::decode_step, which the op calls)
from ..backends.spec import kernel_terms
from ..cache import KVCache, PagedBatch
from ..functional import KernelCall, PagedCall
from ..fused import GPT2MultiHeadAttention
from ..layer import AttentionLayer
from ..linear import onednn, panels  # noqa: F401  (panels defines the ops the op calls)
from ..linear.projection import kept_call
from ..linear.weight_cache import Seen
from . import gpt2, llama

torch.library.define(
    "headwise::decode_layer",
    "(Tensor x, Tensor norm1, Tensor? norm1_bias, Tensor norm2, Tensor? norm2_bias, float eps1, float eps2, bool layer_norm, "
    "int[] kinds, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, int[] ns, int[] qkv_sizes, int head_dim, Tensor? cos, "
    "Tensor? sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? real, int start, float scale, str mlp, Tensor[] paged, int? window, "
    "int block_size, float softcap=0.0, Tensor? sinks=None, Tensor? alibi=None) -> Tensor",
)

#: The kept calls' GEMM functions the op runs, by its code for each.
_KINDS = {
    torch.ops.headwise.panels_linear: 0,
    torch.ops.headwise.panels_linear_gelu: 6,  # GELU inside the GEMM (the op adds none after)
    torch.ops.headwise.panels_int8_scaled: 1,
    torch.ops.headwise.panels_int8_rows_scaled: 2,
    F.linear: 3,
    onednn.inner_product: 4,
    onednn.inner_product_gelu: 5,  # GELU inside the GEMM (the op adds none after)
}


def native_layer(parts: tuple[nn.Module, ...], call: KernelCall | PagedCall | None, x: Tensor) -> NativeLayer | None:
    """A ``NativeLayer`` for a block's (norm1, attention, norm2, mlp) whose attention's steps take the decode kernel
    (``call``: over a KVCache, or a paged batch's pool) and whose parts are exactly the Llama family's or GPT-2's, for
    steps of x's kind; else None."""
    norm1, attn, norm2, mlp = parts
    if call is None or type(norm1) is not type(norm2):
        return None
    if type(attn) is llama.LlamaAttention and type(norm1) is llama.RMSNorm and type(mlp) is llama.MLP:
        if attn.rotation() is None:
            return None
        names = ((attn, ("q_proj", "k_proj", "v_proj", "o_proj")), (mlp, ("gate_proj", "up_proj", "down_proj")))
        return NativeLayer(parts, call, x, names, (mlp.gate_proj, mlp.up_proj), mlp.down_proj, "swiglu", None, ())
    if type(attn) is GPT2MultiHeadAttention and type(norm1) is nn.LayerNorm and type(mlp) is gpt2.MLP:
        if type(mlp.act) is not nn.GELU or mlp.act.approximate not in ("tanh", "none") or mlp.act._forward_hooks or mlp.act._forward_pre_hooks:
            return None
        names = ((attn, ("c_attn", "c_proj", "resid_dropout")), (mlp, ("c_fc", "act", "c_proj", "dropout")))
        return NativeLayer(parts, call, x, names, (mlp.c_fc,), mlp.c_proj, mlp.act.approximate, mlp.act, (attn.resid_dropout, mlp.dropout))
    return None


class NativeLayer:
    """One layer's one-token step in ``decode_layer``: (B, 1, C) -> (B, 1, C) over a KVCache, or a paged batch's packed
    row (1, N, C) -> (1, N, C), every sequence one token; or None where a part does not take its op this step (then the
    caller runs the layer in Python). ``rotary``: the tables the layer's rotation reads, or None."""

    def __init__(self, parts: tuple[nn.Module, ...], call: KernelCall | PagedCall, x: Tensor,
                 names: tuple[tuple[nn.Module, tuple[str, ...]], ...], up: tuple[nn.Linear, ...], down: nn.Module, mlp: str,
                 act: nn.Module | None, drops: tuple[nn.Dropout, ...]) -> None:
        C = x.shape[-1]
        # the submodules the op was made from, by their owners' names (one replaced: the layer runs in Python)
        self.owned = [(owner, name, getattr(owner, name)) for owner, group in names for name in group]
        self.norm1, self.attn, self.norm2, _ = parts
        self.call, self.mlp, self.act, self.drops = call, mlp, act, drops
        self.layer_norm = type(self.norm1) is nn.LayerNorm
        attn: AttentionLayer = self.attn
        self.rotary = attn.rotation()
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj) if isinstance(attn, llama.LlamaAttention) else (attn.c_attn,)
        out = attn.o_proj if isinstance(attn, llama.LlamaAttention) else attn.c_proj
        width = attn.num_heads * attn.head_dim
        # each projection group, the width of the x it gets (its kept call is looked up by that x's shape) and its activation
        self.groups = ((qkv, C, None), ((out,), width, None), (up, C, act), ((down,), down.in_features, None))
        kv = attn.num_kv_heads * attn.head_dim
        self.sizes = [width, kv, kv]
        self.seen: tuple | None = None  # what the op's arguments were last made for (``_made_for``)
        # every tensor the norms and the kept calls read, compared each step with what it was (``weight_cache.Seen``)
        self.tensors = Seen((self.norm1, self.norm2, *(layer for layers, _, _ in self.groups for layer in layers)))
        self.args: tuple[list, list, list, list, list] | None = None

    def __call__(self, x: Tensor, cache: KVCache | PagedBatch, cos: Tensor | None, sin: Tensor | None) -> Tensor | None:
        """x (B, 1, C), or (1, N, C) for a paged batch of the pool the call was made for; cos and sin the rotation's
        tables at this step's positions ((1, R) or (B, 1, 1, R); (1, 1, N, R)), None without ``rotary``."""
        if any(owner._modules.get(name) is not module for owner, name, module in self.owned):
            return None
        if any(d.training and d.p > 0 for d in self.drops):  # the op has no dropout
            return None
        mlp = self.mlp if self.act is None else self.act.approximate  # (GPT-2's GELU as it is set now)
        if mlp not in ("swiglu", "tanh", "none"):
            return None
        seen = self._made_for(x)
        if not self.tensors.same() or seen != self.seen:
            self.seen = None  # (until the arguments are made: a call that raises leaves nothing that looks current)
            self.args = self._call_args(x)
            self.seen = seen
        if self.args is None:
            return None
        kinds, weights, scales, biases, ns = self.args
        norm1, norm2, attn = self.norm1, self.norm2, self.attn
        b1, b2 = (norm1.bias, norm2.bias) if self.layer_norm else (None, None)
        spec, sizes, D = self.call.spec, self.sizes, attn.head_dim
        scale, terms = spec.scale, kernel_terms(spec)  # (the sinks and slopes as they stand this step)
        if isinstance(cache, PagedBatch):
            pool = cache.cache
            return cache.write_rows_unchecked(lambda slots, rows, tables, seen_to: torch.ops.headwise.decode_layer(
                x, norm1.weight, b1, norm2.weight, b2, norm1.eps, norm2.eps, self.layer_norm, kinds, weights, scales, biases, ns,
                sizes, D, cos, sin, pool.k, pool.v, None, 0, scale, mlp, [slots, rows, tables, seen_to], spec.window, pool.block_size,
                *terms))  # (1, N, C)
        return cache.write_one_unchecked(lambda k, v, real, slot: torch.ops.headwise.decode_layer(
            x, norm1.weight, b1, norm2.weight, b2, norm1.eps, norm2.eps, self.layer_norm, kinds, weights, scales, biases, ns,
            sizes, D, cos, sin, k, v, real, slot, scale, mlp, [], None, 0, *terms))  # (B, 1, C)

    def _made_for(self, x: Tensor) -> tuple:
        """What the op's arguments and the norms' answer (``_call_args``) follow from beside the tensors the norms and the
        kept calls read (``self.tensors``): x's kind, autograd's mode and the GELU's ``approximate`` (the up
        projection's kept call computes it)."""
        return type(x), x.dtype, x.shape, torch.is_grad_enabled(), None if self.act is None else self.act.approximate

    def _norms_take(self, x: Tensor) -> bool:
        """RMSNorms on their C++ op (as ``RMSNorm.forward`` decides); LayerNorms as they are (``F.layer_norm``)."""
        if self.layer_norm:
            return True
        return llama._native_rows(x, self.norm1.weight) and llama._native_rows(x, self.norm2.weight)

    def _call_args(self, x: Tensor) -> tuple[list, list, list, list, list] | None:
        """The kept calls' (kinds, weights, scales, biases, widths) for the op, or None where a norm does not take its op
        or a kept call's GEMM is not one the op runs (a layer class's own ``decode_call`` other than ``Int8Linear``'s panels)."""
        if not self._norms_take(x):
            return None
        kinds, weights, scales, biases, ns = [], [], [], [], []
        for layers, width, act in self.groups:
            ready = kept_call(layers, x.new_empty(*x.shape[:-1], width), act)  # (asked for the x the group gets)
            if ready is None:
                return None
            run, args = ready.gemm()  # (a GELU the kept call runs after its GEMM: the op runs it after the op's GEMM)
            kind = _KINDS.get(run)
            if kind is None:
                return None
            kinds.append(kind)
            weights.append(args[0])  # the panels, or F.linear's weight
            scaled = kind in (1, 2)  # (panels, scales, bias, n); the panels' own (panels, bias, n[, approximate]);
            scales.append(args[1] if scaled else None)  # the plain weight's (weight, bias[, approximate])
            biases.append(args[2] if scaled else args[1])
            ns.append(args[3] if scaled else args[2] if kind in (0, 6) else 0)
        return kinds, weights, scales, biases, ns
