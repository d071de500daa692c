"""The walk of multi-head attention, step by step, read off a real forward pass.

``explain()`` runs ``MultiHeadAttention`` once under ``headwise.observe`` and files every
tensor the module and the math backend report under the lecture's Steps 1-10. Nothing here
recomputes attention: what you see is what the module computed. Its result shows itself in a
notebook: each step, each tensor as a small table, the attention weights as heatmaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import _checks, _html, _text
from .observe import observe
from .teaching import MultiHeadAttention

#: "Your journey starts with one step": the book's 3-d embeddings of its six tokens.
BOOK_INPUTS = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your
        [0.55, 0.87, 0.66],  # journey
        [0.57, 0.85, 0.64],  # starts
        [0.22, 0.58, 0.33],  # with
        [0.77, 0.25, 0.10],  # one
        [0.05, 0.80, 0.55],  # step
    ]
)
BOOK_TOKENS = ("Your", "journey", "starts", "with", "one", "step")
PRINTED = 2**24  # explain prints every tensor: no more numbers than this in its largest (B * H * T * T scores, ...)

_T = "num_tokens"

#: The axes of every tensor ``explain`` reports, in the book's names.
AXES: dict[str, tuple[str, ...]] = {
    "x": ("b", _T, "d_in"),
    **{f"W_{n}": ("d_out", "d_in") for n in ("query", "key", "value")},
    **{n: ("b", _T, "d_out") for n in ("queries", "keys", "values", "merged", "output")},
    **{f"{n}.view": ("b", _T, "num_heads", "head_dim") for n in ("queries", "keys", "values")},
    **{f"{n}.transpose": ("b", "num_heads", _T, "head_dim") for n in ("queries", "keys", "values")},
    **{n: ("b", "num_heads", _T, _T) for n in ("scores", "capped_scores", "alibi_bias", "masked_scores", "weights")},
    "sink_share": ("b", "num_heads", _T),
    "context": ("b", "num_heads", _T, "head_dim"),
    "context.transpose": ("b", _T, "num_heads", "head_dim"),
    **{f"{n}.rotated": ("b", "num_heads", _T, "head_dim") for n in ("queries", "keys")},  # explain_rope's
    "angles": (_T, "head_dim / 2"),
}


def book_batch() -> Tensor:
    """The book's batch: its six token embeddings twice, (2, 6, 3)."""
    return torch.stack((BOOK_INPUTS, BOOK_INPUTS), dim=0)


@dataclass
class Step:
    """One step of the walk: its number and title, what it does, the tensors it produced."""

    number: int
    title: str
    code: str
    tensors: dict[str, Tensor] = field(default_factory=dict)


class Explanation(NamedTuple):
    """A module and the steps of one forward pass; unpacks as ``module, steps = explain()``.

    ``repr`` lists each step's tensors and shapes; in a notebook (``_repr_html_``) each step
    shows its code, every tensor as a small table and attention weights as one heatmap per head.
    """

    module: nn.Module
    steps: list[Step]

    def tokens(self) -> list[str]:
        """The input's token labels: the book's words when the input is its embeddings, else ``#0``, ``#1``, ..."""
        x = next((s.tensors["x"] for s in self.steps if "x" in s.tensors), None)  # (B, T, d_in)
        T = 0 if x is None else x.shape[1]
        if x is not None and uses_book_inputs(x.shape[-1], T) and torch.equal(x[0], BOOK_INPUTS[:T].to(x.dtype)):
            return list(BOOK_TOKENS[:T])
        return [f"#{i}" for i in range(T)]

    def to_text(self) -> str:
        """Every step as plain text: its title, its code and every matrix of each tensor (``step_text``)."""
        tokens = self.tokens()
        return "\n\n".join(step_text(s, tokens) for s in self.steps)

    def __repr__(self) -> str:
        lines = [f"{type(self.module).__name__}: {len(self.steps)} steps"]
        for s in self.steps:
            shapes = ", ".join(f"{name} {tuple(t.shape)}" for name, t in s.tensors.items())
            lines.append(f"  Step {s.number}. {s.title}" + (f": {shapes}" if shapes else ""))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        tokens = self.tokens()
        body = [f"<h3>{_html.escape(type(self.module).__name__)}: Steps {self.steps[0].number}-{self.steps[-1].number}</h3>"]
        body += [_step_html(s, tokens) for s in self.steps]
        return _html.block("explain", "".join(body))

