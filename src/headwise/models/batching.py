"""Continuous batching: many generation requests through one model and one paged cache per layer.

``Batcher(model, num_blocks=...)`` takes requests (``submit``) at any time; each ``step`` runs
one forward pass over one row that packs the next token of every running request and at most
``max_step_tokens`` prompt tokens, a long prompt fed in chunks over several steps (ragged: no
padding to the longest; what a step feeds and who joins: ``scheduling.py``). A request that
emits its ``eos_token_id`` or reaches its ``max_new_tokens`` leaves at once and gives its blocks
back. ``stream()`` yields ``(request id, token)`` as tokens come; ``generate_many`` is the one-call form.

A decode step (one token a running request) runs as ``generate``'s steps do when nothing outside the model can see
or change a layer (``trusts``): unchecked and written out flat (``flat_step``), the same logits as the forward.

A step is all or nothing: it computes every token first, then commits them. A step that raises
(a changed model, a hook that fails, an interrupt) leaves every cache and request as they were
before it (the keys some layers wrote are taken back, the joining requests wait again, a prompt
being prefilled keeps its earlier chunks), so the next step carries on as if it had not run. A
request is always pending (waiting or running), finished, or cancelled (``cancel``): never lost. A
``cancel`` made while a step runs (from a hook, a callback) takes effect when the step ends.
Tokens a step computed reach ``stream()`` even when the loop over it stopped between two of them (or, first, the
next ``step()``): each token is handed over once, in order.

A request's tokens equal ``model.generate`` of its prompt alone (greedy; sampled with the same
seed): the sampling calls are the same, one generator per request, and the logits are those of
the sequence alone (each sequence attends over its own keys only), whatever the chunks, to the
last bits of float32 or float64; in narrower arithmetic (16-bit models or pools, int8 weights or
pools) a chunk's rounding can choose otherwise at a near-tie (docs/use/serving.md).

Admission never overcommits (``scheduling.worst_blocks``), so no step runs out of blocks and
nothing is evicted. A request's worst case is set aside as one run of consecutive blocks when
the pool has one (keys and values are then read in place, not gathered); blocks are taken as
tokens are written. When every layer slides (Mistral), each commit gives back the blocks wholly
before each sequence's window (``PagedKVCache.slide``): a request holds about W + block_size
tokens however long it generates.
"""

from __future__ import annotations

import itertools
import numbers
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch
from torch import Tensor

from .. import _checks
from ..cache import PagedKVCache
from ..linear import weight_cache
from ..linear.projection import planned_world
from ._inputs import SEED_HIGH, check_choice, check_request
from .flat_step import FlatStep, flat_parts
from .generate import CausalLM, Walk, greedy, next_token
from .scheduling import Feed, Request, schedule, sliding_window, worst_blocks


class PagedLM(CausalLM, Protocol):
    """What the ``Batcher`` needs from a model, beside ``CausalLM``."""

    def new_paged_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> list[PagedKVCache]: ...

    def attention_layers(self) -> list: ...


