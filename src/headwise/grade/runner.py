"""Grade a learner's file in a separate process under a time limit.

Their code may loop forever, print, write files, call ``sys.exit`` or ``os._exit``, or crash
the interpreter: none of that reaches the caller. It runs in a scratch directory that is
removed afterwards, so it cannot write into the caller's folder. The results come back over an
anonymous pipe, never a file, each line carrying a token the learner's code is not given: a
line without it means something else wrote there, and nothing from that run is trusted.

The time limit applies to importing their file and to each class; when a class hangs, the
process is asked where it is (``SIGUSR1``: the line of their code that was running), then
killed; that class is reported as stopped at that line, and a fresh process grades the classes
still left. When nothing could be graded, the report always says why.

This isolates mistakes, not an adversary: code written to subvert the grader from inside its
own process (reading its memory, patching its functions) is out of scope.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import headwise

from .reference import BOOK_CLASSES
from .report import Report, Result
from .worker import FD_VARIABLE

STARTUP_S = 300.0  # starting Python and importing torch on a busy machine: not the learner's time
ASK_S = 2.0  # how long a process that ran out of time has to say which line it was running


def grade_file(target: str, classes: list[str] | None, timeout: float, label: str | None = None) -> Report:
    """Run ``headwise.grade.worker`` on ``target`` until every class has a result (or the file cannot load).

    ``label`` names the report (default ``target``).
    """
    report = Report(label or target)
    path = Path(target)
    if path.suffix in (".py", ".ipynb") or path.exists():
        target = str(path.resolve())  # the worker runs elsewhere
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
            at = next((e["stopped"] for e in events if "stopped" in e), {})
            report.results.append(Result(started[0], kind, False, "error", error=note, line=at.get("line"), code=at.get("code")))
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
    token = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONPATH=_python_path(), **{FD_VARIABLE: str(write_fd)})
    with tempfile.TemporaryDirectory(prefix="headwise-grade-") as scratch, tempfile.TemporaryFile("w+", encoding="utf-8") as err:
        cmd = [sys.executable, "-m", "headwise.grade.worker", target, str(Path.cwd()), *classes]
        try:  # stderr goes to a file, not a pipe: a chatty learner cannot fill it and stall
            proc = subprocess.Popen(cmd, cwd=scratch, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                                    env=env, pass_fds=(write_fd,), text=True)
        finally:
            os.close(write_fd)  # the child holds the only write end: end of file when it exits
        with os.fdopen(read_fd, "rb") as pipe:
            try:
                proc.stdin.write(token + "\n")
                proc.stdin.close()
            except BrokenPipeError:  # it ended before reading: _how_it_ended says how
                pass
            lines, stopped, note = _collect(proc, pipe, timeout)
        if not note and not stopped:
            err.seek(0)
            note = _how_it_ended(proc.returncode, lines, token, err.read())
    events = [json.loads(line.removeprefix(token + " ")) for line in lines if line.startswith(token + " ")]
    if len(events) != len(lines):
        return [], "something other than the grader wrote into the grader's results (does the code write to file descriptors it did not open?); nothing from that run is trusted"
    if stopped:
        note = _stopped(timeout, events)
    return events, note


def _stopped(timeout: float, events: list[dict]) -> str:
    """Why a process was stopped; while importing, with the line it was running (a class shows it as its own)."""
    doing = ""
    if not any("found" in e for e in events):
        at = next((e["stopped"] for e in events if e.get("stopped")), None)
        doing = " while importing the file" + (f", at {at['line']} (`{at['code']}`)" if at else "")
    return f"stopped after {timeout:g} s{doing}: an endless loop, or far too slow"


def _collect(proc: subprocess.Popen, pipe, timeout: float) -> tuple[list[str], bool, str]:
    """Read complete lines from the pipe until the worker closes it, or stop it when it is silent too long
    (after asking it, with ``SIGUSR1``, which line it is running: one more line, or ``ASK_S`` seconds).
    Returns the lines, whether it was stopped, and a note when it went on after closing the pipe."""
    buffer, lines, note = b"", [], ""
    deadline, asked = time.monotonic() + STARTUP_S, False
    while True:
        ready, _, _ = select.select([pipe], [], [], 0.05)
        if not ready and proc.poll() is not None:
            break  # the worker exited and the pipe is drained (a process it forked may still hold the pipe)
        if ready:
            chunk = os.read(pipe.fileno(), 1 << 16)
            if not chunk:
                break  # the worker exited (and nothing it started holds the pipe)
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            if complete:
                lines += [c.decode("utf-8", errors="replace") for c in complete]
                deadline = time.monotonic() + timeout
                if asked:
                    break
        if time.monotonic() > deadline and asked:
            break
        if time.monotonic() > deadline:
            proc.send_signal(signal.SIGUSR1)
            deadline, asked = time.monotonic() + ASK_S, True
    if proc.poll() is None and not asked:  # closed the pipe but still running: give it a moment
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            note = "the grader's results were closed while the process went on running"
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    return lines, asked, note


def _how_it_ended(returncode: int, lines: list[str], token: str, stderr: str) -> str:
    """Empty when the worker finished; else what it was doing when it ended, and why."""
    events = [json.loads(line.removeprefix(token + " ")) for line in lines if line.startswith(token + " ")]
    if any("done" in e or "problem" in e for e in events):
        return "" if returncode == 0 else f"the grading process ended with exit code {returncode}: {_tail(stderr)}"
    started = [e["started"] for e in events if "started" in e]
    doing = f" while grading {started[-1]}" if started else " while importing the file" if events else " while starting"
    if returncode < 0:
        how = f"was killed by {signal.Signals(-returncode).name}" if -returncode in signal.valid_signals() else f"was killed by signal {-returncode}"
        return f"the grading process {how}{doing}: {_tail(stderr)}"
    message = _tail(stderr)
    why = message if message != "(no message)" else "the code called os._exit() (or something ended the interpreter) and printed no error"
    return f"the grading process ended with exit code {returncode}{doing}: {why}"


def _python_path() -> str:
    """This headwise first, then what the caller can import (their directory included), so a class
    from one of their modules imports there too."""
    src = str(Path(headwise.__file__).resolve().parents[1])
    here = [str(Path(p or ".").resolve()) for p in sys.path]
    return os.pathsep.join(dict.fromkeys(p for p in (src, *here) if Path(p).is_dir()))


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"
