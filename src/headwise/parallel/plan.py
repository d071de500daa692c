"""Which Linear layers of which headwise module are split how: ``PLANS``, one entry per module class.

Megatron's recipe, per transformer block:
- the Q/K/V projections column-wise (``ColwiseParallel``): each rank computes the queries,
  keys and values of its own H/n query heads and Hkv/n key/value heads, from the full input;
- attention on those heads alone (heads are independent until the output projection);
- the output projection row-wise (``RowwiseParallel``): each rank multiplies its heads'
  slice of the context by its columns of the weight, and one all-reduce sums the partial
  (B, T, C) results;
- the MLP the same way: the first Linear column-wise, the second row-wise, one all-reduce.

A plan maps a submodule name (relative to a module of the entry's class, ``""`` = that
module itself) to a function of that module returning a fresh ``ParallelStyle``. Adding a
model is one entry per block class, as for the Llama family below (rotary embeddings and
QK-norm act per head on the local heads: nothing to shard). Embeddings, norms and the LM head stay replicated: every rank holds them whole.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from ..fused import GPT2MultiHeadAttention
from ..models import gpt2, llama
from ..models.bert import BertLayer
from ..teaching import MultiHeadAttention
from .qkv import FusedQKVParallel

Plan = dict[str, Callable[[nn.Module], ParallelStyle]]


def colwise(owner: nn.Module) -> ParallelStyle:
    """Output rows split in n contiguous blocks (whole heads when the block is a head multiple)."""
    return ColwiseParallel()


def rowwise(owner: nn.Module) -> ParallelStyle:
    """Input columns split like the column-wise layer before it; one all-reduce of the output."""
    return RowwiseParallel()


def fused_qkv(owner: nn.Module) -> ParallelStyle:
    """GPT-2's ``c_attn``: each rank's rows are its own heads' q, k and v (see ``qkv.py``)."""
    return FusedQKVParallel(owner.num_heads, owner.num_kv_heads, owner.head_dim)


def shared_input(owner: nn.Module) -> ParallelStyle:
    """Make the module's input one replicated DTensor, so that the gradients of the separate Q, K
    and V projections meet there and are all-reduced once in the backward pass (not three times)."""
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False)


PLANS: dict[type[nn.Module], Plan] = {
    MultiHeadAttention: {"": shared_input, "W_query": colwise, "W_key": colwise, "W_value": colwise, "out_proj": rowwise},
    GPT2MultiHeadAttention: {"c_attn": fused_qkv, "c_proj": rowwise},
    gpt2.MLP: {"c_fc": colwise, "c_proj": rowwise},  # GPT-2's
    BertLayer: {"intermediate": colwise, "output": rowwise},  # its attention is a MultiHeadAttention
    llama.LlamaAttention: {"": shared_input, "q_proj": colwise, "k_proj": colwise, "v_proj": colwise, "o_proj": rowwise},  # Llama, Mistral, Qwen3
    llama.MLP: {"gate_proj": colwise, "up_proj": colwise, "down_proj": rowwise},  # SwiGLU: gate and up split alike
}

#: Parameters applied to every head alike (Qwen3's QK-norm over each head's D): replicated, but on a
#: rank they see only its heads, so their gradient there is a partial sum, all-reduced in backward.
PER_HEAD_SHARED: dict[type[nn.Module], tuple[str, ...]] = {llama.LlamaAttention: ("q_norm", "k_norm")}
