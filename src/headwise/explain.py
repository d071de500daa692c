"""The walk of multi-head attention, step by step, read off a real forward pass.

``explain()`` runs ``MultiHeadAttention`` once under ``headwise.observe`` and files every
tensor the module and the math backend report under the lecture's Steps 1-10. Nothing here
recomputes attention: what you see is what the module computed. Its result shows itself in a
notebook: each step, each tensor as a small table, the attention weights as heatmaps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn

from . import _html
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


def _step_html(step: Step, tokens: list[str]) -> str:
    parts = [f"<h4>Step {step.number}. {_html.escape(step.title)}</h4><code>{_html.escape(step.code)}</code><div>"]
    for name, t in step.tensors.items():
        if name == "weights" and t.ndim >= 3 and t.shape[-1] == t.shape[-2] == len(tokens):  # (B, [H,] T, T)
            per_head = t[0] if t.ndim == 4 else t[:1]  # (H, T, T)
            parts += [_html.heatmap(w, tokens, tokens, caption=f"<code>weights</code> head {h}") for h, w in enumerate(per_head)]
        else:
            parts.append(_html.tensor_table(name, t))
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
     ("capped_scores", "alibi_bias", "masked_scores", "weights", "sink_share")),
    (9, "Context vectors: weights @ values", "attn_weights @ values", ("context",)),
    (10, "Merge the heads, then out_proj", "context.transpose(1, 2).contiguous().view(b, num_tokens, d_out)", ("context.transpose", "merged", "output")),
]


#: Step 8 when nothing is masked (``causal=False``, encoder style).
_BIDIRECTIONAL_STEP_8 = ("No mask (bidirectional): every token sees every token; scale by sqrt(head_dim), softmax", "softmax(scores / head_dim**0.5)")


def _variant_step_8(causal: bool, softcap: float | None, sinks: bool, alibi: bool, documents: bool) -> tuple[str, str]:
    """Step 8's title and code with the extra terms, in the order they act."""
    title, logits = [], "scores / head_dim**0.5"
    if softcap is not None:
        title.append(f"cap the scores at {softcap:g}")
        logits = f"{softcap:g} * tanh({logits} / {softcap:g})"
    if alibi:
        title.append("add ALiBi's distance bias")
        logits = f"{logits} - slope * |i - j|"
    hidden = [m for m, on in (("the future", causal), ("other documents", documents)) if on]
    if hidden:
        title.append("mask " + " and ".join(hidden))
        logits = f"({logits}).masked_fill(mask, -inf)"
    title.append("softmax" + (" with a sink logit per head (it takes a share, has no value)" if sinks else ""))
    code = f"softmax(cat([{logits}, sink]))[..., :-1]" if sinks else f"softmax({logits})"
    text = ", ".join(title)
    return text[0].upper() + text[1:], code


def uses_book_inputs(d_in: int, num_tokens: int) -> bool:
    """True when the book's embeddings fit: width 3 and at most its 6 tokens; else the input is random."""
    return d_in == 3 and num_tokens <= len(BOOK_INPUTS)


def explain(
    *, d_in: int = 3, d_out: int = 2, num_heads: int = 2, num_tokens: int = 3, batch_size: int = 1, seed: int = 123, causal: bool = True,
    softcap: float | None = None, sinks: bool = False, alibi: bool = False, documents: list[int] | None = None,
) -> Explanation:
    """Build ``MultiHeadAttention(d_in, d_out, ...)`` under ``seed`` and walk one forward pass.

    The input is the book's token embeddings when ``uses_book_inputs(d_in, num_tokens)``
    (d_in == 3 and num_tokens <= 6), else ``torch.rand`` under the same seed. With
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
        [(1, 2, 3, 3), (1, 2, 3, 3)]
    """
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_in, d_out, num_tokens, 0.0, num_heads, causal=causal, softcap=softcap, sinks=sinks, alibi=alibi)
    if sinks:
        torch.nn.init.ones_(mha.sinks)  # a visible share (zeros would be a learned start, not a lesson)
    ids = None
    if documents is not None:
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
