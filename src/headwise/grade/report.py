"""What grading found, as data: one ``Result`` per class, one ``Report`` per file, and their text and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


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
        error: for ``step == "error"``: where in the learner's file, and the exception.
        configs: how many configurations were tried.
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

    def to_dict(self) -> dict:
        """The JSON object of one result; the class name goes under ``"class"``."""
        data = asdict(self)
        return {"class": data.pop("name"), **data}


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

    def to_text(self) -> str:
        """A short report a learner can read: PASS, or the step, expected vs got, and the hint."""
        lines = [f"headwise grade {self.file}"]
        if self.problem is not None:
            return "\n".join([*lines, f"  nothing graded: {self.problem}"])
        for r in self.results:
            lines.append("")
            if r.passed:
                lines.append(f"{r.name}: PASS (same output as the book's {r.kind} in all {r.configs} configurations)")
                continue
            lines.append(f"{r.name}: FAIL at step `{r.step}`")
            for label, value in (("checked with", r.config), ("error", r.error), ("expected", r.expected), ("got", r.got), ("hint", r.hint)):
                if value is not None:
                    lines.append(f"  {label + ':':13} {value}")
        failed = sum(not r.passed for r in self.results)
        lines += ["", f"{len(self.results) - failed} of {len(self.results)} classes passed."]
        return "\n".join(lines)
