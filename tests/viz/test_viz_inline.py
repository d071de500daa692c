"""``headwise.viz.heads``: the heads page inline in a notebook, as a sandboxed ``<iframe srcdoc>``.

(tests/viz/test_viz_browser.py renders it in chromium inside such a frame.)
"""

from __future__ import annotations

import html
import json

import pytest
from html_check import find, network_references, parse

from headwise.viz import HeadsView, heads, heads_page


@pytest.fixture(scope="module")
def view(minilm_maps) -> HeadsView:
    return HeadsView(minilm_maps)


def test_the_frame_holds_the_very_page_heads_page_writes(view, minilm_maps):
    p = parse(view._repr_html_())
    (frame,) = find(p, "iframe")
    assert frame["sandbox"] == "allow-scripts"  # scripts run in the frame, with no access to the notebook
    assert frame["srcdoc"] == heads_page(minilm_maps) == view.page
    assert [t for t, _ in p.elements] == ["iframe"]


def test_the_page_inside_parses_and_carries_every_head(view, minilm_maps):
    page = parse(view.page)
    assert len(find(page, "script", id="headwise-data", type="application/json")) == 1
    data = json.loads(view.page.split('id="headwise-data">')[1].split("</script>")[0])
    assert len(data["roles"]) == minilm_maps.layers * minilm_maps.heads == 72 and data["tokens"] == list(minilm_maps.tokens)
    assert find(page, "div", id="grid") and find(page, "button", data_view="steps")
    assert network_references(view.page, page) == [] and network_references(view._repr_html_(), parse(view._repr_html_())) == []
    assert "6 layers x 12 heads on 9 tokens" in repr(view)


def test_a_sentence_that_looks_like_markup_stays_text(tmp_path, minilm_dir):  # heads() reads the packaged MiniLM
    view = heads('</iframe><script>alert(1)</script> "quoted" & more')
    out = view._repr_html_()
    p = parse(out)
    assert [t for t, _ in p.elements] == ["iframe"]  # the sentence did not end the frame
    assert find(p, "iframe")[0]["srcdoc"] == view.page
    assert "<script>alert(1)" not in html.unescape(out).split('id="headwise-data">')[1].split("</script>")[0]
    assert view.save(tmp_path / "page.html").read_text(encoding="utf-8") == view.page


def test_bad_arguments_say_what_was_expected(minilm_maps):
    with pytest.raises(ValueError, match=r"height must be an int >= 200, got 50"):
        HeadsView(minilm_maps, height=50)
    with pytest.raises(TypeError, match=r"maps must be a HeadMaps \(from headwise.viz.head_maps\), got str"):
        HeadsView("maps")
    with pytest.raises(ValueError, match=r"text must hold at least one word, got ' '"):
        heads(" ")
