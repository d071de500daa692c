"""Llama, Mistral and Qwen3 on headwise attention, loading HuggingFace checkpoints.

The book's bonus chapters rebuild these from GPT-2 by swapping parts: RMSNorm for LayerNorm,
rotary position embeddings (``headwise.rope``) instead of a position table, grouped-query
attention, a SwiGLU feed-forward, and for Qwen3 an RMSNorm over each head's queries and keys.
Module names copy HuggingFace's checkpoint keys (``model.layers.0.self_attn.q_proj``,
``model.layers.0.mlp.gate_proj``, ``model.norm``, ``lm_head``), so loading is a key copy.

``LlamaAttention`` is an ``AttentionLayer``: the one headwise forward, with Llama's projections
and its ``position`` step (QK-norm, then the rotation, before the cache write).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks, native
from ..cache import Cache
from ..convert import check_state, load_checked
from ..functional import check_backend
from ..layer import AttentionLayer
from ..linear import DECODE_ROWS, owns_output, project, project_many
from ..masks import positions
from ..observe import report
from ..rope import RotaryEmbedding, rotate
from . import loading
from .causal import CausalModel
from .llama_config import LlamaConfig, llama_config

torch.library.define("headwise::rms_norm", "(Tensor x, Tensor? weight, float eps) -> Tensor")


@torch.library.register_fake("headwise::rms_norm")
def _rms_norm_shape(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)  # (..., N): the op's rows, contiguous


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight over the last dim, computed in float32: (..., N) -> (..., N).

    Where autograd records nothing, eagerly on the CPU, float32 and bfloat16 rows (of fewer than ``NATIVE_WIDTH``
    elements) run headwise's C++ op (``models/rms_norm.cpp``): one pass a row where torch's CPU ``rms_norm`` is six ops
    (eight in bfloat16), its sums added in the order of torch's, so the bits are ``F.rms_norm``'s (a NaN's aside: where a
    row holds an inf or a NaN, the op's bfloat16 NaN is 0x7fc0, torch's 0xffff).
    """

    #: A function the weight passes through where autograd records it (``headwise.parallel``: Qwen3's QK-norm, whose
    #: gradient on a rank covers only its heads, summed over the ranks there: in the forward, so that a parameter
    #: swapped in later, as FSDP2's, takes it too); None: the weight as it is.
    through: Callable[[Tensor], Tensor] | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if self.through is not None and torch.is_grad_enabled() and weight.requires_grad:
            weight = self.through(weight)  # (N,)
        fused = x.dtype == torch.float32 and weight.dtype == torch.float32  # nothing to convert: one op, the weight's product inside
        if _native_rows(x, weight):
            if fused:
                return torch.ops.headwise.rms_norm(x, weight, self.eps)  # (..., N)
            return weight * torch.ops.headwise.rms_norm(x, None, self.eps)  # (..., N): rounded back once, then weighted
        if fused:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)  # (..., N): (x * rsqrt) * weight, as weight * normed
        normed = F.rms_norm(x, (x.shape[-1],), eps=self.eps)  # (..., N): computed in float32, rounded back once as HuggingFace does
        return weight * normed


#: Each layer's rotary table, which checkpoints written by transformers before 4.31 carry (transformers drops it): the
#: rotation's tables are made from the config here.
_LEGACY_INV_FREQ = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


#: Rows below ATen's grain (elements a reduction sums in one thread): torch sums each such row whole, in the order the
#: C++ op repeats (a longer row alone may be summed in parts by several threads).
NATIVE_WIDTH = 32768
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


def _native_rows(x: Tensor, weight: Tensor) -> bool:
    """Whether ``RMSNorm`` runs x through headwise's C++ op: float32 or bfloat16 CPU rows of fewer than ``NATIVE_WIDTH``
    elements and weight, eager, nothing for autograd to record, a plain tensor, the op built (``native.built``)."""
    return (
        x.is_cpu and weight.is_cpu and type(x) is Tensor and x.dtype in _NATIVE_DTYPES and weight.dtype in _NATIVE_DTYPES
        and 0 < x.shape[-1] < NATIVE_WIDTH and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not _checks.compiling() and native.built()
    )


def projections(layers: tuple[nn.Module, ...], x: Tensor) -> list[Tensor]:
    """Several projections of one input x (..., C): one stacked GEMM (``project_many``) for a decode
    step's few rows (at most ``DECODE_ROWS``, or under ``torch.compile``), one GEMM per layer for
    a prompt's many: each output is then a contiguous (..., N_i) tensor that the next op reads
    while it is still in cache, not a strided slice of one wide (..., sum N_i) output; the numbers
    are the same either way. Returns one (..., N_i) per layer.
    """
    if _checks.compiling() or x.numel() <= DECODE_ROWS * x.shape[-1]:
        return project_many(layers, x)
    return [project(layer, x) for layer in layers]


