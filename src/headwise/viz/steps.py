"""The ten steps of ``headwise explain`` on the book's six tokens, as data for the page.

Each tensor keeps its real values (``-inf`` in the masked scores included) and names its axes
with the book's words (``b``, ``num_tokens``, ``num_heads``, ``head_dim``, ...), so a viewer
can draw every tensor the way the lecture reads it.
"""

from __future__ import annotations

from typing import Any

from ..explain import AXES, BOOK_TOKENS, explain  # AXES: every tensor's axes in the book's names
from .encode import float32_base64

#: Step 8 again with one term that newer models add: (name, what it does, ``explain`` arguments).
#: The book's scores are small (|s| < 0.31), so the cap is 0.1 to make its bend visible.
VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("softcap", "Gemma 2's logit cap: softcap * tanh(scores / softcap) flattens every score above the cap.", {"softcap": 0.1}),
    ("sinks", "gpt-oss's sink: one more logit per head (here 1.0) joins the softmax, takes a share of each row and adds no value.", {"sinks": True}),
    ("alibi", "ALiBi (BLOOM, MPT): no positions; each head adds -slope * distance, so far keys fade.", {"alibi": True}),
    ("documents", "Packed documents: two documents of three tokens in one row; a token sees only its own document.", {"documents": [3, 3]}),
)


def steps_data(*, seed: int = 123) -> dict[str, Any]:
    """Steps 1-10 of ``MultiHeadAttention(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)``
    on the book's six tokens (batch of one), as JSON-ready data.

    Returns:
        ``{"module", "seed", "tokens", "facts", "steps", "variants"}``; each step holds ``number``,
        ``title``, ``code`` and ``tensors``: a list of ``{"name", "shape", "axes", "float32"}``
        (float32 little-endian, base64). ``variants`` is step 8 again under each of ``VARIANTS``:
        ``{"name", "about", "title", "code", "tensors"}`` (capped scores, ALiBi's bias, document
        blocks in the masked scores, each row's sink share).
    """
    mha, steps = explain(d_in=3, d_out=2, num_heads=2, num_tokens=len(BOOK_TOKENS), batch_size=1, seed=seed)
    variants = []
    for name, about, kwargs in VARIANTS:
        step = explain(d_in=3, d_out=2, num_heads=2, num_tokens=len(BOOK_TOKENS), batch_size=1, seed=seed, **kwargs).steps[7]
        variants.append({"name": name, "about": about, "title": step.title, "code": step.code, "tensors": _tensors(step.tensors)})
    return {
        "module": f"MultiHeadAttention(d_in={mha.d_in}, d_out={mha.d_out}, context_length={len(BOOK_TOKENS)}, dropout=0.0, num_heads={mha.num_heads})",
        "seed": seed,
        "tokens": list(BOOK_TOKENS),
        "facts": {"d_out": mha.d_out, "num_heads": mha.num_heads, "head_dim": mha.head_dim},
        "steps": [
            {
                "number": step.number,
                "title": step.title,
                "code": step.code,
                "tensors": _tensors(step.tensors),
            }
            for step in steps
        ],
        "variants": variants,
    }


def _tensors(tensors: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": name, "shape": list(t.shape), "axes": list(AXES[name]), "float32": float32_base64(t)} for name, t in tensors.items()]
