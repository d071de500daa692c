"""See the heads: every attention head of a real model on one sentence, as one offline HTML page or a PNG.

- ``head_maps``: the data, (L, H, T, T) weights and each head's role, from a model directory.
- ``heads_page``: that data (and the ten steps of ``headwise explain``) as one self-contained
  HTML string: inline CSS, JavaScript and data, no network reference.
- ``heads_figure``: the same grid as a matplotlib figure.
- ``heads``: the page shown inline in a notebook (an ``<iframe srcdoc>``).
"""

from .inline import HeadsView, heads
from .maps import DEFAULT_TEXT, ROLE_COLOURS, HeadMaps, head_maps
from .page import heads_page, page_data
from .png import clearest_head, heads_figure

__all__ = ["DEFAULT_TEXT", "ROLE_COLOURS", "HeadMaps", "HeadsView", "clearest_head", "head_maps", "heads", "heads_figure", "heads_page", "page_data"]