_EACH = {"b": "batch row", "num_heads": "head", _T: "token"}


def label(name: str, shape: tuple[int, ...], tokens: list[str]) -> _text.Label:
    """Titles for the matrices of tensor ``name``: ``head 1``, a token's word, ``b=1`` when the batch has
    more than one row (nothing for a batch of one); ``[i, j, :, :]`` for a tensor without known axes."""
    axes = AXES.get(name)
    if axes is None or len(axes) != len(shape):
        return _text.index_label

    def title(index: tuple[int, ...]) -> str:
        parts = []
        for axis, i, n in zip(axes, index, shape, strict=False):
            if axis == "num_heads":
                parts.append(f"head {i}")
            elif axis == _T:
                parts.append(tokens[i] if i < len(tokens) else f"#{i}")
            elif axis != "b" or n > 1:
                parts.append(f"{axis}={i}")
        return ", ".join(parts)

    return title


def step_text(step: Step, tokens: list[str]) -> str:
    """A step as plain text: its title and code, then each tensor's name, shape and axes over
    every matrix of it side by side (a (b, num_heads, ...) tensor shows every head)."""
    lines = [f"## Step {step.number}: {step.title}", f"   {step.code}"]
    for name, t in step.tensors.items():
        axes = AXES.get(name) if len(AXES.get(name, ())) == t.ndim else None
        head = f"-- {name}: shape {tuple(t.shape)}" + (f" = ({', '.join(axes)})" if axes else "")
        if axes and t.ndim > 2 and math.prod(t.shape[:-2]) > 1:
            each = [a for a, n in zip(axes[:-2], t.shape[:-2], strict=True) if a != "b" or n > 1]
            head += f": one ({axes[-2]}, {axes[-1]}) block per {' and '.join(_EACH.get(a, a) for a in each)}"
        lines += [head, _text.tensor_text(t, label=label(name, tuple(t.shape), tokens))]
    return "\n".join(lines)


def nonfinite(steps: list[Step]) -> str | None:
    """Which tensor first holds a value that is not a number the lesson can show, or None.

    NaN and +inf are never right; -inf is right only in the masked scores (the mask itself).
    """
    for step in steps:
        for name, t in step.tensors.items():
            masked = t == -torch.inf if name == "masked_scores" else torch.zeros_like(t, dtype=torch.bool)
            bad = ~torch.isfinite(t) & ~masked
            if bad.any():
                kinds = " and ".join(k for k, found in (("NaN", torch.isnan(t).any()), ("inf", (torch.isinf(t) & bad).any())) if found)
                return f"step {step.number}'s {name} holds {kinds} ({int(bad.sum())} of {t.numel()} values)"
    return None


def _step_html(step: Step, tokens: list[str]) -> str:
    parts = [f"<h4>Step {step.number}. {_html.escape(step.title)}</h4><code>{_html.escape(step.code)}</code><div>"]
    for name, t in step.tensors.items():
        title = label(name, tuple(t.shape), tokens)
        if name == "weights" and t.ndim >= 3 and t.shape[-1] == t.shape[-2] == len(tokens):  # (B, [H,] T, T)
            parts += [_html.heatmap(w, tokens, tokens, caption=f"<code>weights</code> {_html.escape(title(i))}") for i, w in _text.matrices(t, 12)]
        else:
            axes = f"({', '.join(AXES[name])})" if name in AXES else ""
            parts.append(_html.tensor_table(name, t, label=title, axes=axes))
    return f'<div class="hw-step" data-step="{step.number}">' + "".join(parts) + "</div></div>"


