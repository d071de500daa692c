"""heads_figure: the grid as a picture, titled, with a role legend and one head in detail."""

from __future__ import annotations

import numpy as np
import pytest

from headwise.viz import ROLE_COLOURS, clearest_head, heads_figure

plt = pytest.importorskip("matplotlib.pyplot")  # only to read the PNG back


def test_grid_title_legend_and_detail(minilm_maps, tmp_path):
    fig = heads_figure(minilm_maps)
    images = [ax for ax in fig.get_axes() if ax.get_images()]
    assert len(images) == 6 * 12 + 1  # every head, and the detail
    assert "all-MiniLM-L6-v2" in fig._suptitle.get_text() and minilm_maps.text in fig._suptitle.get_text()
    assert clearest_head(minilm_maps) == (0, 2)  # the previous-token head: previous is preferred, and it is the only one
    detail = images[-1]
    assert detail.get_title() == "layer 0, head 2: previous (0.86)"
    assert [t.get_text() for t in detail.get_xticklabels()] == list(minilm_maps.tokens)
    assert [t.get_text() for t in detail.get_yticklabels()] == list(minilm_maps.tokens)
    assert (images[2].get_images()[0].get_array() == minilm_maps.weights[0, 2].numpy()).all()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [label.split(" (")[0] for label in legend] == list(ROLE_COLOURS)
    assert legend[0] == "previous (1)"
    fig.savefig(tmp_path / "heads.png", dpi=60)
    image = plt.imread(tmp_path / "heads.png")[..., :3]
    assert (image.mean(-1) < 0.9).mean() > 0.05  # not blank


def test_chosen_head_and_bad_heads(minilm_maps):
    fig = heads_figure(minilm_maps, head=(1, 8))
    assert fig.get_axes()[-2].get_title() == "layer 1, head 8: next (0.57)"  # the last is the colour bar
    for bad in [(6, 0), (0, -1)]:
        with pytest.raises(ValueError, match=r"head must be a \(layer, head\) tuple of ints with 0 <= layer < 6 and 0 <= head < 12, got"):
            heads_figure(minilm_maps, head=bad)
    for bad in [[0, 0], (0,), (0, True), (0, 1.0)]:  # (a bool is no head's index)
        with pytest.raises(TypeError, match=r"head must be a \(layer, head\) tuple of ints with 0 <= layer < 6"):
            heads_figure(minilm_maps, head=bad)
    assert heads_figure(minilm_maps, head=(np.int64(1), np.int64(8))).get_axes()[-2].get_title() == "layer 1, head 8: next (0.57)"
    with pytest.raises(TypeError, match=r"maps must be a HeadMaps"):
        heads_figure(None)


def test_the_sentence_and_its_tokens_are_drawn_as_typed_not_as_math():
    # matplotlib reads "$...$" as math: "$5 or $6" lost its dollars, and an unbalanced "$\frac{" failed at savefig
    import io

    from headwise.viz import head_maps

    fig = heads_figure(head_maps(text=r"a $\frac{1}{$ b costs $5"))
    assert not any(t.get_parse_math() for t in (fig._suptitle, *fig.axes[-2].get_xticklabels()))
    fig.savefig(io.BytesIO(), format="png", dpi=40)
