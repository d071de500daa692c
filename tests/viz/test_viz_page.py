"""heads_page: one self-contained file; its data read back equals the weights, the roles and the ten steps."""

from __future__ import annotations

import json
import re

import pytest
import torch

from headwise.explain import explain
from headwise.viz import head_maps, heads_page, page_data
from headwise.viz.encode import base64_float32, float32_base64, script_json

DATA = re.compile(r'<script type="application/json" id="headwise-data">(.*?)</script>', re.S)


def read_data(html: str) -> dict:
    """The page's data, parsed as the browser parses it."""
    found = DATA.findall(html)
    assert len(found) == 1
    return json.loads(found[0])


def test_float32_base64_round_trip_keeps_minus_infinity():
    t = torch.randn(3, 4, 5)
    t[0, 1, :2] = float("-inf")
    back = base64_float32(float32_base64(t[:, 1]), (3, 5))  # a non-contiguous slice
    assert torch.equal(back, t[:, 1])
    assert float32_base64(torch.tensor([1.0])) == "AACAPw=="  # little-endian IEEE 754: 00 00 80 3f


def test_script_json_cannot_close_the_script_or_name_a_url():
    text = json.dumps({"t": "</script><b>x</b> see https://example.org"})
    safe = script_json(json.loads(text))
    assert "<" not in safe and "/" not in safe.replace("\\/", "")
    assert json.loads(safe) == json.loads(text)


def test_one_self_contained_file_under_2_mb(minilm_maps):
    html = heads_page(minilm_maps)
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert len(html.encode("utf-8")) < 2_000_000
    assert "/*{{" not in html  # every slot filled
    lowered = html.lower()
    for network in ("http://", "https://", "//cdn", "src=", "href=", "@import", "url(", "fetch(", "xmlhttprequest", "websocket"):
        assert network not in lowered, network
    assert html.count("<script") == 2 and html.count("<style>") == 1  # the data and the code, inline


def test_page_data_is_the_weights_and_roles(minilm_maps, minilm_dir):
    data = read_data(heads_page(minilm_maps))
    m = minilm_maps
    assert data["model"] == "all-MiniLM-L6-v2" and data["tokens"] == list(m.tokens) and data["text"] == m.text
    assert (data["layers"], data["heads"]) == (6, 12) and data["weights"]["shape"] == [6, 12, 9, 9]
    weights = base64_float32(data["weights"]["float32"], data["weights"]["shape"])
    assert torch.equal(weights, m.weights)  # exact: float32 travels as float32
    # ... and those are the model's attention weights, recomputed here from the observed queries and keys
    from headwise import attention_weights, observe
    from headwise.models import SentenceEncoder

    encoder = SentenceEncoder.from_pretrained(minilm_dir)
    ids, real = encoder.tokenize([m.text])
    seen: dict[str, list[torch.Tensor]] = {"queries": [], "keys": []}
    with observe(lambda name, t: seen[name].append(t) if name in seen else None), torch.no_grad():
        encoder.model(ids, real)
    for layer, (q, k) in enumerate(zip(seen["queries"], seen["keys"], strict=True)):
        q = q.view(1, 9, 12, 32).transpose(1, 2)  # (1, H, T, D)
        k = k.view(1, 9, 12, 32).transpose(1, 2)  # (1, H, T, D)
        assert torch.equal(weights[layer], attention_weights(q, k)[0])
    assert len(data["roles"]) == 72
    for i, r in enumerate(data["roles"]):
        role, share = m.role(*divmod(i, 12))
        assert r["role"] == role and r["share"] == pytest.approx(share, abs=5e-5)
        assert r["mass"] == pytest.approx(m.roles.mass[divmod(i, 12)].tolist(), abs=5e-5)
    assert set(data["colours"]) == {r["role"] for r in data["roles"]} | {"self"}