class LlamaAttention(AttentionLayer):
    """Causal grouped-query self-attention with rotary positions: (B, T, C) -> (B, T, C).

    Args:
        config: a ``LlamaConfig`` (H = num_attention_heads, Hkv = num_key_value_heads, D =
            head_dim, qk_norm for Qwen3).
        rotary: the model's ``RotaryEmbedding`` (one for all layers: one set of tables).
        window: this layer's sliding window (Mistral), or None.
        backend: "auto", "math" or "sdpa".

    Positions: the new tokens sit at the cache length onwards, counting only real tokens
    when ``attention_mask`` marks padding (HuggingFace's ``generate`` rule, so a left-padded
    row gives the unpadded row's numbers), or at ``position_ids`` when given.

    Example:
        >>> config = LlamaConfig(vocab_size=10, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        ...                      num_attention_heads=4, num_key_value_heads=2)
        >>> attn = LlamaAttention(config, RotaryEmbedding(config.head_size))
        >>> attn(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 64])
    """

    input_name = "hidden_states"
    causal = True

    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, *, window: int | None = None, backend: str = "auto") -> None:
        super().__init__()
        self.d_in = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads
        self.head_dim = config.head_size
        self.context_length = config.max_position_embeddings
        self.window = _checks.window(window, causal=True)
        self.backend = check_backend(backend)
        self.dropout_p = config.attention_dropout
        self.rotary = rotary
        width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=config.attention_bias)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    @property
    def attn_dropout_p(self) -> float:
        return self.dropout_p if self.training else 0.0

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(B, T, C) -> q_proj(x) (B, T, H*D), k_proj(x) and v_proj(x) (B, T, Hkv*D): one GEMM for a decode step (see ``projections``)."""
        queries, keys, values = projections((self.q_proj, self.k_proj, self.v_proj), x)
        return queries, keys, values

    def position(
        self, q: Tensor, k: Tensor, start: int, attention_mask: Tensor | None, position_ids: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """QK-norm (Qwen3), then rotate q (B, H, T, D) and k (B, Hkv, T, D) to their positions."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # over each head's D
        if position_ids is None and attention_mask is not None:
            position_ids = positions(attention_mask, q.shape[0], q.shape[2], q.device, start=start)  # (B, T): real tokens counted
        where = start if position_ids is None else position_ids
        cos, sin = self.rotary.at(where, q.shape[2], q.device, q.dtype)  # (T, R) or (B, 1, T, R): once for q and k
        qk = rotate(torch.cat((q, k), dim=1), cos, sin, self.rotary.layout)  # (B, H + Hkv, T, D): q and k in one rotation
        q, k = qk.split((q.shape[1], k.shape[1]), dim=1)  # (B, H, T, D), (B, Hkv, T, D): views
        report("queries.rotated", q)
        report("keys.rotated", k)
        return q, k

    def rotation(self) -> RotaryEmbedding | None:
        """The rotary tables where ``position`` is only their "rotate_half" turn of every dim (no QK-norm)."""
        rotary = self.rotary
        plain = self.q_norm is None and rotary.layout == "rotate_half" and rotary.rotary_dim == rotary.head_dim == self.head_dim
        return rotary if plain else None

    def project_out(self, context: Tensor) -> Tensor:
        """(B, T, H*D) -> o_proj(context) (B, T, C)."""
        return project(self.o_proj, context)


class MLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x)); (B, T, C) -> (B, T, I) -> (B, T, C)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = projections((self.gate_proj, self.up_proj), x)  # (B, T, I) each, one GEMM for a decode step
        if _checks.compiling() or gate.requires_grad or gate.shape != up.shape or gate.dtype != up.dtype \
                or not owns_output(self.gate_proj):
            return project(self.down_proj, F.silu(gate) * up)  # (B, T, C)
        # gate is this call's own tensor and autograd keeps nothing of it: the product overwrites it, the same numbers
        # without two more (B, T, I) tensors (for a prompt, new memory the allocator may fault in page by page)
        return project(self.down_proj, F.silu(gate, inplace=True).mul_(up))  # (B, T, C)


