"""The report as a notebook shows it (``_repr_html_``) and as text (``repr``)."""

from __future__ import annotations

import json

from html_check import find, network_references, parse
from test_grade_check import grade_here

from headwise.grade.report import Report, Result


def test_each_class_shows_its_verdict_the_steps_it_matched_and_the_hint():
    results = {"CausalAttention": grade_here("book")["CausalAttention"], "MultiHeadAttention": grade_here("no_scaling")["MultiHeadAttention"]}
    report = Report("my_attention.py", [results["MultiHeadAttention"], results["CausalAttention"]])
    out = report._repr_html_()
    p = parse(out)
    assert find(p, "div", data_exit_code="1")
    assert len(find(p, "section", data_class="MultiHeadAttention", data_verdict="fail")) == 1
    assert len(find(p, "section", data_class="CausalAttention", data_verdict="pass")) == 1
    steps = {a["data-step"]: a["data-status"] for a in find(p, "li", data_step=None)}
    assert steps == results["MultiHeadAttention"].steps
    assert list(steps)[:3] == ["queries", "keys", "values"] and steps["queries"] == "match" and steps["weights"] == "missing"
    assert [a["data-step"] for a in find(p, "li", data_first=None)] == ["weights"]  # where it failed
    text = "".join(p.text)
    assert "FAIL" in text and "PASS" in text and "1 of 2 classes passed." in text
    assert results["MultiHeadAttention"].hint in text and results["MultiHeadAttention"].expected in text
    assert network_references(out, p) == []
    assert repr(report) == report.to_text()


def test_nothing_graded_shows_why_and_text_from_the_learner_stays_text():
    report = Report("<b>cell</b>", problem="importing x raised: x.py:1: <script>alert(1)</script>  NameError")
    p = parse(report._repr_html_())
    assert len(find(p, "p", data_verdict="nothing")) == 1
    assert find(p, "script") == [] and find(p, "b") == []
    assert "nothing graded: importing x raised: x.py:1: <script>alert(1)</script>  NameError" in "".join(p.text)
    assert find(p, "div", data_exit_code="2")


def test_the_steps_travel_in_the_json():
    r = Result("MultiHeadAttention", "MultiHeadAttention", False, "weights", steps={"queries": "match", "weights": "missing"})
    data = json.loads(Report("x.py", [r]).to_json())["results"][0]
    assert data["steps"] == {"queries": "match", "weights": "missing"}
    assert Result(**{"name" if k == "class" else k: v for k, v in data.items()}) == r


def test_code_that_raised_is_shown_at_its_line_not_at_a_step_named_error():
    r = grade_here("crash")["MultiHeadAttention"]
    p = parse(Report("crash.py", [r])._repr_html_())
    text = "".join(p.text)
    assert "MultiHeadAttention FAIL at crash.py:31" in text and "at step" not in text
    assert "codeattn_scores = queries @ self.keys.transpose(2, 3)" in text and "errorAttributeError: " in text


def test_the_text_report_shows_control_characters_as_escapes():
    """A learner's line or message with an escape sequence (a file of bytes, an ANSI colour) is shown, not acted on by
    the terminal: ``\\x1b`` in place of ESC, ``\\x07`` of the bell; the report's own lines keep their newlines."""
    line = "\x1b[2J\x1b[31mhello \x07 world"
    text = Report("esc\x1b.py", problem=f"importing esc.py raised: esc.py:1: {line}  SyntaxError: invalid non-printable character U+001B").to_text()
    assert text == ("headwise grade esc\\x1b.py\n  nothing graded: importing esc.py raised: esc.py:1: \\x1b[2J\\x1b[31mhello \\x07 world  "
                    "SyntaxError: invalid non-printable character U+001B")
    r = Result("MultiHeadAttention", "MultiHeadAttention", False, "error", error="ValueError: \x1b]0;title\x07 \u202eevil", code="x = 1\t# y")
    text = Report("x.py", [r]).to_text()
    assert all(c == "\n" or c.isprintable() for c in text)
    assert "ValueError: \\x1b]0;title\\x07 \\u202eevil" in text and "x = 1\\t# y" in text
