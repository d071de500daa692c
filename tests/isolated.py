"""Run Python code in a child process: a call that may crash the interpreter (SIGSEGV, SIGFPE) fails the test, not the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence


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


_EACH_CASE = """
import json, os, signal, sys
setup, cases = json.loads(sys.stdin.read())
scope = {}
exec(setup, scope)
answers = []
for case in cases:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            answer = str(eval(case, scope))
        except Exception as e:
            answer = f"error: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    status = os.waitpid(pid, 0)[1]
    answers.append(f"crash: {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else b"".join(chunks).decode())
print(json.dumps(answers))
"""


def run_cases(setup: str, cases: Sequence[str], *, timeout: float = 300) -> list[str]:
    """Each expression of ``cases``, evaluated in a process of its own forked from one child that ran ``setup``.

    Returns, per case, ``str`` of its value, ``"error: <type>: <message>"`` or ``"crash: <signal>"``.
    ``setup`` should keep torch on one thread (``torch.set_num_threads(1)``): a fork copies no thread pool.
    """
    if not hasattr(os, "fork"):
        raise NotImplementedError("run_cases needs os.fork")
    done = subprocess.run([sys.executable, "-c", _EACH_CASE], input=json.dumps([textwrap.dedent(setup), list(cases)]),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(f"the child process exited with {done.returncode}\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
