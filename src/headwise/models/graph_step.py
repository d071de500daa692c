"""``generate(..., cuda_graph=True)``: the decode step captured once as a CUDA graph, then replayed.

On a GPU a decode step is bound by the host: a few milliseconds of Python and kernel launches
around a fraction of a millisecond of work (docs/performance/index.md, "GPUs"). A CUDA graph
records the step's kernels once and replays them with one launch. What a replay cannot do is
change a shape or read a value on the host, so the captured step is the unchecked eager step
(``decode_step(model, False, False)``) over ``SlotCache`` views of the caches: it writes the new
token at a slot held in a device tensor and reads the whole buffer under a mask of the slots
written, the same context as attention over the written keys. Before each replay the host copies
in the step's ids, positions and token count (three small copies on the device); after it, the
logits are copied out of the graph's own output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..cache import KVCache
from ..cache.slot import SlotCache


def capture(step: Callable[..., Tensor], *args: object) -> tuple[Callable[[], None], Tensor]:
    """Run ``step(*args)`` once on a side stream (lazy initialisation stays out of the graph), then record
    it as a CUDA graph: returns ``(replay, output)``, where each ``replay()`` refills ``output``."""
    with torch.cuda.device(args[0].device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step(*args)
    return graph.replay, output


class GraphStep:
    """``generate``'s step, (ids (B, 1), position_ids (B, 1) or None, caches) -> (B, vocab) logits, captured
    at its first call (the caches' tokens so far counted then) and replayed at every later one.

    ``step`` is the unchecked eager step to capture, e.g. ``decode_step(model, False, False)``; every call
    must pass the same caches, each holding one more token than at the call before (``generate``'s loop).
    """

    capture = staticmethod(capture)  # how the step is recorded (a class attribute: tests stand another in)

    def __init__(self, step: Callable[[Tensor, Tensor | None, Sequence[KVCache]], Tensor]) -> None:
        self.step = step
        self.replay: Callable[[], None] | None = None

    def __call__(self, ids: Tensor, position_ids: Tensor | None, caches: Sequence[KVCache]) -> Tensor:
        if self.replay is None:
            self.count = torch.zeros(1, dtype=torch.long, device=ids.device)  # (1,) the new token's index in the caches
            self.ids, self.positions = torch.empty_like(ids), torch.empty_like(ids)  # (B, 1) each
            self.tokens = len(caches[0])  # every cache holds the same tokens (a ring keeps counting)
        self.count.fill_(self.tokens)
        self.ids.copy_(ids)
        if position_ids is None:
            self.positions.fill_(self.tokens)  # no padding: the position is the tokens before it
        else:
            self.positions.copy_(position_ids)
        if self.replay is None:
            # kept on self: the graph reads their tensors at the addresses it was captured with; freed, their
            # memory would be handed to the next tensor made and the replays would read that
            self.views = [SlotCache(cache, self.count) for cache in caches]
            self.replay, self.logits = self.capture(self.step, self.ids, self.positions, self.views)  # (B, vocab)
        self.replay()
        self.tokens += 1
        return self.logits.clone()  # (B, vocab): the graph's output is overwritten by the next replay
