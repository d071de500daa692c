"""The heads page inside a notebook: ``heads(text)`` shows every head of a model inline.

The page is the very one ``heads_page`` writes (inline CSS, JavaScript and data, nothing
fetched), placed in an ``<iframe srcdoc>`` with ``sandbox="allow-scripts"``: its script and
styles run in the frame and cannot clash with the notebook's, in JupyterLab, the classic
Notebook and VS Code alike, and a saved notebook still shows it offline.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._checks import integer
from .._html import iframe
from .maps import DEFAULT_TEXT, HeadMaps, head_maps
from .page import heads_page


class HeadsView:
    """Every head of a model on one sentence; shown inline by a notebook, as text elsewhere.

    Attributes:
        maps: the data (``HeadMaps``: weights (L, H, T, T) and each head's role).
        page: the self-contained HTML page.
        height: the frame's height in pixels.
    """

    def __init__(self, maps: HeadMaps, *, height: int = 860) -> None:
        if not isinstance(maps, HeadMaps):
            raise TypeError(f"maps must be a HeadMaps (from headwise.viz.head_maps), got {type(maps).__name__}")
        self.maps = maps
        self.height = integer("height", height, low=200)
        self.page = heads_page(maps)

    def __repr__(self) -> str:
        m = self.maps
        return (f"<heads of {m.model}: {m.layers} layers x {m.heads} heads on {len(m.tokens)} tokens of {m.text!r}; "
                "shown inline in a notebook, .save(path) writes the page>")

    def _repr_html_(self) -> str:
        return iframe(self.page, title=f"headwise: the attention heads of {self.maps.model}", height=self.height)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the page (the one ``headwise heads`` writes) to ``path``; returns the path."""
        out = Path(path)
        out.write_text(self.page, encoding="utf-8")
        return out


def heads(text: str = DEFAULT_TEXT, model: str | os.PathLike[str] | None = None, *, height: int = 860) -> HeadsView:
    """Every attention head of ``model`` on ``text``, to show inline in a notebook.

    Args:
        text: one sentence.
        model: a HuggingFace directory (BERT-style or GPT-2); None = the packaged all-MiniLM-L6-v2.
        height: the frame's height in pixels (at least 200).

    Returns:
        A ``HeadsView``: the last expression of a cell shows it; ``.save(path)`` writes the page.

    Example:
        >>> view = heads("The cat sat on the mat.")
        >>> view._repr_html_().startswith('<iframe srcdoc="&lt;!DOCTYPE html&gt;')
        True
    """
    return HeadsView(head_maps(model, text), height=height)
