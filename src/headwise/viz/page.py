"""One self-contained HTML page of every head: inline CSS, JavaScript and data, nothing fetched.

``heads_page(maps)`` fills ``page.html`` with ``page.css``, ``page.js`` and ``page_data(maps)``
(which includes the ten steps of ``headwise explain``). The data sits in one
``<script type="application/json" id="headwise-data">`` element, so the page can be read back
and embedded; weights travel as exact float32 (base64). The page writes every text from the
data through ``textContent``, never as HTML.
"""

from __future__ import annotations

import re
from importlib import resources
from typing import Any

from .. import __version__
from .encode import float32_base64, script_json
from .maps import ROLE_COLOURS, HeadMaps
from .steps import steps_data

_SLOT = re.compile(r"/\*\{\{(\w+)\}\}\*/")


def page_data(maps: HeadMaps) -> dict[str, Any]:
    """What the page shows, as JSON-ready data.

    Returns:
        ``model``, ``text``, ``tokens`` (T), ``causal``, ``layers`` (L), ``heads`` (H),
        ``weights`` = ``{"shape": [L, H, T, T], "float32": base64}`` (row-major,
        little-endian), ``kinds``, ``colours`` (role -> CSS colour), ``roles``: L*H entries
        ``{"role", "share", "mass"}`` in (layer, head) order, and ``steps`` (``steps_data()``).
    """
    if not isinstance(maps, HeadMaps):
        raise TypeError(f"maps must be a HeadMaps (from headwise.viz.head_maps), got {type(maps).__name__}")
    roles = []
    for layer in range(maps.layers):
        for head in range(maps.heads):
            role, share = maps.role(layer, head)
            roles.append({"role": role, "share": round(share, 4), "mass": [round(float(m), 4) for m in maps.roles.mass[layer, head]]})
    return {
        "version": __version__,
        "model": maps.model,
        "text": maps.text,
        "tokens": list(maps.tokens),
        "causal": maps.causal,
        "layers": maps.layers,
        "heads": maps.heads,
        "weights": {"shape": list(maps.weights.shape), "float32": float32_base64(maps.weights)},
        "kinds": list(maps.roles.kinds),
        "colours": ROLE_COLOURS,
        "roles": roles,
        "steps": steps_data(),
    }


def heads_page(maps: HeadMaps) -> str:
    """The page: a grid of every head (click one for its token x token map), and the ten steps.

    Args:
        maps: from ``head_maps``.

    Returns:
        One HTML document with no ``http://`` or ``https://`` in it; it opens from ``file://``.

    Example:
        >>> from headwise.viz import head_maps
        >>> html = heads_page(head_maps())                       # the packaged MiniLM
        >>> html.count('<script type="application/json" id="headwise-data">')
        1
    """
    parts = {"css": _asset("page.css"), "js": _asset("page.js"), "data": script_json(page_data(maps))}
    return _SLOT.sub(lambda m: parts[m.group(1)], _asset("page.html"))


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")
