"""Run a function on 2 gloo ranks spawned from pytest and bring each rank's result back.

``spawn(fn, world)`` starts ``world`` processes (torch.multiprocessing, spawn method), each
joining one gloo process group over localhost with a bounded timeout, so that a mismatched
collective fails the test in minutes instead of hanging. The bound (300 s) is far above a rank's
honest wait: on a loaded 2-core machine one rank can wait a minute for the other to import torch
or finish its forward pass, and a 60 s bound failed such runs. ``fn(rank, world)`` returns a
picklable dict; an exception in one piece is recorded as its traceback (``"error"``) so
the other pieces still report.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[[int, int], dict], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        result = fn(rank, world)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # The result is on disk: leave without running C++ static destructors, where gloo's and the
    # TCP store's threads can race at exit ("terminate called without an active exception", SIGABRT)
    # once the group is destroyed, failing a run whose every check had passed.
    os._exit(0)


def spawn(fn: Callable[[int, int], dict], world: int = 2) -> list[dict]:
    """fn(rank, world) on ``world`` gloo ranks -> [rank 0's dict, rank 1's dict, ...]."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, free_port(), fn, out), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def pieces(rank: int, world: int, checks: dict[str, Callable[[int, int], object]]) -> dict:
    """Run each named check on this rank; a failure becomes {"error": traceback} for that name only."""
    out = {}
    for name, check in checks.items():
        try:
            out[name] = check(rank, world)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out
