"""Known mistakes, as tensors: what each one would compute, built from the correct steps.

A hint is given when one of the learner's tensors equals a mistake's tensor (numbers, never
source text). Each ``Probe`` names the step where its mistake first shows; the hint texts do
not depend on the configuration, so the hints of several failing configurations can be
intersected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .reference import Config, Reference

SHARED_QK = "{got} equal the {other}: W_query and W_key are one layer, or both are computed with the same one; give each its own nn.Linear"
SWAPPED = "keys and queries are swapped: the scores are keys @ queries.T; compute queries @ keys.transpose(-2, -1)"
NO_MASK = "the causal mask is missing: fill the scores above the diagonal with -inf (masked_fill) before the softmax"
MASK_DISCARDED = ("the causal mask never reaches the softmax: masked_fill returns a new tensor and leaves the scores as they "
                  "were; keep its result (scores = scores.masked_fill(...)) or fill in place with masked_fill_")
MASK_DIAGONAL = ("the mask hides the diagonal too (triu with diagonal=0): each token must see itself, or its first row sees "
                 "nothing; mask only the later tokens: torch.triu(torch.ones(context_length, context_length), diagonal=1)")
MASK_PAST = ("the mask hides the earlier tokens and each token itself (tril where the book takes triu): mask the later "
             "tokens, above the diagonal: torch.triu(torch.ones(context_length, context_length), diagonal=1)")
MASK_ZERO = ("the scores above the diagonal are set to 0, not -inf: the softmax still gives them weight (e^0 = 1); "
             "fill them with -torch.inf (masked_fill) so that no token attends to a later one")
MASK_AFTER = "the mask is applied after the softmax: mask the scores with -inf first, then take the softmax, so each row still sums to 1"
MASK_NOT_CUT = "the mask is not cut to num_tokens: it fails only when num_tokens < context_length; use self.mask.bool()[:num_tokens, :num_tokens]"
NO_SCALE = "the scores are not scaled: divide them by sqrt(head_dim), keys.shape[-1] ** 0.5, before the softmax"
WRONG_SCALE = "the scores are scaled by sqrt({size}); the book divides them by sqrt(head_dim), keys.shape[-1] ** 0.5"
NOT_SQRT = "the scores are divided by head_dim; the book divides them by its square root, keys.shape[-1] ** 0.5"
SOFTMAX_DIM = "the softmax runs over {what} (dim {dim} of {layout}); each query's weights must sum to 1 over the keys: softmax(..., dim=-1)"
NO_TRANSPOSE = "{name} are viewed as (b, num_heads, num_tokens, head_dim) directly: view as (b, num_tokens, num_heads, head_dim), then .transpose(1, 2)"
MERGE_NO_TRANSPOSE = "the heads are merged without transposing back: context_vec.transpose(1, 2).contiguous().view(b, num_tokens, d_out)"
MERGE_TRANSPOSE_23 = ("the heads are merged after transpose(2, 3), which swaps tokens and head_dim; transpose(1, 2) brings the tokens "
                      "back before the heads: context_vec.transpose(1, 2).contiguous().view(b, num_tokens, d_out)")
NO_OUT_PROJ = "the output is the merged heads as they are: apply self.out_proj to them last"
WRONG_SHAPE = "right numbers, wrong shape: every step matches the book's, but forward returns them in another shape; return (b, num_tokens, d_out)"
NOT_RETURNED = "every step matches the book's, but forward returns None: end it with return context_vec, (b, num_tokens, d_out)"
NOT_A_TENSOR = ("every step matches the book's, but forward returns something else than a tensor (a tuple?): return the "
                "context vectors alone, one tensor of shape (b, num_tokens, d_out)")
DROPOUT_IN_EVAL = ("with dropout=0.5 the output changes in eval() mode: dropout must act in training only; use an "
                   "nn.Dropout module (self.dropout = nn.Dropout(dropout)), or F.dropout(..., training=self.training)")
DROPOUT_NEVER = ("built with dropout, the output in train() mode is the eval() output: dropout is never applied; "
                 "apply self.dropout to the attention weights after the softmax")
DROPOUT_ELSEWHERE = ("built with dropout, in train() mode, under the same seed, the output is not the book's: dropout is applied "
                     "somewhere else or at another rate; apply self.dropout = nn.Dropout(dropout) to the attention weights "
                     "after the softmax, and nowhere else")
SECOND_CALL = ("the output is the book's, but the same module called again with one token fewer gives another: something "
               "made in the first call is kept (a mask made at its number of tokens?); make the mask once in __init__ for "
               "context_length tokens and slice it to each call's, as the book does")
CHANGED_AFTER = ("the right output was computed, then changed before forward returned it: every step matches the book's, "
                 "the last one too; return what the last step (self.out_proj, or the concatenated heads) gives, as it is")
SHARED_HEADS = ("every head computes the same numbers: the heads are one CausalAttention listed num_heads times "
                "([CausalAttention(...)] * num_heads repeats one module, so they share its weights); give each head its own: "
                "nn.ModuleList([CausalAttention(...) for _ in range(num_heads)])")
NO_OUT_PROJ_BIAS = "out_proj has no bias: the book's is nn.Linear(d_out, d_out), with one (bias=True, the default)"
NO_QKV_BIAS = ("built with qkv_bias=True, the queries, keys and values have no bias: qkv_bias is ignored; build W_query, "
               "W_key and W_value as nn.Linear(d_in, d_out, bias=qkv_bias), as the book does")
CAT_DIM = "the heads are concatenated on dim {dim} ({what}); put them side by side on the last dim: torch.cat([...], dim=-1)"


@dataclass(frozen=True)
class Probe:
    """A known mistake: the step where it shows, its hint, and the tensor it would compute."""

    step: str
    hint: str
    tensor: Tensor
    scale_free: bool = False  # any positive multiple counts (raw scores, scaled or not)
    returned: bool = False  # only what forward returns counts (the output's mistakes)
    same_kind: bool = True  # the tensor stands for the step itself (shown as "got"), not a later one
    twice: bool = False  # one layer in two roles makes its tensor twice: only two records equal to it count


#: A mistake whose tensor is computed on the way to a more specific mistake's: drop it when both match.
IMPLIED = {MASK_AFTER: NO_MASK}


def narrow(hints: list[str]) -> list[str]:
    """The matched hints, each once, without those a more specific matched hint explains."""
    implied = {IMPLIED[h] for h in hints if h in IMPLIED}
    return [h for h in dict.fromkeys(hints) if h not in implied]  # each once: several probes may give one hint


def probes(kind: str, ref: Reference, config: Config) -> list[Probe]:
    """Every known mistake's tensor for ``kind`` under ``config``, skipping those equal to the right one."""
    s = ref.steps
    if kind == "CausalAttention":
        found = _attention(s, "", ref.scale, {"d_in": config.d_in, "num_tokens": config.num_tokens})
    elif kind == "MultiHeadAttentionWrapper":
        found = [p for i in range(config.num_heads) for p in _attention(s, f"heads.{i}.", ref.scale, {"d_in": config.d_in, "num_tokens": config.num_tokens})]
        heads = [s[f"heads.{i}.context"] for i in range(config.num_heads)]  # (B, T, d_out) each
        found += [Probe(f"heads.{i}.queries", SHARED_HEADS, s[f"heads.{j}.queries"], twice=True)  # one module's weights, from head j
                  for i in range(config.num_heads) for j in range(config.num_heads) if i != j]
        found += [Probe("output", CAT_DIM.format(dim=d, what=w), torch.cat(heads, dim=d), returned=True) for d, w in ((0, "the batch"), (1, "the tokens"))]
    else:
        sizes = {"d_in": config.d_in, "d_out": config.d_out, "num_heads": config.num_heads, "num_tokens": config.num_tokens}
        found = _attention(s, "", ref.scale, sizes) + _heads(s)
        found.append(Probe("output", NO_OUT_PROJ_BIAS, s["output"] - ref.state["out_proj.bias"], returned=True))  # (B, T, d_out)
    if config.qkv_bias:
        heads = [f"heads.{i}." for i in range(config.num_heads)] if kind == "MultiHeadAttentionWrapper" else [""]
        found += [Probe(prefix + step, NO_QKV_BIAS, s[prefix + step] - ref.state[f"{prefix}W_{layer}.bias"])  # (B, T, d_out)
                  for prefix in heads for step, layer in (("queries", "query"), ("keys", "key"), ("values", "value"))]
    return [p for p in found if p.tensor.shape != s[p.step].shape or not torch.equal(p.tensor, s[p.step])]


