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
        {"num_tokens": 3, "batch_size": 2},
        {"d_in": 5, "d_out": 6, "num_heads": 3, "num_tokens": 4, "seed": 7},
        {"d_in": 3, "d_out": 4, "num_heads": 2, "num_tokens": 8},  # more than the book's 6 tokens: random input
        {"causal": False, "num_tokens": 5},
    ],
    ids=["book", "book-prefix-batch", "wider", "random-input", "bidirectional"],
)
def test_every_step_holds_the_real_intermediate(kw):
    mha, steps = explain(**kw)
    assert [s.number for s in steps] == list(range(1, 11))
    x = steps[0].tensors["x"]
    d_in, T, B = kw.get("d_in", 3), kw.get("num_tokens", 6), kw.get("batch_size", 1)
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
    assert shapes["queries.view"] == (1, 6, 2, 1) and shapes["queries.transpose"] == (1, 2, 6, 1)
    assert shapes["scores"] == shapes["weights"] == (1, 2, 6, 6)


def test_the_defaults_are_the_books_example():
    """explain() builds the book's MultiHeadAttention(3, 2, 6, 0.0, num_heads=2) under seed 123 on its
    six tokens: step 10's output is the context vectors the book prints (section 3.6.2)."""
    book = [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593], [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]  # the book's print
    mha, steps = explain()
    assert (mha.d_in, mha.d_out, mha.num_heads, mha.head_dim) == (3, 2, 2, 1)
    assert torch.equal(steps[0].tensors["x"][0], BOOK_INPUTS)
    torch.testing.assert_close(steps[9].tensors["output"][0], torch.tensor(book), atol=5e-5, rtol=0)


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
    tables = {a["data-tensor"]: a["data-shape"] for a in find(p, None, data_tensor=None)}
    want = {name: str(list(t.shape)) for s in result.steps for name, t in s.tensors.items() if name != "weights"}
    assert tables == want
    heat = find(p, "table", **{"class": "hw-t hw-heat"})
    assert [a["data-shape"] for a in heat] == ["[6, 6]", "[6, 6]"]  # the weights of each head, batch 0
    weights = result.steps[7].tensors["weights"][0]  # (H, T, T)
    cells = [a["title"] for a in find(p, "td", title=None)]
    assert cells[0] == f"Your → Your: {float(weights[0, 0, 0]):.4f}" and cells[6 * 6 + 7] == f"journey → journey: {float(weights[1, 1, 1]):.4f}"
    assert network_references(out, p) == []
    assert out.count('class="hw-neginf"') == 2 * 15  # the masked future of both heads, shown as -∞


def _tables(html: str, name: str) -> dict[str, list[list[str]]]:
    """The small tables of tensor ``name`` in an explain display: caption -> rows of cell texts."""
    from html.parser import HTMLParser

    class Reader(HTMLParser):
        def __init__(self):
            super().__init__()
            self.depth, self.inside, self.tables, self.field = 0, False, {}, None

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if a.get("data-tensor") == name:
                self.inside, self.depth = True, 0
            if not self.inside:
                return
            self.depth += tag == "div"
            if tag == "table":
                self.caption, self.rows = "", []
            elif tag in ("caption", "td"):
                self.field = tag
                if tag == "td":
                    self.rows[-1].append("")
            elif tag == "tr":
                self.rows.append([])

        def handle_endtag(self, tag):
            if not self.inside:
                return
            self.field = None if tag in ("caption", "td") else self.field
            if tag == "table":
                self.tables[self.caption] = self.rows
                self.inside = self.inside and self.depth > 0  # a lone table ends the tensor
            elif tag == "div":
                self.depth -= 1
                self.inside = self.depth > 0

        def handle_data(self, data):
            if self.field == "caption":
                self.caption += data
            elif self.field == "td":
                self.rows[-1][-1] += data

    r = Reader()
    r.feed(html)
    return r.tables


