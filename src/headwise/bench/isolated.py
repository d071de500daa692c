"""An engine in a process of its own, so that no engine's runtime can slow another's turns.

Loaded into one process, the engines share more than the cores: their thread pools and allocators
stay alive between their turns, and one engine's turns ran markedly slower with the others loaded
beside it (docs/performance/decode.md has the numbers). ``Isolated(name, ...)`` loads ``ENGINES[name]``
in a spawned child and runs it there; the caller times each call as it would time a local runner
(a call crosses one pipe each way: ids in, tokens out).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from multiprocessing.connection import Connection
from pathlib import Path

from torch import Tensor


def _serve(conn: Connection, name: str, directory: str, precision: str, threads: int) -> None:
    """The child: load the engine, then run every (ids, new tokens) that comes until None does."""
    import torch

    from .engines import ENGINES

    torch.set_num_threads(threads)
    try:
        run = ENGINES[name].load(Path(directory), precision, threads)
    except Exception as e:  # the parent reports it in the engine's row
        conn.send(("failed", e))
        return
    conn.send(("ready", None))
    while (message := conn.recv()) is not None:
        ids, new = message
        try:
            conn.send(("ok", run(ids, new)))
        except Exception as e:
            conn.send(("failed", e))


class Isolated:
    """``ENGINES[name].load(directory, precision, threads)`` in a child process; calling it runs the engine there.

    Raises (at construction) what the engine's load raised in the child; ``close`` ends the child.
    """

    def __init__(self, name: str, directory: Path, precision: str, threads: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the parent's runtimes
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, name, str(directory), precision, threads), daemon=True)
        self.process.start()
        child.close()
        status, error = self._receive()
        if status != "ready":
            self.close()
            raise error

    def _receive(self) -> tuple[str, object]:
        try:
            return self._conn.recv()
        except EOFError:  # the child died without a word (a crash in an engine's native code)
            return "failed", RuntimeError(f"the engine's process ended (exit code {self.process.exitcode})")

    def __call__(self, ids: Tensor, new: int) -> Tensor:
        """(B, T) ids -> (B, new) generated ids, computed in the child."""
        self._conn.send((ids, new))
        status, out = self._receive()
        if status != "ok":
            raise out
        return out

    def close(self) -> None:
        """End the child (it frees what the engine held)."""
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):  # a child that died already
                self._conn.send(None)
            self.process.join(timeout=10)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join()
        self._conn.close()