class Batcher:
    """A continuous-batching scheduler over one ``PagedKVCache`` per layer of ``model``.

    Args:
        model: a causal LM of ``headwise.models`` (GPT-2, the Llama family).
        num_blocks: blocks in each layer's pool; a request needs ceil((prompt + max_new_tokens - 1) / block_size)
            of them, or about (W + block_size + its first chunk) / block_size when every layer slides (window W).
        block_size: token slots per block.
        max_step_tokens: the prompt tokens a step may feed beside the running requests' next tokens; a
            longer prompt is admitted all the same and fed in chunks over several steps.
        cache_dtype: what the pools hold, as ``model.generate``'s: None = the model's dtype;
            ``torch.bfloat16`` for a float32 model (half the bytes a token keeps; a request's tokens then
            equal ``generate(..., cache_dtype=torch.bfloat16)``'s to bfloat16's rounding: a prompt fed in chunks
            attends in other kernels than one fed whole, so where two logits tie to that precision the greedy
            token can differ, as for a bfloat16 model: docs/use/serving.md), or ``torch.int8`` for a float32 or bfloat16
            model (8-bit rows, a little over a quarter of float32's bytes: ``generate(..., cache_dtype=torch.int8)``'s tokens
            where a prompt is fed whole; fed in chunks, its projections round otherwise, and a row rounded to 8 bits
            can make that a step of its scale, as a float16 model's chunks can: a near tie may go the other way).
        compile: where headwise's C++ decode kernel is not built, every layer attends the running
            requests' next tokens over a bfloat16 pool in one call compiled by ``torch.compile`` at the
            first steps (seconds, once per process and kind of layer; ``PagedKVCache.batch(...,
            compile=True)``), not in one call per request. Where the kernel is built, that one call runs
            in C++ either way.

    Example:
        >>> import headwise as hw
        >>> from headwise.models import GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(hw.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
        >>> batcher = Batcher(model, num_blocks=64)
        >>> a = batcher.submit(torch.tensor([5, 6, 7]), max_new_tokens=4)
        >>> b = batcher.submit(torch.tensor([8, 9]), max_new_tokens=2, temperature=0.8, seed=1)
        >>> [request for request, token in batcher.stream()]  # (request id, token) pairs as they come
        [0, 1, 0, 1, 0, 0]
    """

    def __init__(
        self, model: PagedLM, *, num_blocks: int, block_size: int = 16, max_step_tokens: int = 2048,
        cache_dtype: torch.dtype | None = None, compile: bool = False,
    ) -> None:
        num_blocks, block_size, max_step_tokens = (
            _checks.positive_int(name, value) for name, value in [("num_blocks", num_blocks), ("block_size", block_size), ("max_step_tokens", max_step_tokens)]
        )
        paged_model(model)
        self.model, self.block_size, self.max_step_tokens = model, block_size, max_step_tokens
        self.compile = _checks.boolean("compile", compile)
        self.caches = model.new_paged_caches(num_blocks, block_size, cache_dtype)
        self._computes = self._weight.dtype, self._weight.device  # what the caches were made for
        self.window = sliding_window(c.window for c in self.caches)  # when every layer's cache slides: blocks before each window go back
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # in the order they joined
        self._unread: deque[tuple[int, int]] = deque()  # tokens steps computed that stream() has not yielded yet
        self._next_id = 0
        self._stepping = False  # a step is running: a cancel waits for its end (``_cancelled``)
        self._cancelled: list[int] = []
        self._kept: tuple[tuple, FlatStep | None] = ((), None)  # the decode steps' flat step, and what it was made under (``_flat``)
        self._walk = Walk(model)  # each step: whether it may run unchecked, and whether a module or an attribute changed

    @property
    def _weight(self) -> Tensor:
        """A parameter of the model: the device and dtype it computes in now."""
        return next(self.model.parameters())

    @property
    def pending(self) -> int:
        """Requests not finished yet (running or waiting)."""
        return len(self._waiting) + len(self._running)

    @property
    def blocks_held(self) -> int:
        """Blocks the running requests hold in a layer's pool: the most any layer holds (a sliding layer's fewer)."""
        return max(c.num_blocks - c.free_blocks for c in self.caches)

    @property
    def tokens_held(self) -> int:
        """Tokens whose keys and values a layer's pool holds: the most any layer holds (a sliding layer's fewer)."""
        return max(sum(c.length(r.id) - c.first_held(r.id) for r in self._running) for c in self.caches)

    def submit(self, prompt: Tensor, max_new_tokens: int, *, eos_token_id: int | None = None, temperature: float = 0.0,
               top_k: int | None = None, seed: int | None = None) -> int:
        """Queue a request; returns its id (0, 1, 2, ... in order of submission).

        Args:
            prompt: (T,) token ids, T >= 1 (any length the model takes: a long one is fed in chunks).
            max_new_tokens, eos_token_id, temperature, top_k: as ``model.generate``.
            seed: the seed of this request's own ``torch.Generator`` (sampling only); None: one drawn from torch's
                global generator, so that ``torch.manual_seed`` makes a run repeat.
        """
        max_new_tokens, top_k, eos_token_id, seed = check_request(self.model, prompt, max_new_tokens, eos_token_id, temperature, top_k, seed)
        blocks = worst_blocks(len(prompt), max_new_tokens, block_size=self.block_size, max_step_tokens=self.max_step_tokens, window=self.window)
        if blocks > self.caches[0].num_blocks:
            raise ValueError(
                f"a request of {len(prompt)} + {max_new_tokens} tokens needs {blocks} blocks of {self.block_size}, "
                f"more than the pool's num_blocks={self.caches[0].num_blocks}"
            )
        generator = None
        if temperature > 0:
            generator = torch.Generator(self._weight.device)
            generator.manual_seed(seed if seed is not None else int(torch.randint(2**62, ())))
        request = Request(self._next_id, prompt.tolist(), max_new_tokens, eos_token_id, float(temperature), top_k, generator, blocks)
        self._waiting.append(request)
        self._next_id += 1
        return request.id

    def cancel(self, request: int) -> None:
        """Stop a pending request: it produces no more tokens (``stream()`` yields none of its unread ones) and its
        blocks go back (a prompt being prefilled's too). Called while a step runs (from a hook or a callback), it takes
        effect when the step ends, whether the step commits or is rolled back; the step's token for it is dropped.

        Raises:
            TypeError: ``request`` is not an int.
            ValueError: ``request`` is not pending (finished, cancelled already, or never submitted).
        """
        if isinstance(request, (bool, Tensor)) or not isinstance(request, numbers.Integral):  # (numpy's ints count: an id read from an array)
            raise TypeError(f"request must be a request id (an int from submit), got {type(request).__name__} {request!r}")
        request = int(request)
        waiting = [r for r in self._waiting if r.id == request]
        running = [r for r in self._running if r.id == request]
        if (not waiting and not running) or request in self._cancelled:
            pending = sorted(r.id for r in [*self._waiting, *self._running] if r.id not in self._cancelled)
            raise ValueError(f"request {request!r} is not pending (finished, cancelled or never submitted); pending: {pending}")
        if self._stepping:  # the step holds its requests: cancelled when it ends (``step``)
            self._cancelled.append(request)
            return
        if waiting:
            self._waiting.remove(waiting[0])
        else:
            self._running.remove(running[0])
            for cache in self.caches:
                cache.free(request)
        kept = [pair for pair in self._unread if pair[0] != request]
        self._unread.clear()  # in place, never a new deque: ``stream`` extends the one it holds, a cancel may come mid-step
        self._unread.extend(kept)

    def stream(self) -> Iterator[tuple[int, int]]:
        """Run steps until every request is finished, yielding ``(request id, token)`` as each token comes.

        Stopping the loop (``break``, ``close()``) loses nothing: the tokens of the last step
        not yielded yet come first from the next ``stream()``.
        """
        while self._unread or self.pending:
            if not self._unread:
                self._unread.extend(self.step())
            while self._unread:
                yield self._unread.popleft()  # taken out before it is handed over: a closed loop has it already

    @torch.no_grad()
    def step(self) -> list[tuple[int, int]]:
        """One forward pass: the running requests' next tokens and up to ``max_step_tokens`` prompt tokens, packed in one row.

        All or nothing: if anything raises, every cache and request is as it was before the step.

        Returns:
            ``(request id, token)`` for every request the step gives a token (a prompt fed only in
            part gets none yet), in packing order; empty when only prompt chunks ran. Tokens an earlier
            step computed that a stopped ``stream()`` did not yield come first: whichever of ``step``
            and ``stream`` is called, every token is handed over once, in the order computed.

        Raises:
            TypeError: the model's dtype or device changed since the ``Batcher`` made its caches.
            RuntimeError: a step is running already (``step`` called from a hook or callback inside one); nothing
                changes.
        """
        if self._stepping:
            raise RuntimeError("step() was called while a step is running (from a hook or callback inside it): a step "
                               "is not reentrant; submit() and cancel() may be called there, and take effect at the next step")
        self._stepping = True
        try:
            tokens = self._step()
        finally:
            self._stepping = False
            cancelled, self._cancelled = self._cancelled, []
            for request in cancelled:  # those cancelled while the step ran (still pending: it may have finished them)
                if any(r.id == request for r in [*self._waiting, *self._running]):
                    self.cancel(request)
        earlier = list(self._unread)  # a stopped stream's: before this step's
        self._unread.clear()  # (in place: ``stream`` extends the deque it holds)
        return [*earlier, *(pair for pair in tokens if pair[0] not in cancelled)]

    def _step(self) -> list[tuple[int, int]]:
        """``step``'s forward pass and commit (or roll back), its requests held as they are."""
        weight = self._weight
        if (weight.dtype, weight.device) != self._computes:
            raise TypeError(
                f"the model now computes in {weight.dtype} on {weight.device}, but this Batcher's caches were made for "
                f"{self._computes[0]} on {self._computes[1]}: make a new Batcher after changing the model's dtype or device"
            )
        weight_cache.verify()  # weights written through .data between steps: their kept copies made again
        feeds, joins = schedule(self._running, self._waiting, max_step_tokens=self.max_step_tokens, num_blocks=self.caches[0].num_blocks)
        if not feeds:
            return []
        joining = list(itertools.islice(self._waiting, joins))
        emitting = [f.request for f in feeds if f.emits]
        lengths = {r.id: self.caches[0].length(r.id) for r in self._running}
        states = [r.generator.get_state() if r.generator is not None else None for r in emitting]
        try:
            tokens = self._compute(feeds, joining, weight.device)
        except BaseException:
            self._roll_back(lengths, joining, emitting, states)
            raise
        for _ in joining:
            self._waiting.popleft()
        for f in feeds:
            f.request.fed += f.count
        self._running += joining
        for r, token in zip(emitting, tokens, strict=True):
            r.tokens.append(token)
            if len(r.tokens) == r.max_new_tokens or token == r.eos_token_id:
                self._running.remove(r)
                for cache in self.caches:
                    cache.free(r.id)
        if self.window is not None:  # committed: the keys no query to come sees go back
            for cache, r in itertools.product(self.caches, self._running):
                cache.slide(r.id)
        return [(r.id, token) for r, token in zip(emitting, tokens, strict=True)]

    def _compute(self, feeds: list[Feed], joining: list[Request], device: torch.device) -> list[int]:
        """The step's tokens: the joining requests' sequences opened, every layer's keys written, the logits sampled."""
        for r in joining:
            for cache in self.caches:
                cache.add(r.id, reserve=r.blocks * self.block_size)  # its worst case, as one run of blocks
        ids, positions, counts = [], [], []
        for f in feeds:  # each request's next tokens, at the positions after its cached ones
            ids.extend(f.request.next_ids(f.count))
            positions.extend(range(f.request.fed, f.request.fed + f.count))
            counts.append(f.count)
        ends = itertools.accumulate(counts)
        rows = torch.tensor([end - 1 for f, end in zip(feeds, ends, strict=True) if f.emits], dtype=torch.long, device=device)  # (N,)
        input_ids = torch.tensor([ids], device=device)  # (1, T)
        position_ids = torch.tensor([positions], device=device)  # (1, T)
        seq_ids = [f.request.id for f in feeds]
        first = self.caches[0].batch(seq_ids, counts, compile=self.compile)
        batches = [first, *(c.batch(seq_ids, counts, compile=self.compile, like=first) for c in self.caches[1:])]  # placed once a step
        if self._walk.model is not self.model:  # (a model set on the Batcher since: walked afresh)
            self._walk = Walk(self.model)
        trusted, changed = self._walk()
        check = not trusted or changed  # the first step, or a module replaced or an attribute set (a window) since the last:
        if changed:  # a checked forward (the caches against the layers as they are), the flat step made anew after it
            self._kept = ((), None)
        flat = None if check or any(f.count != 1 for f in feeds) else self._flat()  # a decode step: written out flat
        if flat is not None:
            logits = flat.logits(input_ids, position_ids, batches, rows)  # (1, N, vocab): the unchecked forward's, bit for bit
        else:
            logits = self.model(input_ids, positions=position_ids, cache=batches, logits_to_keep=rows, check=check)  # (1, N, vocab)
        return self._sample([f.request for f in feeds if f.emits], logits[0])

    def _flat(self) -> FlatStep | None:
        """``generate``'s flat step (``flat_step``) for a decode step: kept across steps, with its projections' decisions
        and its layers' ops, while the model's parts and the world they were decided in (``planned_world``) are the
        same, made anew from the model as it is where they are not (a block or a part replaced between steps is used
        from the next; a layer's terms set, its backend or window, the step itself follows: ``flat_step.layer_terms``);
        None where the model offers none."""
        blocks = flat_parts(self.model)  # (None for a model that is no CausalModel)
        if blocks is None:
            return None
        made_under = (*(id(part) for parts in blocks for part in parts), *planned_world())  # (the kept step holds its parts: no id reused)
        if made_under != self._kept[0]:
            self._kept = (made_under, FlatStep(self.model, blocks))
        return self._kept[1]

    def _roll_back(self, lengths: dict[int, int], joining: list[Request], emitting: list[Request], states: list[Tensor | None]) -> None:
        """Undo what a failed step did: the running requests' keys cut back to ``lengths``, the joining ones' sequences
        closed (they wait again, first in line), the generators of sampled requests back where they were."""
        for cache in self.caches:
            for seq_id, n in lengths.items():
                if cache.length(seq_id) != n:
                    cache.crop(seq_id, n)
            for r in joining:
                if r.id in cache:
                    cache.free(r.id)
        for r, state in zip(emitting, states, strict=True):
            if state is not None:
                r.generator.set_state(state)

    def _sample(self, batch: list[Request], logits: Tensor) -> list[int]:
        """(N, vocab) logits -> one token per request: argmax for all the greedy ones at once, each sampled one with its generator."""
        tokens = greedy(logits)  # (N,)
        for i, r in enumerate(batch):
            if r.temperature > 0:
                tokens[i] = next_token(logits[i : i + 1], r.temperature, r.top_k, r.generator)[0]  # as generate draws it for one row
        return tokens.tolist()  # the one host read a step


