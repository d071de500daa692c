"""Grade a learner's file in a separate process under a time limit.

Their code may loop forever, print, call ``sys.exit`` or crash the interpreter: none of that
reaches the caller. The time limit applies to importing their file and to each class; when
a class hangs, the process is killed, that class is reported as stopped, and a fresh
process grades the classes still left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import headwise

from .reference import BOOK_CLASSES
from .report import Report, Result

STARTUP_S = 300.0  # starting Python and importing torch on a busy machine: not the learner's time


def grade_file(target: str, classes: list[str] | None, timeout: float) -> Report:
    """Run ``headwise.grade.worker`` on ``target`` until every class has a result (or the file cannot load)."""
    report = Report(target)
    left, order = list(classes or []), None
    while True:
        events, note = _run(target, left, timeout)
        found = next((e["found"] for e in events if "found" in e), None)
        problem = next((e["problem"] for e in events if "problem" in e), None)
        if problem is not None or found is None:
            report.problem = problem or note
            return report
        order = order or found
        results = [Result(**{"name" if k == "class" else k: v for k, v in e["result"].items()}) for e in events if "result" in e]
        report.results += results
        done = {r.name for r in results}
        started = [e["started"] for e in events if "started" in e and e["started"] not in done]
        left = [n for n in found if n not in done and n not in started]
        if started:  # the one running when the process stopped
            kind = started[0] if started[0] in BOOK_CLASSES else "unknown"
            report.results.append(Result(started[0], kind, False, "error", error=note))
        if not left or not started:
            report.results.sort(key=lambda r: order.index(r.name))
            if not report.results:
                report.problem = note or "the grading process ended before grading any class"
            return report


def _run(target: str, classes: list[str], timeout: float) -> tuple[list[dict], str]:
    """One worker process: its events, and a note saying how it ended if it did not end well.

    The clock restarts at each event: the learner's import and each class get ``timeout``
    seconds; starting Python and torch gets ``STARTUP_S``.
    """
    env = dict(os.environ)
    src = str(Path(headwise.__file__).resolve().parents[1])  # the worker imports this same headwise
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "events.jsonl"), Path(tmp, "stderr.txt")
        out.touch()
        cmd = [sys.executable, "-m", "headwise.grade.worker", target, str(out), *classes]
        with err.open("w") as err_file:  # a file, not a pipe: a chatty learner cannot fill it and stall
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err_file, env=env)
        seen, deadline, note = 0, time.monotonic() + STARTUP_S, ""
        while proc.poll() is None:
            events = _events(out)
            if len(events) > seen:
                seen, deadline = len(events), time.monotonic() + timeout
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                doing = " while importing the file" if seen <= 1 else ""
                note = f"stopped after {timeout:g} s{doing}: an endless loop, or far too slow"
                break
            time.sleep(0.02)
        if not note and proc.returncode != 0:
            note = f"the grading process ended with exit code {proc.returncode}: {_tail(err.read_text(errors='replace'))}"
        return _events(out), note


def _events(path: Path) -> list[dict]:
    """The complete lines written so far (a line still being written is left for the next read)."""
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"
