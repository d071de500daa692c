"""The grading process: ``python -m headwise.grade.worker TARGET OUT [CLASS ...]``.

Loads the learner's file, then writes one JSON line per event to OUT (flushed at once, so
the parent keeps what was done before a hang): ``{"ready": true}``, ``{"found": [names]}``, ``{"started": name}``,
``{"result": {...}}``, or ``{"problem": "..."}``. The learner's own prints go to stdout,
which the parent ignores.
"""

from __future__ import annotations

import json
import sys
from typing import IO

from .check import grade_class
from .learner import SetupError, find_classes, load, where


def main(argv: list[str]) -> None:
    target, out_path, *names = argv
    with open(out_path, "a", encoding="utf-8") as out:
        _write(out, {"ready": True})  # our own imports are done: the learner's time starts
        try:
            module = load(target)
            classes = find_classes(module, names or None)
        except SetupError as e:
            return _write(out, {"problem": str(e)})
        except BaseException as e:  # their import raised, even SystemExit
            return _write(out, {"problem": f"importing {target} raised: {where(e, _file(target))}"})
        _write(out, {"found": [n for n, _ in classes]})
        file = getattr(module, "__file__", None)
        for name, cls in classes:
            _write(out, {"started": name})
            _write(out, {"result": grade_class(cls, name, file).to_dict()})


def _file(target: str) -> str | None:
    return target if target.endswith(".py") else None


def _write(out: IO[str], event: dict) -> None:
    out.write(json.dumps(event) + "\n")
    out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