def generate_many(
    model: PagedLM,
    prompts: Sequence[Tensor],
    max_new_tokens: int | Sequence[int],
    *,
    eos_token_id: int | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    max_step_tokens: int = 2048,
    cache_dtype: torch.dtype | None = None,
    compile: bool = False,
) -> list[Tensor]:
    """Generate a continuation of every prompt by continuous batching through a paged cache.

    Args:
        model: a causal LM of ``headwise.models`` (GPT-2, the Llama family).
        prompts: 1-D id tensors of any lengths.
        max_new_tokens: one int for all, or one per prompt.
        eos_token_id: a request that emits it stops (the token is kept).
        block_size: token slots per block of the paged caches.
        num_blocks: blocks per layer's pool; default: room for every request at once.
        temperature, top_k: as ``model.generate`` (0 = greedy).
        seed: request i samples with ``torch.Generator(device).manual_seed(seed + i)`` on the model's device.
        max_step_tokens, cache_dtype, compile: see ``Batcher``.

    Returns:
        One (n_i,) tensor of new ids per prompt, n_i <= max_new_tokens[i]; each equals the new
        ids of ``model.generate(prompt[None], ...)`` for that prompt alone.

    Example:
        >>> import headwise as hw
        >>> from headwise.models import GPT2LMHeadModel
        >>> model = GPT2LMHeadModel(hw.GPT2Config(vocab_size=100, n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
        >>> outs = generate_many(model, [torch.tensor([5, 6, 7]), torch.tensor([8])], max_new_tokens=[4, 2])
        >>> [len(o) for o in outs]
        [4, 2]
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):  # (a 2-D tensor: its rows)
        raise TypeError(f"prompts must be a list of 1-D tensors of token ids, got {type(prompts).__name__}")
    if isinstance(prompts, Tensor) and prompts.ndim < 2:  # (its items would be 0-d ids, each refused as a prompt)
        raise ValueError(f"prompts must be a list of 1-D tensors of token ids (or a 2-D tensor, a prompt a row), got a tensor of "
                         f"shape {tuple(prompts.shape)}: pass [prompt] for one prompt")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must hold at least one 1-D tensor of token ids, got none")
    if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
        counts = list(max_new_tokens)
    elif isinstance(max_new_tokens, numbers.Integral) and not isinstance(max_new_tokens, bool):  # an int or a numpy integer
        counts = [max_new_tokens] * len(prompts)
    else:  # each count's own type and range: check_request below
        raise TypeError(f"max_new_tokens must be an int or a list of ints, one per prompt ({len(prompts)}), got {type(max_new_tokens).__name__}")
    if len(counts) != len(prompts):
        raise ValueError(f"max_new_tokens must be an int or one int per prompt ({len(prompts)}), got {len(counts)} values")
    for name, value in [("block_size", block_size), ("max_step_tokens", max_step_tokens)]:
        _checks.positive_int(name, value)
    if seed is not None:
        seed = _checks.integer(f"seed (or None; request i samples with seed + i, {len(prompts)} requests)", seed, low=0, high=SEED_HIGH + 1 - len(prompts))
    paged_model(model)
    top_k, eos_token_id = check_choice(temperature, top_k, eos_token_id, model.vocab_size)  # shared by every request: named once, not as prompts[0]'s
    for i, (prompt, n) in enumerate(zip(prompts, counts, strict=True)):  # every request checked before a pool is allocated for them
        try:
            check_request(model, prompt, n, eos_token_id, temperature, top_k, None)
        except (ValueError, TypeError) as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
    window = sliding_window(attn.window for attn in model.attention_layers())
    needs = [worst_blocks(len(p), n, block_size=block_size, max_step_tokens=max_step_tokens, window=window) for p, n in zip(prompts, counts, strict=True)]
    num_blocks = sum(needs) if num_blocks is None else _checks.positive_int("num_blocks", num_blocks)
    for i, (prompt, n, need) in enumerate(zip(prompts, counts, needs, strict=True)):  # (before a pool is allocated)
        if need > num_blocks:
            raise ValueError(f"prompts[{i}]: a request of {len(prompt)} + {n} tokens needs {need} blocks of {block_size}, "
                             f"more than the pool's num_blocks={num_blocks}")
    batcher = Batcher(model, num_blocks=num_blocks, block_size=block_size, max_step_tokens=max_step_tokens, cache_dtype=cache_dtype,
                      compile=compile)
    for i, (prompt, n) in enumerate(zip(prompts, counts, strict=True)):
        batcher.submit(prompt, n, eos_token_id=eos_token_id, temperature=temperature, top_k=top_k, seed=None if seed is None else seed + i)
    out: list[list[int]] = [[] for _ in prompts]
    for request, token in batcher.stream():
        out[request].append(token)
    return [torch.tensor(tokens, dtype=torch.long, device=batcher._weight.device) for tokens in out]


def paged_model(model: object) -> None:
    """TypeError unless ``model`` is a causal LM of ``headwise.models`` that makes paged caches."""
    if not hasattr(model, "new_paged_caches"):
        raise TypeError(f"model must be a causal LM of headwise.models with new_paged_caches (GPT-2, Llama), got {type(model).__name__}")