def _cells(m: torch.Tensor) -> list[list[str]]:
    return [["-∞" if v == -math.inf else f"{v:.4f}" for v in row] for row in m.tolist()]


def test_the_html_shows_every_head_and_every_token_of_4d_tensors():
    """Small multiples: a (b, num_heads, ...) tensor gets one table per head, a (b, num_tokens, num_heads,
    head_dim) view one per token, each holding that matrix's numbers."""
    result = explain(d_out=4, num_heads=2)
    out = result._repr_html_()
    seen = {name: t for s in result.steps for name, t in s.tensors.items()}
    heads = _tables(out, "queries.transpose")
    assert list(heads) == ["head 0", "head 1"]
    for h in range(2):
        assert heads[f"head {h}"] == _cells(seen["queries.transpose"][0, h])  # (T, D) of head h
    tokens = _tables(out, "keys.view")
    assert list(tokens) == ["Your", "journey", "starts", "with", "one", "step"]
    assert tokens["with"] == _cells(seen["keys.view"][0, 3])  # (H, D) of the token "with"
    masked = _tables(out, "masked_scores")
    assert masked["head 1"] == _cells(seen["masked_scores"][0, 1])
    (whole,) = _tables(out, "x").values()  # a batch of one: one table
    assert whole == _cells(seen["x"][0])


def test_a_batch_shows_every_row_and_too_many_matrices_are_counted():
    from headwise._html import tensor_table

    result = explain(num_tokens=4, batch_size=2)
    out = result._repr_html_()
    assert list(_tables(out, "scores")) == ["b=0, head 0", "b=0, head 1", "b=1, head 0", "b=1, head 1"]
    assert out.count('class="hw-t hw-heat"') == 4  # weights: every batch row and head
    big = tensor_table("t", torch.zeros(3, 5, 2, 2), panels=12)
    assert big.count("<table") == 12 and "… 3 more" in big


def test_the_text_shows_every_head_side_by_side():
    from headwise.explain import step_text

    result = explain(d_out=4, num_heads=2)
    step = result.steps[5]  # the transposes: (1, 2, 6, 2)
    text = step_text(step, result.tokens())
    lines = text.splitlines()
    assert lines[:2] == [f"## Step 6: {step.title}", f"   {step.code}"]
    at = lines.index("-- queries.transpose: shape (1, 2, 6, 2) = (b, num_heads, num_tokens, head_dim): one (num_tokens, head_dim) block per head")
    assert lines[at + 1].split() == ["head", "0", "head", "1"]
    q = step.tensors["queries.transpose"][0]  # (H, T, D)
    for t in range(6):
        want = [f"{v:.4f}" for v in torch.cat([q[0, t], q[1, t]]).tolist()]  # head 0's row t, then head 1's
        assert lines[at + 2 + t].split() == want
    book = explain()
    view = step_text(book.steps[4], book.tokens()).splitlines()  # (1, 6, 2, 1): one (H, D) block per token
    assert view[3].split() == ["Your", "journey", "starts", "with", "one", "step"]
    assert "-inf" in result.to_text() and "nan" not in result.to_text()


def test_tensor_text_wraps_cuts_and_counts():
    from headwise._text import tensor_text

    t = torch.arange(2 * 3 * 30 * 20, dtype=torch.float64).view(2, 3, 30, 20) / 1000
    text = tensor_text(t, rows=4, cols=3, panels=5, width=90)  # blocks 27 wide: three to a band
    lines = text.splitlines()
    assert lines[0].split() == ["[0,", "0,", ":,", ":]", "[0,", "1,", ":,", ":]", "[0,", "2,", ":,", ":]"]
    assert lines[1].split() == ["0.0000", "0.0010", "0.0020", "...", "0.6000", "0.6010", "0.6020", "...", "1.2000", "1.2010", "1.2020", "..."]
    assert lines[2].split()[:3] == ["0.0200", "0.0210", "0.0220"]  # row 1 of t[0, 0]
    assert lines[5].split() == ["...", "...", "..."] and all(len(line) <= 90 for line in lines)
    assert lines[6].startswith("[1, 0, :, :]")  # the next band of blocks
    assert lines[-1] == "... 1 more of shape (30, 20) not shown"
    assert tensor_text(torch.tensor([1.0, -math.inf, math.nan])) == "1.0000   -inf    nan"  # one width per block