_STEPS: list[tuple[int, str, str, tuple[str, ...]]] = [
    (1, "Start with the input (b, num_tokens, d_in)", "b, num_tokens, d_in = x.shape", ("x",)),
    (2, "Decide d_out and the number of heads", "head_dim = d_out // num_heads", ()),
    (3, "Trainable weights W_query, W_key, W_value (d_out, d_in)", "self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)", ()),
    (4, "Project: queries, keys, values (b, num_tokens, d_out)", "queries = self.W_query(x)", ("queries", "keys", "values")),
    (5, "Unroll d_out into (num_heads, head_dim)", "queries.view(b, num_tokens, num_heads, head_dim)", ("queries.view", "keys.view", "values.view")),
    (6, "Group by head: transpose(1, 2) -> (b, num_heads, num_tokens, head_dim)", "queries.transpose(1, 2)", ("queries.transpose", "keys.transpose", "values.transpose")),
    (7, "Attention scores for every head at once", "queries @ keys.transpose(2, 3)", ("scores",)),
    (8, "Mask the future, scale by sqrt(head_dim), softmax", "softmax(scores.masked_fill(mask, -inf) / head_dim**0.5)",
     ("capped_scores", "masked_scores", "alibi_bias", "weights", "sink_share")),
    (9, "Context vectors: weights @ values", "attn_weights @ values", ("context",)),
    (10, "Merge the heads, then out_proj", "context.transpose(1, 2).contiguous().view(b, num_tokens, d_out)", ("context.transpose", "merged", "output")),
]


#: Step 8 when nothing is masked (``causal=False``, encoder style).
_BIDIRECTIONAL_STEP_8 = ("No mask (bidirectional): every token sees every token; scale by sqrt(head_dim), softmax", "softmax(scores / head_dim**0.5)")


def _variant_step_8(causal: bool, softcap: float | None, sinks: bool, alibi: bool, documents: bool) -> tuple[str, str]:
    """Step 8's title and code with the extra terms, in the order the math backend applies them, which is the order of
    the tensors the step shows: the mask on the raw scores, then the scale (with a cap: scale and cap first, then the
    mask); ALiBi's bias added after; the sink beside the keys in the softmax."""
    title, logits = [], "scores"
    hidden = [m for m, on in (("the future", causal), ("other documents", documents)) if on]
    if softcap is not None:
        title.append(f"scale by sqrt(head_dim) and cap the scores at {softcap:g}")
        logits = f"{softcap:g} * tanh(scores / head_dim**0.5 / {softcap:g})"
    if hidden:
        title.append("mask " + " and ".join(hidden))
        logits = f"({logits}).masked_fill(mask, -inf)" if softcap is not None else f"{logits}.masked_fill(mask, -inf)"
    if softcap is None:
        title.append("scale by sqrt(head_dim)")
        logits = f"{logits} / head_dim**0.5"
    if alibi:
        title.append("add ALiBi's distance bias")
        logits = f"{logits} - slope * |i - j|"
    title.append("softmax" + (" with a sink logit per head (it takes a share, has no value)" if sinks else ""))
    code = f"softmax(cat([{logits}, sink]))[..., :-1]" if sinks else f"softmax({logits})"
    text = ", ".join(title)
    return text[0].upper() + text[1:], code


def uses_book_inputs(d_in: int, num_tokens: int) -> bool:
    """True when the book's embeddings fit: width 3 and at most its 6 tokens; else the input is random."""
    return d_in == 3 and num_tokens <= len(BOOK_INPUTS)


def printed(largest: int, fewer: str) -> None:
    """A ValueError when an explanation's largest tensor holds more than ``PRINTED`` numbers: it prints every one, so
    such sizes are a typo, not a lesson (``fewer``: what to take less of)."""
    if largest > PRINTED:
        raise ValueError(f"explain prints every tensor: these sizes make one of {largest:,} numbers (more than {PRINTED:,}); "
                         f"take fewer {fewer}")


