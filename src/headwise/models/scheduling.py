"""What each step of the ``Batcher`` feeds the model: its requests, their worst case in blocks, the schedule.

A step feeds every running request that is generating its last token, then prompt tokens, at most
``max_step_tokens`` of them in all: first the prompts being prefilled already (in the order they
joined), then waiting requests that join (in the order they came) while the pool has room for
their worst case. A prompt longer than what is left of the budget is cut there (anywhere, however
long: it is never refused for its length), and its rest continues in the next steps, each chunk
attending over the earlier ones through the paged cache. A request samples its first token in
the step that feeds its prompt's last token; until then a step gives it no token.

A request's worst case is the most blocks it can hold at once in each layer's pool: every token
it writes (its prompt and ``max_new_tokens - 1`` tokens: the last one is never fed back), or,
when every layer slides (``PagedKVCache.slide`` gives back the blocks before the window after
each step), the W - 1 keys before a step's first query, the step's own tokens (one, or a chunk
of at most ``max_step_tokens``) and one partly given-back block.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None
    temperature: float
    top_k: int | None
    generator: torch.Generator | None
    blocks: int  # the most blocks it may hold at once in each layer's pool (``worst_blocks``)
    tokens: list[int] = field(default_factory=list)
    fed: int = 0  # tokens whose keys the caches hold: prompt tokens, then its own tokens fed back

    @property
    def prefilling(self) -> bool:
        """Whether some of its prompt has not been fed yet."""
        return self.fed < len(self.prompt)

    def next_ids(self, n: int) -> list[int]:
        """The next ``n`` ids to feed: the rest of its prompt, or the last token it emitted."""
        return self.prompt[self.fed : self.fed + n] if self.prefilling else self.tokens[-1:]


@dataclass(frozen=True)
class Feed:
    """One request's part of a step: its next ``count`` tokens, at positions ``request.fed`` on."""

    request: Request
    count: int

    @property
    def emits(self) -> bool:
        """Whether the step gives this request a token (its prompt is then fed whole)."""
        return self.request.fed + self.count >= len(self.request.prompt)


def sliding_window(windows: Iterable[int | None]) -> int | None:
    """The largest of the layers' ``windows`` when every layer slides, else None (a layer sees every key)."""
    windows = list(windows)
    return None if not windows or any(w is None for w in windows) else max(windows)


def worst_blocks(prompt: int, max_new_tokens: int, *, block_size: int, max_step_tokens: int, window: int | None) -> int:
    """The most blocks of ``block_size`` a request of ``prompt`` + ``max_new_tokens`` tokens holds at once (see above)."""
    whole = math.ceil((prompt + max_new_tokens - 1) / block_size)
    if window is None:
        return whole
    chunk = min(prompt, max_step_tokens)  # the most tokens a step writes for it
    return min(whole, math.ceil((window - 1 + chunk + block_size - 1) / block_size))


def schedule(running: list[Request], waiting: Iterable[Request], *, max_step_tokens: int, num_blocks: int) -> tuple[list[Feed], int]:
    """This step's feeds, in packing order, and how many of the first waiting requests join with it.

    Admission never overcommits: a waiting request joins only while the worst cases of the running
    ones and of those joining fit ``num_blocks``, so no step runs out of blocks.
    """
    feeds = [Feed(r, 1) for r in running if not r.prefilling]
    budget = max_step_tokens
    for r in running:
        if r.prefilling and budget:
            n = min(len(r.prompt) - r.fed, budget)
            feeds.append(Feed(r, n))
            budget -= n
    reserved, joining = sum(r.blocks for r in running), 0  # blocks the running requests may reach
    for r in waiting:
        if not budget or reserved + r.blocks > num_blocks:
            break
        n = min(len(r.prompt), budget)
        feeds.append(Feed(r, n))
        budget -= n
        reserved += r.blocks
        joining += 1
    return feeds, joining
