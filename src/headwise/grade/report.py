"""What grading found, as data: one ``Result`` per class, one ``Report`` per file, and their text,
JSON and HTML (a ``Report`` shows itself as a table in a notebook)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .._html import block, escape


@dataclass
class Result:
    """The verdict on one learner class.

    Attributes:
        name: the class's name in the learner's file.
        kind: the book class it was graded against (``CausalAttention``, ``MultiHeadAttentionWrapper``
            or ``MultiHeadAttention``).
        passed: True when its output matched the book's in every configuration.
        step: None when passed; else the first reference step it never produced (``"queries"``,
            ``"weights"``, ``"heads.1.context"``, ``"output"``, ...) or ``"error"`` when it raised,
            hung or could not be set up.
        hint: the likely mistake, from the known-mistake tensors its numbers matched; None if none did.
        config: the construction call and input shape of the configuration that failed.
        expected: the book's tensor at ``step``: shape and one row of numbers.
        got: the learner's closest tensor: shape and the same row.
        error: for ``step == "error"``: the exception, or why it was stopped or could not be set up.
        configs: how many configurations were tried.
        steps: when it failed on numbers: each step of the book's forward in order, ``"match"`` (one of
            its tensors equals it), ``"skipped"`` (never formed, but a later step of its chain was) or
            ``"missing"``; None otherwise.
        line: for ``step == "error"``: the line of the learner's code that raised, or where a class that
            ran too long was stopped (``crash.py:31``, ``mine.ipynb, cell 4, line 2``, ``Cell In[5], line 3``);
            None when none of their code was running.
        code: the text of that line.
    """

    name: str
    kind: str
    passed: bool
    step: str | None = None
    hint: str | None = None
    config: str | None = None
    expected: str | None = None
    got: str | None = None
    error: str | None = None
    configs: int = 0
    steps: dict[str, str] | None = None
    line: str | None = None
    code: str | None = None

    def to_dict(self) -> dict:
        """The JSON object of one result; the class name goes under ``"class"``."""
        data = asdict(self)
        return {"class": data.pop("name"), **data}


def _printable(text: str) -> str:
    """``text`` with every character a terminal would act on (an escape sequence, a bell, a tab) written as its Python
    escape (``\\x1b``): a learner's code line, file name or message is shown, never run by the terminal."""
    return "".join(c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


@dataclass
class Report:
    """All results for one file (or class); ``problem`` says why nothing could be graded."""

    file: str
    results: list[Result] = field(default_factory=list)
    problem: str | None = None

    @property
    def exit_code(self) -> int:
        """0 when every graded class passed, 1 when one failed, 2 when nothing could be graded."""
        if self.problem is not None or not self.results:
            return 2
        return 0 if all(r.passed for r in self.results) else 1

    def to_json(self) -> str:
        """``{"file": ..., "results": [{"class": ..., "passed": ..., "step": ..., "hint": ...}], "problem": ...}``."""
        return json.dumps({"file": self.file, "results": [r.to_dict() for r in self.results], "problem": self.problem}, indent=2)

    def __repr__(self) -> str:
        return self.to_text()

    def to_text(self) -> str:
        """A short report a learner can read: PASS, or the step, expected vs got, and the hint."""
        lines = [f"headwise grade {self.file}"]
        if self.problem is not None:
            return _printable("\n".join([*lines, f"  nothing graded: {self.problem}"]))
        for r in self.results:
            lines.append("")
            if r.passed:
                lines.append(f"{r.name}: PASS (same output as the book's {r.kind} in all {r.configs} configurations, dropout in training only)")
                continue
            lines.append(f"{r.name}: FAIL {_where_it_failed(r)}")
            for label, value in (("checked with", r.config), ("code", r.code), ("error", r.error), ("expected", r.expected), ("got", r.got),
                                 ("hint", r.hint)):
                if value is not None:
                    lines.append(f"  {label + ':':13} {value}")
        failed = sum(not r.passed for r in self.results)
        lines += ["", f"{len(self.results) - failed} of {len(self.results)} classes passed."]
        return _printable("\n".join(lines))

    def _repr_html_(self) -> str:
        """The report as HTML for a notebook: each class with its verdict, the steps of the book's
        forward it matched, and where it failed, with the hint."""
        title = f"<h3>headwise grade <code>{escape(self.file)}</code></h3>"
        if self.problem is not None:
            body = f'<p class="hw-problem" data-verdict="nothing">nothing graded: {escape(self.problem)}</p>'
            return block("grade", title + body, exit_code=self.exit_code)
        passed = sum(r.passed for r in self.results)
        summary = f"<p>{passed} of {len(self.results)} classes passed.</p>"
        return block("grade", title + "".join(_result_html(r) for r in self.results) + summary, exit_code=self.exit_code)


def _result_html(r: Result) -> str:
    verdict = "pass" if r.passed else "fail"
    if r.passed:
        badge, note = "PASS", f"same output as the book's <code>{escape(r.kind)}</code> in all {r.configs} configurations, dropout in training only"
    else:
        badge, note = "FAIL", escape(_where_it_failed(r)).replace("`", "<code>", 1).replace("`", "</code>", 1)
    parts = [f'<h4>{escape(r.name)} <span class="hw-badge">{badge}</span> <span class="hw-note">{note}</span></h4>']
    if r.steps:
        items = "".join(
            f'<li data-step="{escape(name)}" data-status="{escape(status)}"{" data-first" if name == r.step else ""}>'
            f'{escape(name)} {"✓" if status == "match" else "·" if status == "skipped" else "✗"}</li>'
            for name, status in r.steps.items()
        )
        parts.append(f'<ol class="hw-steps" title="the book\'s steps: ✓ matched, · formed later in its chain, ✗ not found">{items}</ol>')
    rows = [(label, value) for label, value in (("checked with", r.config), ("code", r.code), ("error", r.error), ("expected", r.expected),
                                                ("got", r.got)) if value]
    if r.hint:
        rows.append(("hint", r.hint))
    if rows:
        dd = {label: '<dd class="hw-hint">' if label == "hint" else "<dd>" for label, _ in rows}
        parts.append("<dl>" + "".join(f"<dt>{label}</dt>{dd[label]}{escape(value)}</dd>" for label, value in rows) + "</dl>")
    return f'<section class="hw-class" data-class="{escape(r.name)}" data-verdict="{verdict}">{"".join(parts)}</section>'


def _where_it_failed(r: Result) -> str:
    """``at step `weights```; for code that raised or was stopped, its line (``at crash.py:31``) when it was theirs."""
    if r.step != "error":
        return f"at step `{r.step}`"
    return f"at {r.line}" if r.line else "with an error"
