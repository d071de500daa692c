"""The ten steps of ``headwise explain`` on the book's six tokens, as data for the page.

Each tensor keeps its real values (``-inf`` in the masked scores included) and names its axes
with the book's words (``b``, ``num_tokens``, ``num_heads``, ``head_dim``, ...), so a viewer
can draw every tensor the way the lecture reads it.
"""

from __future__ import annotations

from typing import Any

from ..explain import BOOK_TOKENS, explain
from .encode import float32_base64

_T = "num_tokens"

#: The axes of every tensor ``explain`` reports, in the book's names.
AXES: dict[str, tuple[str, ...]] = {
    "x": ("b", _T, "d_in"),
    **{f"W_{n}": ("d_out", "d_in") for n in ("query", "key", "value")},
    **{n: ("b", _T, "d_out") for n in ("queries", "keys", "values", "merged", "output")},
    **{f"{n}.view": ("b", _T, "num_heads", "head_dim") for n in ("queries", "keys", "values")},
    **{f"{n}.transpose": ("b", "num_heads", _T, "head_dim") for n in ("queries", "keys", "values")},
    **{n: ("b", "num_heads", _T, _T) for n in ("scores", "masked_scores", "weights")},
    "context": ("b", "num_heads", _T, "head_dim"),
    "context.transpose": ("b", _T, "num_heads", "head_dim"),
}


def steps_data(*, seed: int = 123) -> dict[str, Any]:
    """Steps 1-10 of ``MultiHeadAttention(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=2)``
    on the book's six tokens (batch of one), as JSON-ready data.

    Returns:
        ``{"module", "seed", "tokens", "facts", "steps"}``; each step holds ``number``,
        ``title``, ``code`` and ``tensors``: a list of ``{"name", "shape", "axes", "float32"}``
        (float32 little-endian, base64).
    """
    mha, steps = explain(d_in=3, d_out=2, num_heads=2, num_tokens=len(BOOK_TOKENS), batch_size=1, seed=seed)
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
                "tensors": [
                    {"name": name, "shape": list(t.shape), "axes": list(AXES[name]), "float32": float32_base64(t)}
                    for name, t in step.tensors.items()
                ],
            }
            for step in steps
        ],
    }