class DecoderLayer(nn.Module):
    """x + attn(rmsnorm(x)), then x + mlp(rmsnorm(x)); (B, T, C) -> (B, T, C)."""

    flat_parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")  # forward's order, for models.flat_step

    def __init__(self, config: LlamaConfig, rotary: RotaryEmbedding, layer: int, backend: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary, window=config.window(layer), backend=backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, *, attention_mask: Tensor | None, cache: Cache | None, position_ids: Tensor | None, check: bool = True
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), attention_mask=attention_mask, cache=cache, position_ids=position_ids, check=check)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalModel):
    """A Llama-family causal LM: embeddings, decoder layers, final RMSNorm, LM head (tied or not).

    Args:
        config: a ``LlamaConfig``.
        backend: headwise's attention backend, "auto", "math" or "sdpa".

    ``headwise.models.load(directory)`` (or ``from_pretrained``) loads a HuggingFace directory.

    Example:
        >>> config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        ...                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        >>> model = LlamaForCausalLM(config).eval()
        >>> model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4).shape  # greedy; ``CausalModel`` shows the forward
        torch.Size([1, 7])
    """

    model_type = "llama"
    tied_embedding = "model.embed_tokens"  # the module whose weight the LM head uses while lm_head is None

    def __init__(self, config: LlamaConfig, *, backend: str = "auto") -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.rotary = RotaryEmbedding(config.head_size, rotary_dim=config.rotary_dim, theta=config.rope_theta, scaling=config.rope_scaling)
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(config.vocab_size, config.hidden_size),
                "layers": nn.ModuleList([DecoderLayer(config, self.rotary, i, backend) for i in range(config.num_hidden_layers)]),
                "norm": RMSNorm(config.hidden_size, config.rms_norm_eps),
            }
        )
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, backend: str = "auto") -> LlamaForCausalLM:
        """Load a HuggingFace directory (config.json + model.safetensors, its shards, or pytorch_model.bin).

        Args:
            path: the directory.
            dtype: the parameters' dtype; default the checkpoint's: config.json's ``dtype`` /
                ``torch_dtype``, else the dtype of most of the weights (bf16 weights run in bf16).
            backend: headwise's attention backend.

        Returns the model in eval mode. With tied embeddings an ``lm_head.weight`` in the
        checkpoint must equal ``embed_tokens``.

        Raises:
            FileNotFoundError: no such directory, no config.json, no weights.
            ValueError: a config of another model_type, settings this model cannot run, or
                weights that disagree with the config (every missing, unexpected and
                mis-shaped tensor listed at once); no model is returned.
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None (the checkpoint's), got {dtype!r}")
        directory = loading.model_directory(path)
        raw = loading.read_config(directory, cls.model_type)
        config = llama_config(raw, cls.model_type, directory / loading.CONFIG)
        file = loading.weights_file(directory)
        state = loading.read_weights(file)
        head, embed = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
        tied = config.tie_word_embeddings
        head_only = tied and embed is None and head is not None  # a tied checkpoint that kept the head's copy only: the embedding's
        checks = {
            "source": file,
            "rename": lambda key: "model.embed_tokens.weight" if head_only and key == "lm_head.weight" else key,
            "named": lambda key: "lm_head.weight" if head_only and key == "model.embed_tokens.weight" else key,
            "ignore": lambda key: (tied and not head_only and key == "lm_head.weight") or _LEGACY_INV_FREQ.fullmatch(key) is not None,
            "problems": loading.tied_head(head, embed, "model.embed_tokens.weight", "config.json says tie_word_embeddings") if tied else [],
        }
        with torch.device("meta"):  # shapes only: the tensors are checked before any memory is taken (the rotary
            check_state(cls(config, backend=backend), state, **checks)  # tables are plain tensors: built for real below)
        model = cls(config, backend=backend).to(dtype or loading.checkpoint_dtype(raw, state, directory / loading.CONFIG))
        load_checked(model, state, **checks)
        return model.eval()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model["embed_tokens"]

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model["layers"]

    @property
    def final_norm(self) -> nn.Module:
        return self.model["norm"]

    def embed(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None, cache: list[Cache] | None) -> Tensor:
        """(B, T) ids -> (B, T, C): positions are the layers' to apply (rotary, inside attention)."""
        return self.model["embed_tokens"](input_ids)  # (B, T, C)

    def context_limit(self) -> tuple[str, int | None]:
        windows = [self.config.window(i) for i in range(self.config.num_hidden_layers)]
        bounded = any(w is None for w in windows)  # a sliding cache has no length limit
        return "max_position_embeddings", self.config.max_position_embeddings if bounded else None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama with a sliding window (``sliding_window``), through headwise's window and ring cache."""

    model_type = "mistral"


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with QK-norm (an RMSNorm over each head's queries and keys) and an explicit head_dim."""

    model_type = "qwen3"
