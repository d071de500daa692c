"""explain(): Steps 1-10 hold the module's own intermediates, checked by recomputing each one
here from the module's weights (plain tensor algebra, no headwise call)."""

from __future__ import annotations

import math

import pytest
import torch

import headwise as hw
from headwise.explain import BOOK_INPUTS, book_batch, explain


def _recompute(mha: hw.MultiHeadAttention, x: torch.Tensor, causal: bool) -> dict[str, torch.Tensor]:
    """The lecture's steps written out in float64 from the module's weights."""
    b, T, _ = x.shape
    H, D = mha.num_heads, mha.head_dim
    x = x.double()
    proj = {n: x @ getattr(mha, f"W_{n}").weight.detach().double().T for n in ("query", "key", "value")}
    view = {n: p.view(b, T, H, D) for n, p in proj.items()}
    heads = {n: v.transpose(1, 2) for n, v in view.items()}
    scores = heads["query"] @ heads["key"].transpose(2, 3)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    masked = scores.masked_fill(future, -math.inf) if causal else scores
    weights = torch.softmax(masked / math.sqrt(D), dim=-1)
    context = weights @ heads["value"]
    merged = context.transpose(1, 2).contiguous().view(b, T, H * D)
    output = merged @ mha.out_proj.weight.detach().double().T + mha.out_proj.bias.detach().double()
    return {
        "queries": proj["query"], "keys": proj["key"], "values": proj["value"],
        "queries.view": view["query"], "keys.view": view["key"], "values.view": view["value"],
        "queries.transpose": heads["query"], "keys.transpose": heads["key"], "values.transpose": heads["value"],
        "scores": scores, "masked_scores": masked, "weights": weights, "context": context,
        "context.transpose": context.transpose(1, 2), "merged": merged, "output": output,
    }


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"num_tokens": 6, "batch_size": 2},
        {"d_in": 5, "d_out": 6, "num_heads": 3, "num_tokens": 4, "seed": 7},
        {"d_in": 3, "d_out": 4, "num_heads": 2, "num_tokens": 8},  # more than the book's 6 tokens: random input
        {"causal": False, "num_tokens": 5},
    ],
    ids=["seed-001", "book-batch", "wider", "random-input", "bidirectional"],
)
def test_every_step_holds_the_real_intermediate(kw):
    mha, steps = explain(**kw)
    assert [s.number for s in steps] == list(range(1, 11))
    x = steps[0].tensors["x"]
    d_in, T, B = kw.get("d_in", 3), kw.get("num_tokens", 3), kw.get("batch_size", 1)
    assert x.shape == (B, T, d_in)
    if d_in == 3 and T <= 6:
        assert torch.equal(x[0], BOOK_INPUTS[:T])  # the book's embeddings
    causal = kw.get("causal", True)
    want = _recompute(mha, x, causal)
    seen = {name: t for s in steps for name, t in s.tensors.items()}
    expected_names = set(want) - ({"masked_scores"} if not causal else set())
    assert expected_names <= set(seen)
    for name in expected_names:
        torch.testing.assert_close(seen[name].double(), want[name], atol=1e-6, rtol=1e-5, msg=name)
    # step 3 shows the trainable weights themselves
    assert all(steps[2].tensors[n] is not None and torch.equal(steps[2].tensors[n], getattr(mha, n).weight) for n in ("W_query", "W_key", "W_value"))
    # step 10's output is what the module returns for that input: bit for bit with the math
    # backend (the one explain observes), to rounding with the default (sdpa)
    with torch.no_grad():
        torch.testing.assert_close(steps[9].tensors["output"], mha(x), atol=1e-6, rtol=1e-5)
        mha.backend = "math"
        assert torch.equal(steps[9].tensors["output"], mha(x))


def test_steps_are_filed_in_the_lecture_order():
    _, steps = explain()
    names = {s.number: list(s.tensors) for s in steps}
    assert names[1] == ["x"]
    assert names[4] == ["queries", "keys", "values"]
    assert names[7] == ["scores"]
    assert names[8] == ["masked_scores", "weights"]
    assert names[9] == ["context"]
    assert names[10] == ["context.transpose", "merged", "output"]
    shapes = {name: tuple(t.shape) for s in steps for name, t in s.tensors.items()}
    assert shapes["queries.view"] == (1, 3, 2, 1) and shapes["queries.transpose"] == (1, 2, 3, 1)
    assert shapes["scores"] == shapes["weights"] == (1, 2, 3, 3)


def test_explain_is_seeded_and_leaves_no_observer_behind():
    a, steps_a = explain(seed=5)
    b, steps_b = explain(seed=5)
    assert torch.equal(a.W_query.weight, b.W_query.weight)
    assert torch.equal(steps_a[9].tensors["output"], steps_b[9].tensors["output"])
    from headwise.observe import observing

    assert not observing()


def test_book_batch_is_the_books():
    batch = book_batch()
    assert batch.shape == (2, 6, 3) and torch.equal(batch[0], batch[1])
    torch.testing.assert_close(batch[0, 1], torch.tensor([0.55, 0.87, 0.66]))  # "journey"


# ----------------------------------------------------------------------------- displays


def test_the_result_unpacks_and_reads_as_text():
    result = explain(num_tokens=6)
    mha, steps = result
    assert result.module is mha and result.steps is steps
    text = repr(result)
    assert text.splitlines()[0] == "MultiHeadAttention: 10 steps"
    assert "Step 8. Mask the future, scale by sqrt(head_dim), softmax: masked_scores (1, 2, 6, 6), weights (1, 2, 6, 6)" in text
    assert result.tokens() == ["Your", "journey", "starts", "with", "one", "step"]
    assert explain(d_in=4, num_tokens=3).tokens() == ["#0", "#1", "#2"]  # random input: positions, not words


def test_the_html_shows_every_step_its_tensors_and_one_heatmap_per_head():
    from html_check import find, network_references, parse

    result = explain(num_tokens=6, d_out=4, num_heads=2)
    out = result._repr_html_()
    p = parse(out)
    assert [a["data-step"] for a in find(p, "div", data_step=None)] == [str(n) for n in range(1, 11)]
    tables = {a["data-tensor"]: a["data-shape"] for a in find(p, "table", data_tensor=None)}
    want = {name: str(list(t.shape)) for s in result.steps for name, t in s.tensors.items() if name != "weights"}
    assert tables == want
    heat = find(p, "table", **{"class": "hw-t hw-heat"})
    assert [a["data-shape"] for a in heat] == ["[6, 6]", "[6, 6]"]  # the weights of each head, batch 0
    weights = result.steps[7].tensors["weights"][0]  # (H, T, T)
    cells = [a["title"] for a in find(p, "td", title=None)]
    assert cells[0] == f"Your → Your: {float(weights[0, 0, 0]):.4f}" and cells[6 * 6 + 7] == f"journey → journey: {float(weights[1, 1, 1]):.4f}"
    assert network_references(out, p) == []
    masked = next(a for a in find(p, "table", data_tensor="masked_scores"))
    assert masked["data-shape"] == "[1, 2, 6, 6]" and out.count('class="hw-neginf"') == 15  # head 0's masked future, shown as -∞