def test_the_ten_steps_are_explains_tensors(minilm_maps):
    steps = read_data(heads_page(minilm_maps))["steps"]
    _, reference = explain(d_in=3, d_out=2, num_heads=2, num_tokens=6, batch_size=1, seed=123)
    assert steps["tokens"] == ["Your", "journey", "starts", "with", "one", "step"]
    assert [s["number"] for s in steps["steps"]] == list(range(1, 11))
    assert steps["facts"] == {"d_out": 2, "num_heads": 2, "head_dim": 1}
    for got, want in zip(steps["steps"], reference, strict=True):
        assert (got["title"], got["code"]) == (want.title, want.code)
        assert [t["name"] for t in got["tensors"]] == list(want.tensors)
        for t in got["tensors"]:
            assert len(t["axes"]) == len(t["shape"])
            assert torch.equal(base64_float32(t["float32"], t["shape"]), want.tensors[t["name"]])
    masked = next(t for s in steps["steps"] for t in s["tensors"] if t["name"] == "masked_scores")
    scores = base64_float32(masked["float32"], masked["shape"])  # (1, 2, 6, 6)
    assert torch.isinf(scores).sum() == 2 * 15 and torch.isneginf(scores.triu(1)[scores.triu(1) != 0]).all()
    book_first_row = [0.3190, 0.4858]  # the book's MultiHeadAttention output, first row
    output = next(t for t in steps["steps"][-1]["tensors"] if t["name"] == "output")
    assert base64_float32(output["float32"], output["shape"])[0, 0].tolist() == pytest.approx(book_first_row, abs=5e-5)


def test_step_8_variants_are_explains_tensors_and_do_what_they_say(minilm_maps):
    steps = read_data(heads_page(minilm_maps))["steps"]
    assert [v["name"] for v in steps["variants"]] == ["softcap", "sinks", "alibi", "documents"]
    kwargs = {"softcap": {"softcap": 0.1}, "sinks": {"sinks": True}, "alibi": {"alibi": True}, "documents": {"documents": [3, 3]}}
    shown = {}
    for v in steps["variants"]:
        want = explain(d_in=3, d_out=2, num_heads=2, num_tokens=6, batch_size=1, seed=123, **kwargs[v["name"]]).steps[7]
        assert (v["title"], v["code"]) == (want.title, want.code) and v["about"]
        assert [t["name"] for t in v["tensors"]] == list(want.tensors)
        shown[v["name"]] = {t["name"]: base64_float32(t["float32"], t["shape"]) for t in v["tensors"]}
        for t in v["tensors"]:
            assert len(t["axes"]) == len(t["shape"])
            assert torch.equal(shown[v["name"]][t["name"]], want.tensors[t["name"]])
    plain = explain(d_in=3, d_out=2, num_heads=2, num_tokens=6, batch_size=1, seed=123).steps[6].tensors["scores"].double()  # head_dim 1
    # each term, recomputed here from the plain scores
    torch.testing.assert_close(shown["softcap"]["capped_scores"].double(), 0.1 * torch.tanh(plain / 0.1), atol=1e-6, rtol=0)
    distance = (torch.arange(6)[:, None] - torch.arange(6)).abs().double()  # (T, T)
    slopes = torch.tensor([2.0**-4, 2.0**-8]).double()  # 2^(-8i/H), H = 2
    torch.testing.assert_close(shown["alibi"]["alibi_bias"][0].double(), -slopes[:, None, None] * distance, atol=1e-7, rtol=0)
    hidden = torch.isneginf(shown["documents"]["masked_scores"][0])  # (H, T, T)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    other_document = (torch.arange(6)[:, None] // 3) != (torch.arange(6) // 3)
    assert torch.equal(hidden, (future | other_document).expand(2, 6, 6))
    share, weights = shown["sinks"]["sink_share"][0], shown["sinks"]["weights"][0]  # (H, T), (H, T, T)
    assert ((share > 0.05) & (share < 0.95)).all()
    torch.testing.assert_close(share + weights.sum(-1), torch.ones(2, 6), atol=1e-6, rtol=0)


def test_hostile_text_stays_text(gpt2_dir):
    text = "the </script> cat <b>sat</b> https://example.org"
    html = heads_page(head_maps(gpt2_dir, text))
    assert "https://" not in html and "</script> cat" not in html
    assert read_data(html)["text"] == text


def test_a_gpt2_page(gpt2_dir):
    m = head_maps(gpt2_dir, "your journey starts with one step .")
    data = read_data(heads_page(m))
    assert data["causal"] is True and data["weights"]["shape"] == [2, 4, 7, 7]
    assert torch.equal(base64_float32(data["weights"]["float32"], [2, 4, 7, 7]), m.weights)


def test_page_data_wants_head_maps():
    with pytest.raises(TypeError, match=r"maps must be a HeadMaps \(from headwise.viz.head_maps\), got dict"):
        page_data({})
    with pytest.raises(TypeError, match=r"maps must be a HeadMaps"):
        heads_page("heads.html")
