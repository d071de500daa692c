"""The grading process: ``python -m headwise.grade.worker TARGET ROOT [CLASS ...]``.

Started by ``runner`` in a scratch directory (the learner's code runs there, not in the
caller's folder). ROOT is the caller's directory, where a module path is looked up. Results
leave over an anonymous pipe whose descriptor comes in ``HEADWISE_GRADE_FD`` (removed from the
environment before the learner's code runs, and not inherited by processes it starts); every
line carries a token read from stdin (closed before the learner's code runs), so the parent
can tell the grader's lines from anything else written there. Nothing is written to a file.

Events, one JSON object a line: ``{"ready": true}``, ``{"found": [names]}``,
``{"started": name}``, ``{"result": {...}}``, ``{"problem": "..."}`` and last ``{"done": true}``.
The learner's own prints go to stdout, which the parent ignores. When the parent stops a
class that runs too long it first sends ``SIGUSR1``, answered with ``{"stopped": {"line": ...,
"code": ...}}``: the line of the learner's code that was running (when Python code was running).
"""

from __future__ import annotations

import inspect
import json
import linecache
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

from .check import grade_class
from .learner import SetupError, find_classes, is_theirs, load, place, where

FD_VARIABLE = "HEADWISE_GRADE_FD"
RUNNING: dict[str, str | None] = {"file": None}  # the learner's file whose code runs now (notebook cells are always theirs)


def run(target: str, root: str, names: list[str], emit: Callable[[dict], None]) -> None:
    """Load ``target``, grade its classes (``names``, or those named like the book's), ``emit`` each event."""
    RUNNING["file"] = _file(target)
    emit({"ready": True})  # our own imports are done: the learner's time starts
    try:
        module = load(target, root)
        classes = find_classes(module, names or None)
    except SetupError as e:
        return emit({"problem": str(e)})
    except BaseException as e:  # their import raised, even SystemExit
        return emit({"problem": f"importing {target} raised: {where(e, _file(target))}"})
    emit({"found": [n for n, _ in classes]})
    for name, cls in classes:
        RUNNING["file"] = _source_file(cls, module)
        emit({"started": name})
        emit({"result": grade_class(cls, name, RUNNING["file"]).to_dict()})
    emit({"done": True})


def _running(frame: FrameType | None, file: str | None) -> dict:
    """The innermost frame of the learner's code on the stack: ``{"line": "hang.py:14", "code": "..."}`` (empty if none)."""
    while frame is not None and not is_theirs(frame.f_code.co_filename, file):
        frame = frame.f_back
    if frame is None:
        return {}
    return {"line": place(frame.f_code.co_filename, frame.f_lineno), "code": linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()}


def main(argv: list[str]) -> None:
    target, root, *names = argv
    fd = int(os.environ.pop(FD_VARIABLE))
    token = sys.stdin.readline().strip()
    _detach_stdin()
    os.set_inheritable(fd, False)  # a process the learner starts does not get the pipe

    def emit(event: dict) -> None:
        data = f"{token} {json.dumps(event)}\n".encode()
        while data:  # a write a signal interrupts returns having written only part
            data = data[os.write(fd, data) :]

    signal.signal(signal.SIGUSR1, lambda _signum, frame: emit({"stopped": _running(frame, RUNNING["file"])}))
    run(target, root, names, emit)


def _detach_stdin() -> None:
    """The learner's code reads an empty stdin, not what the parent sent."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 (open as long as the process lives)


def _source_file(cls: type, module: object) -> str | None:
    """The file the class was written in (its errors are shown at a line of it); None for notebook cells."""
    try:
        found = inspect.getsourcefile(cls)
    except (TypeError, OSError):
        found = getattr(module, "__file__", None)
    return _file(found) if found else None


def _file(target: str) -> str | None:
    return target if target.endswith(".py") else None


if __name__ == "__main__":
    main(sys.argv[1:])
