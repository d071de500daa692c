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

from ..cache import Cache
from ..config import GPT2Config
from ..convert import HF_GPT2_TRANSPOSED, is_legacy_gpt2_buffer, load_checked
from ..fused import GPT2MultiHeadAttention
from ..linear import project
from ..masks import positions as _positions
from . import loading
from .causal import CausalModel

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
        return self.dropout(project(self.c_proj, project(self.c_fc, x, self.act)))  # (B, T, 4C) inside (its GELU in the GEMM), (B, T, C) out


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); (B, T, C) -> (B, T, C)."""

    flat_parts = ("ln_1", "attn", "ln_2", "mlp")  # forward's order, for models.flat_step

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = GPT2MultiHeadAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, *, attention_mask: Tensor | None = None, cache: Cache | None = None, position_ids: Tensor | None = None, check: bool = True
    ) -> Tensor:
        """``position_ids`` are the model's to embed: GPT-2's attention encodes no positions."""
        x = x + self.attn(self.ln_1(x), attention_mask=attention_mask, cache=cache, check=check)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(CausalModel):
    """GPT-2: token + position embeddings, ``n_layer`` pre-LN blocks, final LayerNorm, tied LM head.

    Args:
        config: a ``GPT2Config`` (``n_kv_head`` gives grouped-query attention; GPT-2 has none).

    ``GPT2LMHeadModel.from_pretrained(directory)`` loads a HuggingFace GPT-2 directory.

    Example (``CausalModel`` shows the forward's other uses):
        >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
        >>> model(torch.tensor([[5, 6, 7]])).shape                 # (B, T, vocab_size)
        torch.Size([1, 3, 100])
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
        wte = next((key for key in ("transformer.wte.weight", "wte.weight") if key in state), "wte.weight")
        tied = loading.tied_head(state.get("lm_head.weight"), state.get(wte), wte, "headwise's GPT-2 ties them (tie_word_embeddings)")
        with torch.device("meta"):  # shapes only: the tensors are checked against them before any memory is taken
            model = cls(config)
        prefixed = any(key.startswith("transformer.") for key in state)  # how the file names the rest: a missing key so
        load_checked(
            model,
            state,
            source=file,
            rename=lambda key: key if key.startswith("transformer.") else "transformer." + key,
            named=lambda key: key if prefixed else key.removeprefix("transformer."),
            transposed=HF_GPT2_TRANSPOSED,
            ignore=lambda key: key == "lm_head.weight" or is_legacy_gpt2_buffer(key),
            problems=tied,
        )
        return model.eval()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.transformer.wte

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    @property
    def final_norm(self) -> nn.Module:
        return self.transformer.ln_f

    def embed(self, input_ids: Tensor, positions: Tensor | None, attention_mask: Tensor | None, cache: list[Cache] | None) -> Tensor:
        """(B, T) ids -> wte(ids) + wpe(positions), dropped out: (B, T, C). Default positions: after the cached
        tokens, real tokens counted; for a paged batch, each sequence's after its own."""
        t = self.transformer
        if positions is None:
            b, n = input_ids.shape
            start = 0 if cache is None else cache[0].start(n, attention_mask)  # an int, or positions: (B, T) after padding, (1, T) paged
            positions = start if isinstance(start, Tensor) else _positions(attention_mask, b, n, input_ids.device, start=start)  # (B, T)
        return t.drop(t.wte(input_ids) + t.wpe(positions))  # (B, T, C)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def context_limit(self) -> tuple[str, int | None]:
        return "n_positions", self.config.n_positions


def gpt2_config(d: dict, file: os.PathLike[str]) -> GPT2Config:
    """A ``GPT2Config`` from a HuggingFace config dict; what this GPT-2 cannot run is an error naming ``file``."""
    unsupported = []
    width = d.get("n_embd", 768)
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"{file}: invalid GPT-2 config: n_embd must be a positive int, got {width!r}")
    if d.get("activation_function", "gelu_new") not in TANH_GELUS:
        unsupported.append(f"activation_function={d['activation_function']!r} (supported: {list(TANH_GELUS)})")
    inner = d.get("n_inner")
    if inner is not None and (isinstance(inner, bool) or not isinstance(inner, int)):
        raise ValueError(f"{file}: invalid GPT-2 config: n_inner must be an int or null, got {inner!r}")
    if inner not in (None, 4 * width):
        unsupported.append(f"n_inner={inner!r} (the MLP is 4 * n_embd wide)")
    for key, want in [("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False), ("tie_word_embeddings", True)]:
        value = d.get(key, want)
        if not isinstance(value, bool):  # (1 == True: read as a switch, a number would pass)
            raise ValueError(f"{file}: invalid GPT-2 config: {key} must be true or false, got {value!r}")
        if value != want:
            unsupported.append(f"{key}={value!r} (supported: {want})")
    if unsupported:
        raise ValueError(f"{file}: unsupported GPT-2 settings: {'; '.join(unsupported)}")
    try:
        return GPT2Config.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: invalid GPT-2 config: {e}") from None