def test_nonfinite_names_the_first_bad_tensor_and_allows_the_mask():
    from headwise.explain import Step, nonfinite

    _, steps = explain()
    assert nonfinite(steps) is None  # masked_scores' -inf is the mask
    bad = torch.tensor([[0.0, math.nan], [math.inf, 1.0]])
    assert nonfinite([Step(3, "t", "c", {"ok": torch.ones(2)}), Step(4, "t", "c", {"w": bad})]) == "step 4's w holds NaN and inf (2 of 4 values)"
    assert nonfinite([Step(9, "t", "c", {"weights": torch.tensor([-math.inf])})]) == "step 9's weights holds inf (1 of 1 values)"


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"batch_size": 0}, ValueError, r"batch_size must be a positive int, got 0"),
    ({"batch_size": 2.0}, TypeError, r"batch_size must be a positive int, got 2\.0"),
    ({"seed": 1.5}, TypeError, r"seed must be an int in \[0, 18446744073709551615\], got 1\.5"),
    ({"documents": [3.5, 2.5]}, TypeError, r"documents must be a list of ints \(each document's length\), got \[3\.5, 2\.5\]"),
    ({"num_tokens": 0}, ValueError, r"num_tokens must be a positive int, got 0"),  # (not the module's context_length)
    ({"num_tokens": True}, TypeError, r"num_tokens must be a positive int, got True"),
    ({"num_heads": 0}, ValueError, r"num_heads must be a positive int, got 0"),
    ({"d_in": 2.0}, TypeError, r"d_in must be a positive int, got 2\.0"),
    ({"num_tokens": 10**6, "d_in": 1, "d_out": 1, "num_heads": 1}, ValueError,  # (4 TB of scores: refused before any is made)
     r"explain prints every tensor: these sizes make one of 1,000,000,000,000 numbers \(more than 16,777,216\); take fewer num_tokens"),
])
def test_explains_arguments_are_checked_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):  # torch's own errors (or an IndexError in to_text for batch_size=0) before
        explain(**kwargs)


@pytest.mark.parametrize("terms", [
    {"alibi": True}, {"documents": [2, 4]}, {"sinks": True}, {"softcap": 1.0}, {"softcap": 0.5, "causal": False},
    {"softcap": 1.0, "sinks": True, "alibi": True, "documents": [2, 4]}, {"alibi": True, "sinks": True, "causal": False},
])
def test_step_8_code_combines_its_tensors_into_its_weights(terms):
    """Step 8's code line, read with the tensors the step shows (the masked scores, or the capped ones; ALiBi's bias;
    the module's sinks), gives the weights it shows: the line names the terms in the order the walk applied them."""
    mha, steps = explain(d_out=4, num_tokens=6, **terms)
    shown, code = {**steps[6].tensors, **steps[7].tensors}, steps[7].code
    logits = shown["masked_scores"] if "masked_fill" in code else shown["capped_scores"] if "tanh" in code else shown["scores"]
    if "tanh" not in code:
        assert f"{'.masked_fill(mask, -inf)' if 'masked_fill' in code else 'scores'} / head_dim**0.5" in code
        logits = logits / mha.head_dim**0.5
    if "slope" in code:
        logits = logits + shown["alibi_bias"]
    if "sink" in code:
        sink = mha.sinks.detach()[None, :, None, None].expand(*logits.shape[:3], 1)  # (B, H, T, 1)
        weights = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(logits, -1)
    torch.testing.assert_close(weights, shown["weights"], atol=1e-6, rtol=0)