def _attention(s: dict[str, Tensor], prefix: str, scale: float, sizes: dict[str, int]) -> list[Probe]:
    """Mistakes inside one attention: (B, T, T) steps for a head, (B, H, T, T) for multi-head."""
    scores, masked = s[prefix + "scores"], s[prefix + "masked_scores"]  # (B, [H,] T, T)
    T = scores.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # (T, T): True above the diagonal
    unmasked = torch.softmax(scores * scale, dim=-1)
    head_size = round(1 / scale**2)
    q, k = (s.get(prefix + n + ".transpose", s[prefix + n]) for n in ("queries", "keys"))  # (B, [H,] T, D) each
    found = [
        Probe(prefix + "queries", SHARED_QK.format(got="queries", other="keys"), s[prefix + "keys"], twice=True),
        Probe(prefix + "keys", SHARED_QK.format(got="keys", other="queries"), s[prefix + "queries"], twice=True),
        # one tensor made once in both roles (queries = keys = self.W_key(x)): its scores against itself show it
        Probe(prefix + "queries", SHARED_QK.format(got="queries", other="keys"), k @ k.transpose(-2, -1), scale_free=True, same_kind=False),
        Probe(prefix + "keys", SHARED_QK.format(got="keys", other="queries"), q @ q.transpose(-2, -1), scale_free=True, same_kind=False),
        Probe(prefix + "scores", SWAPPED, scores.transpose(-2, -1), scale_free=True),
        Probe(prefix + "masked_scores", MASK_ZERO, scores.masked_fill(future, 0.0), scale_free=True),
        Probe(prefix + "masked_scores", MASK_DIAGONAL, scores.masked_fill(future | torch.eye(T, dtype=torch.bool), -math.inf), scale_free=True),
        Probe(prefix + "masked_scores", MASK_PAST, scores.masked_fill(~future, -math.inf), scale_free=True),
        Probe(prefix + "masked_scores", NO_MASK, unmasked, same_kind=False),
        Probe(prefix + "masked_scores", MASK_AFTER, unmasked.masked_fill(future, 0.0), same_kind=False),
        Probe(prefix + "masked_scores", MASK_AFTER, unmasked.masked_fill(future, -math.inf), same_kind=False),
        Probe(prefix + "weights", MASK_DISCARDED, unmasked),  # a masked step computed, then the unmasked scores used
        Probe(prefix + "weights", NO_SCALE, torch.softmax(masked, dim=-1)),
        Probe(prefix + "weights", NOT_SQRT, torch.softmax(masked / head_size, dim=-1)),
    ]
    found += [Probe(prefix + "weights", WRONG_SCALE.format(size=n), torch.softmax(masked / math.sqrt(v), dim=-1)) for n, v in sizes.items()]
    what = ("the batch", "the heads", "the queries") if masked.ndim == 4 else ("the batch", "the queries")
    layout = "(b, num_heads, num_tokens, num_tokens)" if masked.ndim == 4 else "(b, num_tokens, num_tokens)"
    for dim, w in enumerate(what):
        found.append(Probe(prefix + "weights", SOFTMAX_DIM.format(what=w, dim=dim, layout=layout), torch.softmax(masked * scale, dim=dim)))
    return found


def _heads(s: dict[str, Tensor]) -> list[Probe]:
    """Mistakes in splitting and merging heads, and the last projection (MultiHeadAttention)."""
    B, H, T, D = s["queries.transpose"].shape
    found = [Probe(f"{n}.transpose", NO_TRANSPOSE.format(name=n), s[n].reshape(B, H, T, D)) for n in ("queries", "keys", "values")]
    found.append(Probe("merged", MERGE_NO_TRANSPOSE, s["context"].reshape(B, T, H * D)))
    found.append(Probe("merged", MERGE_TRANSPOSE_23, s["context"].transpose(2, 3).reshape(B, T, H * D)))  # (B, H, D, T) read as (B, T, C)
    found.append(Probe("output", NO_OUT_PROJ, s["merged"], returned=True))
    return found