def explain(
    *, d_in: int = 3, d_out: int = 2, num_heads: int = 2, num_tokens: int = 6, batch_size: int = 1, seed: int = 123, causal: bool = True,
    softcap: float | None = None, sinks: bool = False, alibi: bool = False, documents: list[int] | None = None,
) -> Explanation:
    """Build ``MultiHeadAttention(d_in, d_out, ...)`` under ``seed`` and walk one forward pass.

    The defaults are the book's: ``MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)`` under seed 123 on
    its six tokens, so step 10's output is the book's printed context vectors. The input is the
    book's token embeddings when ``uses_book_inputs(d_in, num_tokens)`` (d_in == 3 and
    num_tokens <= 6), else ``torch.rand`` under the same seed. With
    ``causal=False`` step 8 masks nothing and says so. ``softcap``, ``sinks`` (sink logits
    set to 1.0) and ``alibi`` build the module with those terms, and ``documents`` (lengths
    adding up to num_tokens) packs the tokens into documents: step 8 then also shows the
    capped scores, the ALiBi bias, the document blocks in the masked scores and each row's
    sink share.

    Returns:
        An ``Explanation``: the module and its Steps 1-10, each holding the tensors that step
        produced (``mha, steps = explain()``).

    Example:
        >>> mha, steps = explain()
        >>> [tuple(t.shape) for t in steps[7].tensors.values()]     # masked scores, weights: (B, H, T, T)
        [(1, 2, 6, 6), (1, 2, 6, 6)]
        >>> steps[9].tensors["output"][0, 0]                        # the book's first context vector
        tensor([0.3190, 0.4858])
    """
    for name, value in (("d_in", d_in), ("d_out", d_out), ("num_heads", num_heads), ("num_tokens", num_tokens), ("batch_size", batch_size)):
        _checks.positive_int(name, value)  # (by this function's names: num_tokens is the module's context_length)
    _checks.integer("seed", seed, low=0, high=2**64 - 1)  # torch.manual_seed's range
    printed(max(batch_size * num_tokens * max(d_in, d_out), batch_size * num_heads * num_tokens**2, d_in * d_out),
            "num_tokens, batch_size or narrower widths")
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_in, d_out, num_tokens, 0.0, num_heads, causal=causal, softcap=softcap, sinks=sinks, alibi=alibi)
    if sinks:
        torch.nn.init.ones_(mha.sinks)  # a visible share (zeros would be a learned start, not a lesson)
    ids = None
    if documents is not None:
        if not isinstance(documents, (list, tuple)) or not all(isinstance(n, int) and not isinstance(n, bool) for n in documents):
            raise TypeError(f"documents must be a list of ints (each document's length), got {documents!r}")
        if sum(documents) != num_tokens or any(n < 1 for n in documents):
            raise ValueError(f"documents must be positive lengths adding up to num_tokens={num_tokens}, got {documents}")
        ids = torch.repeat_interleave(torch.arange(len(documents)), torch.tensor(documents))[None].expand(batch_size, -1)  # (B, T)
    if uses_book_inputs(d_in, num_tokens):
        x = BOOK_INPUTS[:num_tokens].expand(batch_size, num_tokens, 3)  # (B, T, 3)
    else:
        x = torch.rand(batch_size, num_tokens, d_in)  # (B, T, d_in)
    seen: dict[str, Tensor] = {}
    with observe(lambda name, t: seen.setdefault(name, t)), torch.no_grad():
        mha(x, documents=ids)
    steps = [Step(n, title, code, {name: seen[name] for name in names if name in seen}) for n, title, code, names in _STEPS]
    if not causal:
        steps[7].title, steps[7].code = _BIDIRECTIONAL_STEP_8
    if softcap is not None or sinks or alibi or documents is not None:
        steps[7].title, steps[7].code = _variant_step_8(causal, softcap, sinks, alibi, documents is not None)
    steps[2].tensors = {name: getattr(mha, name).weight.detach() for name in ("W_query", "W_key", "W_value")}
    return Explanation(mha, steps)
