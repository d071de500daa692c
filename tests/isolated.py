"""Run Python code in a child process: a call that may crash the interpreter (SIGSEGV, SIGFPE) fails the test, not the run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap


def run_isolated(code: str, *, timeout: float = 300) -> object:
    """Run ``code`` in a fresh interpreter and return the JSON it prints on its last line.

    Raises:
        AssertionError: the child died of a signal or exited non-zero (its stderr in the message).
    """
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)
    if done.returncode < 0:
        raise AssertionError(f"the child process died of {signal.Signals(-done.returncode).name}\n{done.stderr[-2000:]}")
    if done.returncode != 0:
        raise AssertionError(f"the child process exited with {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
