"""Grade a learner's file in a separate process under a time limit.

Their code may loop forever, print, call ``sys.exit`` or crash the interpreter: none of that
reaches the caller. When a class hangs, the process is killed, that class is reported as
stopped, and a fresh process grades the classes still left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import headwise

from .report import Report, Result


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
            report.results.append(Result(started[0], "unknown", False, "error", error=note))
        if not left or not started:
            report.results.sort(key=lambda r: order.index(r.name))
            return report


def _run(target: str, classes: list[str], timeout: float) -> tuple[list[dict], str]:
    """One worker process: its events, and a note saying how it ended if it did not end well."""
    env = dict(os.environ)
    src = str(Path(headwise.__file__).resolve().parents[1])  # the worker imports this same headwise
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "events.jsonl")
        out.touch()
        cmd = [sys.executable, "-m", "headwise.grade.worker", target, str(out), *classes]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
            note = "" if proc.returncode == 0 else f"the grading process ended with exit code {proc.returncode}: {_tail(proc.stderr)}"
        except subprocess.TimeoutExpired:
            note = f"stopped after {timeout:g} s: an endless loop, or far too slow"
        events = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines() if line.strip()]
    return events, note


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"
