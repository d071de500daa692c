"""The heads page in a real headless chromium: it renders without errors, offline, and responds.

Each test opens the page from file:// in a fresh tab of one browser (see ``browser.py``).
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from browser import Browser, chromium_path

from headwise.viz import heads_page

if chromium_path() is None:
    _MISSING = "no chromium on PATH: `apt-get install chromium` to run the heads page in a real browser (.ci/run installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(_MISSING, pytrace=False)  # CI must run these tests
    pytest.skip(_MISSING, allow_module_level=True)

ARROWS = {"ArrowLeft": 37, "ArrowUp": 38, "ArrowRight": 39, "ArrowDown": 40}


@pytest.fixture(scope="module")
def browser():
    """One headless chromium for these tests."""
    b = Browser(chromium_path())
    yield b
    b.close()


@pytest.fixture(scope="module")
def page_file(minilm_maps, tmp_path_factory):
    path = tmp_path_factory.mktemp("page") / "heads.html"
    path.write_text(heads_page(minilm_maps), encoding="utf-8")
    return path


@pytest.fixture
def tab(browser, page_file):
    tab = browser.open(page_file.as_uri())
    yield tab
    tab.close()


def test_renders_every_head_with_no_console_error_and_no_request(tab, page_file):
    assert tab.js("document.querySelectorAll('[data-head]').length") == 6 * 12
    heads = tab.js("Array.from(document.querySelectorAll('#grid [data-head]'), e => e.dataset.head)")
    assert heads == [f"{layer}.{head}" for layer in range(6) for head in range(12)]
    assert tab.js("document.querySelectorAll('#grid canvas').length") == 72
    assert tab.js("document.querySelector('#detail').dataset.shown") == "0.0"
    assert tab.js("Array.from(document.querySelectorAll('#ylabels span'), e => e.textContent)")[:3] == ["[CLS]", "your", "journey"]
    assert tab.js("document.querySelectorAll('#xlabels span').length") == 9
    assert tab.requests() == [page_file.as_uri()]  # the page itself, nothing else
    assert tab.console_errors() == []


def test_the_weights_the_page_decodes_are_the_models(tab, minilm_maps):
    for layer, head in [(0, 0), (1, 8), (5, 11)]:
        shown = torch.tensor(tab.js(f"headwise.weights({layer}, {head})"), dtype=torch.float32).view(9, 9)
        assert torch.equal(shown, minilm_maps.weights[layer, head])


def test_click_a_head_then_move_with_the_arrows(tab, minilm_maps):
    tab.click('[data-head="1.8"]')
    assert tab.js("document.querySelector('#detail').dataset.shown") == "1.8"
    assert tab.js("document.querySelector('[data-head=\"1.8\"]').getAttribute('aria-pressed')") == "true"
    role, share = minilm_maps.role(1, 8)
    assert tab.js("document.querySelector('#detail-title').textContent") == f"Layer 1, head 8: {role} ({share:.2f} of the weight)"
    detail = tab.js("Array.from(document.querySelector('#detail-canvas').getContext('2d').getImageData(0, 0, 9, 9).data)")
    small = tab.js("Array.from(document.querySelector('[data-head=\"1.8\"] canvas').getContext('2d').getImageData(0, 0, 9, 9).data)")
    assert detail == small  # the detail draws that head's map
    for key, expected in [("ArrowRight", "1.9"), ("ArrowDown", "2.9"), ("ArrowLeft", "2.8"), ("ArrowUp", "1.8")]:
        tab.key(key, ARROWS[key])
        assert tab.js("document.querySelector('#detail').dataset.shown") == expected
    tab.click('[data-head="0.0"]')
    tab.key("ArrowUp", ARROWS["ArrowUp"])  # stays inside the grid
    assert tab.js("headwise.current()") == [0, 0]
    assert tab.console_errors() == []


def test_hover_reads_the_weight_and_highlights_the_row(tab, minilm_maps):
    tab.click('[data-head="0.2"]')
    x, y = tab.js("(() => { const r = document.querySelector('#detail-canvas').getBoundingClientRect(); "
                  "const s = r.width / 9; return [r.left + 1.5 * s, r.top + 3.5 * s]; })()")  # query 3, key 1
    tab.hover(x, y)
    assert tab.js("document.querySelector('#rowmark').style.display") == "block"
    assert tab.js("document.querySelector('#ylabels span.hot').textContent") == "starts"
    assert tab.js("document.querySelector('#xlabels span.hot').textContent") == "your"
    value = float(tab.js("document.querySelector('#detail-value').dataset.value"))
    assert value == pytest.approx(float(minilm_maps.weights[0, 2, 3, 1]), abs=1e-7)
    assert f"{value:.4f}" in tab.js("document.querySelector('#detail-value').textContent")


def test_the_ten_steps_view(tab):
    tab.click('nav [data-view="steps"]')
    assert tab.js("document.querySelector('#heads-view').hidden") is True
    assert tab.js("Array.from(document.querySelectorAll('#steps .step'), e => +e.dataset.step)") == list(range(1, 11))
    assert tab.js("document.querySelectorAll('#steps [data-tensor=\"masked_scores\"] td.neginf').length") == 2 * 15
    assert tab.js("document.querySelector('#steps [data-tensor=\"weights\"] td').textContent") == "1.0000"  # "Your" sees only itself
    variants = "#variants [data-variant]"
    assert tab.js(f"Array.from(document.querySelectorAll('{variants}'), e => e.dataset.variant)") == ["softcap", "sinks", "alibi", "documents"]
    documents = "[data-variant=\"documents\"] [data-tensor=\"masked_scores\"] td.neginf"
    assert tab.js(f"document.querySelectorAll('{documents}').length") == 2 * (15 + 9)  # the future, and the other document
    first = float(tab.js("document.querySelector('[data-variant=\"sinks\"] [data-tensor=\"weights\"] td').dataset.value"))
    assert 0.05 < first < 0.95  # "Your" still sees only itself, but the sink took a share
    assert tab.js("document.querySelectorAll('[data-variant=\"sinks\"] [data-tensor=\"sink_share\"] td').length") == 2 * 6
    tab.key("ArrowRight", ARROWS["ArrowRight"])  # the arrows belong to the heads view
    assert tab.js("headwise.current()") == [0, 0]
    assert tab.console_errors() == []


def test_screenshot_is_not_blank(tab, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    png = tab.screenshot()
    (tmp_path / "heads.png").write_bytes(png)
    image = plt.imread(io.BytesIO(png))[..., :3]  # (height, width, 3) in [0, 1]
    assert image.shape[:2] == (900, 1600)
    inked = (image.mean(-1) < 0.9).mean()  # share of pixels that are not (near) white
    assert 0.05 < inked < 0.9
    assert image[..., 2].mean() - image[..., 0].mean() > 0.005  # the blue maps are there


def test_the_inline_view_renders_inside_a_sandboxed_iframe(browser, minilm_maps, tmp_path):
    from headwise.viz import HeadsView

    host = tmp_path / "notebook.html"  # a stand-in for a notebook's output area
    host.write_text(f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>notebook</title></head>'
                    f'<body><p>Out[1]:</p>{HeadsView(minilm_maps)._repr_html_()}</body></html>', encoding="utf-8")
    tab = browser.open(host.as_uri())
    try:
        (frame,) = tab.frames()
        assert frame.js("document.querySelectorAll('#grid [data-head]').length") == 6 * 12
        assert frame.js("document.querySelector('#detail').dataset.shown") == "0.0"
        assert frame.js("document.querySelectorAll('#grid canvas').length") == 72
        assert frame.js("performance.getEntriesByType('resource').length") == 0  # the frame fetched nothing
        assert tab.js("document.querySelectorAll('[data-head]').length") == 0  # nothing leaked into the notebook
        assert tab.requests() == [host.as_uri()]
        assert frame.console_errors() == [] and tab.console_errors() == []
    finally:
        tab.close()
