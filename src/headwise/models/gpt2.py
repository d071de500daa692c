"""A small, readable GPT-2 on ``GPT2MultiHeadAttention`` that loads HuggingFace checkpoints.

Module names copy HuggingFace's checkpoint keys (``transformer.wte``, ``transformer.h.0.attn.c_attn``,
``transformer.h.0.mlp.c_fc``, ``transformer.ln_f``), so loading is a key copy plus a transpose of
the Conv1D weights, which HuggingFace stores (in, out). The LM head is tied to ``wte``: the
logits are ``hidden @ wte.weight.T`` and the state dict has no ``lm_head`` entry (``lm_head`` is
None; ``headwise.quantize.int8_weights`` puts an int8 copy of ``wte`` there).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from .. import _checks
from ..cache import KVCache, PagedBatch, PagedKVCache
from ..config import GPT2Config
from ..convert import HF_GPT2_TRANSPOSED, is_legacy_gpt2_buffer, load_checked
from ..fused import GPT2MultiHeadAttention
from ..linear import linear, project
from . import _inputs, loading
from .generate import Generates, positions

#: HuggingFace ``activation_function`` values that are the tanh approximation of GELU.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


class MLP(nn.Module):
    """GPT-2's feed-forward block: (B, T, C) -> (B, T, 4C) -> tanh-GELU -> (B, T, C)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(project(self.c_proj, self.act(project(self.c_fc, x))))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); (B, T, C) -> (B, T, C)."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2MultiHeadAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, *, attention_mask: Tensor | None = None, cache: KVCache | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask=attention_mask, cache=cache)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(Generates, nn.Module):
    """GPT-2: token + position embeddings, ``n_layer`` pre-LN blocks, final LayerNorm, tied LM head.

    Args:
        config: a ``GPT2Config`` (``n_kv_head`` gives grouped-query attention; GPT-2 has none).

    ``GPT2LMHeadModel.from_pretrained(directory)`` loads a HuggingFace GPT-2 directory.

    Example:
        >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
        >>> ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
        >>> mask = torch.tensor([[1, 1, 1], [0, 1, 1]])           # left padding, 1 = real token
        >>> model(ids, attention_mask=mask).shape                  # (B, T, vocab_size)
        torch.Size([2, 3, 100])
        >>> model.generate(ids, attention_mask=mask, max_new_tokens=4).shape  # greedy
        torch.Size([2, 7])
    """

    tied_embedding = "transformer.wte"  # the module whose weight the LM head uses while lm_head is None

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        if not isinstance(config, GPT2Config):
            raise TypeError(f"config must be a GPT2Config, got {type(config).__name__}")
        self.config = config
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(config.vocab_size, config.n_embd),
                "wpe": nn.Embedding(config.n_positions, config.n_embd),
                "drop": nn.Dropout(config.embd_pdrop),
                "h": nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                "ln_f": nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon),
            }
        )
        self.lm_head: nn.Module | None = None  # None: tied to wte

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> GPT2LMHeadModel:
        """Load a HuggingFace GPT-2 directory (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``).

        Keys may carry the ``transformer.`` prefix or not; the legacy ``attn.bias`` /
        ``attn.masked_bias`` buffers are ignored; an ``lm_head.weight`` must equal ``wte``.
        Returns the model in eval mode.

        Raises:
            FileNotFoundError: no such directory, no config.json, no weights file.
            ValueError: a config or weights file that cannot be read or that disagrees with
                GPT-2 (every missing, unexpected and mis-shaped tensor listed at once); no
                model is returned.
        """
        directory = loading.model_directory(path)
        config = gpt2_config(loading.read_config(directory, "gpt2"), directory / loading.CONFIG)
        file = loading.weights_file(directory)
        state = loading.read_weights(file)
        head = state.get("lm_head.weight")
        wte = state.get("transformer.wte.weight", state.get("wte.weight"))
        if head is not None and wte is not None and (head.shape != wte.shape or not torch.equal(head, wte)):
            raise ValueError(f"{file}: lm_head.weight differs from wte.weight; headwise's GPT-2 ties them (tie_word_embeddings)")
        with torch.device("meta"):  # shapes only: the tensors are checked against them before any memory is taken
            model = cls(config)
        load_checked(
            model,
            state,
            source=file,
            rename=lambda key: key if key.startswith("transformer.") else "transformer." + key,
            transposed=HF_GPT2_TRANSPOSED,
            ignore=lambda key: key == "lm_head.weight" or is_legacy_gpt2_buffer(key),
        )
        return model.eval()

    def _logits(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor | None, caches: list[KVCache] | None, keep: int = 0) -> Tensor:
        """(B, T) ids at (B, T) positions -> (B, T or keep, vocab) logits of the last ``keep`` positions
        (0 = all), through the caches if given."""
        t = self.transformer
        x = t.drop(t.wte(input_ids) + t.wpe(position_ids))  # (B, T, C)
        for i, block in enumerate(t.h):
            x = block(x, attention_mask=attention_mask, cache=caches[i] if caches is not None else None)  # (B, T, C)
        return self._head(t.ln_f(x[:, -keep:] if keep else x))  # (B, T or keep, vocab): the LM head only where logits are wanted

    def _head(self, x: Tensor) -> Tensor:
        """(..., C) -> (..., vocab): ``lm_head`` if set (an int8 copy), else tied to wte."""
        if self.lm_head is not None:
            return project(self.lm_head, x)
        return linear(x, self.transformer.wte.weight)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, *, logits_to_keep: int = 0) -> Tensor:
        """Logits for every position (or the last ``logits_to_keep``).

        Args:
            input_ids: (B, T) token ids.
            attention_mask: (B, T), 1/True = real token, 0/False = padding (ints or bools),
                left or right padding. Positions count real tokens only, as HuggingFace's
                ``generate`` counts them, so a left-padded row gives the logits of the
                unpadded one.
            logits_to_keep: 0 (default) = logits for all T positions; k >= 1 = for the last k
                only (HuggingFace's argument): the LM head then runs on k rows, not T.

        Returns:
            (B, T or logits_to_keep, vocab_size) logits; those at padding positions mean nothing.
        """
        b, t, real = _inputs.ids_and_mask(input_ids, attention_mask, self.config.vocab_size, self.transformer.wte.weight)
        if t > self.config.n_positions:
            raise ValueError(f"input_ids has {t} tokens, more than n_positions={self.config.n_positions}")
        keep = _checks.integer("logits_to_keep (0 = all positions)", logits_to_keep, low=0, high=t)
        return self._logits(input_ids, positions(real, b, t, input_ids.device), _inputs.padding_only(real), None, keep)  # (B, T or keep, vocab)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def context_limit(self) -> tuple[str, int | None]:
        return "n_positions", self.config.n_positions

    def new_caches(self, batch_size: int, max_len: int) -> list[KVCache]:
        c, weight = self.config, self.transformer.wte.weight
        return [  # each layer's own key/value heads: fewer than c.kv_heads when sharded by headwise.parallel
            KVCache(batch_size, block.attn.num_kv_heads, max_len, c.head_dim, dtype=weight.dtype, device=weight.device) for block in self.transformer.h
        ]

    def next_logits(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None, caches: list[KVCache]) -> Tensor:
        """(B, T) ids through the caches -> (B, vocab) logits of the last token (see ``generate``)."""
        if position_ids is None:
            position_ids = positions(None, *input_ids.shape, input_ids.device, start=len(caches[0]))  # (B, T)
        return self._logits(input_ids, position_ids, attention_mask, caches, keep=1)[:, 0]  # (B, vocab): the LM head on the last row only

    def step_logits(self, input_ids: Tensor, position_ids: Tensor | None, caches: list[KVCache]) -> Tensor:
        """``next_logits(input_ids, position_ids, None, caches)`` unchecked: a decode step of ``generate``,
        which checked once what cannot change between steps (see ``generate.unchecked_steps``).

        (B, T) ids through the caches -> (B, vocab) logits of the last token, bit for bit ``next_logits``'s.
        """
        if position_ids is None:
            position_ids = positions(None, *input_ids.shape, input_ids.device, start=len(caches[0]))  # (B, T)
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(position_ids)  # (B, T, C): dropout is off in eval mode
        for block, cache in zip(t.h, caches, strict=True):
            x = x + block.attn.decode(block.ln_1(x), cache)  # (B, T, C)
            x = x + block.mlp(block.ln_2(x))  # (B, T, C)
        return self._head(t.ln_f(x[:, -1:]))[:, 0]  # (B, vocab): the LM head on the last row only

    def new_paged_caches(self, num_blocks: int, block_size: int) -> list[PagedKVCache]:
        """One ``PagedKVCache`` of ``num_blocks`` blocks per layer (``headwise.models.batching``)."""
        c, weight = self.config, self.transformer.wte.weight
        return [PagedKVCache(num_blocks, block_size, b.attn.num_kv_heads, c.head_dim, dtype=weight.dtype, device=weight.device) for b in self.transformer.h]

    def packed_logits(self, input_ids: Tensor, position_ids: Tensor, caches: list[PagedBatch], rows: Tensor) -> Tensor:
        """(1, T) ids of several sequences packed in one row, at (1, T) positions, through one paged
        batch per layer -> (N, vocab) logits at the N positions ``rows`` (each sequence's last token)."""
        t = self.transformer
        x = t.drop(t.wte(input_ids) + t.wpe(position_ids))  # (1, T, C)
        for block, cache in zip(t.h, caches, strict=True):
            x = block(x, cache=cache)  # (1, T, C)
        return self._head(t.ln_f(x[0, rows]))  # (N, vocab)


def gpt2_config(d: dict, file: os.PathLike[str]) -> GPT2Config:
    """A ``GPT2Config`` from a HuggingFace config dict; what this GPT-2 cannot run is an error naming ``file``."""
    unsupported = []
    if d.get("activation_function", "gelu_new") not in TANH_GELUS:
        unsupported.append(f"activation_function={d['activation_function']!r} (supported: {list(TANH_GELUS)})")
    if d.get("n_inner") not in (None, 4 * d.get("n_embd", 768)):
        unsupported.append(f"n_inner={d['n_inner']!r} (the MLP is 4 * n_embd wide)")
    for key, want in [("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False), ("tie_word_embeddings", True)]:
        if d.get(key, want) != want:
            unsupported.append(f"{key}={d[key]!r} (supported: {want})")
    if unsupported:
        raise ValueError(f"{file}: unsupported GPT-2 settings: {'; '.join(unsupported)}")
    try:
        return GPT2Config.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: invalid GPT-2 config: {e}") from None
