"""Autoregressive generation through a ``KVCache`` per layer, shared by the causal language models.

A model takes part by offering the ``CausalLM`` methods: its vocabulary size, the most tokens
it may hold, fresh caches, and its ``forward(ids, positions=, cache=, logits_to_keep=, check=)``,
through which the prompt and every step run (as gpt-fast's model is its ``forward(idx, input_pos)``).
Positions follow HuggingFace's ``generate``: under left padding a token's position counts the
real tokens before it, so a padded row continues exactly as the unpadded row would.

``generate`` checks its arguments once a call; what it then feeds the model (its own tokens, at
the next positions, into caches it made) cannot go wrong between steps, so the forwards run with
``check=False`` (no per-layer checks, no host reads) unless something outside could change them
(``trusts``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import cache, partial
from typing import Protocol

import torch
from torch import Tensor
from torch.nn.modules import module as _module  # the global hook registries

from .. import _checks, native
from ..cache import KVCache
from ..linear import weight_cache
from ..masks import positions
from ..observe import observing
from . import _inputs
from .compiled_step import compiled_step
from .graph_step import GraphStep

#: greedy's chunk of a row: at least this many logits (amax's vectors pay over such a run), the smallest divisor of the vocab
GREEDY_CHUNK = 256

# (B, V) float32 or bfloat16 logits, rows contiguous -> (B,) int64: argmax's index in one pass (``models/greedy.cpp``)
torch.library.define("headwise::greedy", "(Tensor logits) -> Tensor")


@torch.library.register_fake("headwise::greedy")
def _greedy_shape(logits: Tensor) -> Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.long)  # (B,)


class CausalLM(Protocol):
    """What ``GenerationMixin.generate`` needs from the model it is mixed into."""

    @property
    def vocab_size(self) -> int: ...

    def context_limit(self) -> tuple[str, int | None]:
        """The config field that bounds prompt + new tokens, and its value (None = no bound)."""
        ...

    def new_caches(self, batch_size: int, max_len: int, dtype: torch.dtype | None = None) -> list[KVCache]:
        """One empty cache per layer, room for ``max_len`` tokens (or a sliding window), holding ``dtype``
        (None: the model's; bfloat16 for a float32 model, TypeError for a dtype it cannot hold)."""
        ...

    def __call__(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, positions: Tensor | None = None,
        cache: list[KVCache] | None = None, logits_to_keep: int | Tensor = 0, check: bool = True,
    ) -> Tensor:
        """(B, T) ids through the caches -> (B, T or logits_to_keep, vocab) logits.

        positions: (B, T), or None for the positions after the caches' tokens;
        attention_mask: (B, T) bool for the new tokens, or None (no padding among them).
        """
        ...


class GenerationMixin:
    """``model.generate(...)``, the one method GPT-2 and the Llama family share; the model offers
    the ``CausalLM`` methods it calls."""

    def __getstate__(self) -> dict:
        """Pickled (``torch.save(model)``, ``copy.deepcopy``) without the compiled decode steps ``compile=True`` kept:
        a graph does not pickle, and a copy compiles its own."""
        state = super().__getstate__()  # nn.Module's: a copy of the instance's attributes
        state.pop("_compiled_steps", None)
        return state

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        *,
        max_new_tokens: int,
        attention_mask: Tensor | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        generator: torch.Generator | None = None,
        compile: bool = False,
        cuda_graph: bool = False,
        cache_dtype: torch.dtype | None = None,
        on_token: Callable[[Tensor], object] | None = None,
    ) -> Tensor:
        """Continue each prompt, one token at a time, through a ``KVCache`` per layer.

        Args:
            input_ids: (B, T) prompts; pad batches on the left, with ``attention_mask``.
            max_new_tokens: the most tokens to add. The prompt's longest row (left padding not counted) and all
                new tokens but the last (never fed back) must fit the model's positions (``context_limit``).
            attention_mask: (B, T), 1/True = real token (ints or bools).
            temperature: 0 = greedy (argmax); > 0 divides the logits before sampling. A row whose logits hold +inf or
                NaN, or are all -inf, takes greedy's token (the limit of the softmax; torch's sampler refused it).
            top_k: sample only among the k likeliest tokens and any tied with the k-th (as HuggingFace's), with
                temperature > 0.
            eos_token_id: a row that emits it is finished and is padded with it from then
                on; generation stops early once every row is finished.
            generator: the ``torch.Generator`` that sampling draws from.
            compile: run every decode step after the prompt pass under ``torch.compile``
                (``fullgraph=True``, ``dynamic=True``: one graph for every step, cache length
                and batch size > 1; compiled on the first call, minutes on a small CPU for a
                12-layer model, then reused by later calls on the same model). On the CPU the
                weights are frozen into the graph, where inductor packs them for its own GEMM
                kernels (``models.compiled_step``; compiled anew when a weight changes). The
                tokens are the eager steps' (to rounding); docs/performance/decode.md says what
                it gains.
            cuda_graph: on a CUDA device, capture the first decode step as a CUDA graph and replay
                it for every later one: the host's cost of a step (Python, kernel launches) is
                paid once per call. Each step reads the whole cache under a mask of the tokens
                written (``SlotCache``): the eager step's context, summed in another order. Needs
                a model ``generate`` may run unchecked (eval mode, no hooks, nobody observing).
            cache_dtype: what the ``KVCache`` holds: None = the model's dtype; ``torch.bfloat16`` for a
                float32 model halves the bytes each token keeps and each step reads (keys and values
                rounded to bfloat16, attention in bfloat16, everything else in float32: the tokens
                may differ from float32's where two logits are close); ``torch.int8`` for a float32
                or bfloat16 model keeps 8-bit rows (``KVCache``: a quarter of float32's bytes and a scale a
                row, a bfloat16 model's keys and values widened exactly first; attention in float32 over the
                rows read back; the decode steps, eager or under ``compile=True``, read them in place in the
                C++ decode kernel). Not with ``cuda_graph``.
            on_token: called with each step's (B,) new tokens as soon as they are chosen, before the
                next step runs (streaming: print or send them); the first call comes right after
                the prompt pass. The tensor is the one ``generate`` keeps: read or copy it, do not change
                it in place. Its return value is ignored. A weight it changes is read by the eager steps
                from the next step on, by a ``compile=True`` step from the next call (its graph is checked
                against the weights once a call); a hook, a module's ``forward`` or a training mode it sets
                makes the steps from the next on checked forwards (``trusts``); a module it replaces or
                adds, its class, an attribute it sets (a layer's ``window``), or a move to another dtype or
                device, is run from the next step on, that step a checked forward (a ring cache of another
                window, float32 caches under bfloat16 weights: the forward's error).

        Returns:
            (B, T + n) int64 ids (whatever integer dtype the prompt's), prompt first, n <= max_new_tokens. Greedy output equals
            HuggingFace's greedy ``generate`` (``do_sample=False``) token for token.
        """
        vocab = self.vocab_size
        weight = next(self.parameters(), None) if isinstance(self, torch.nn.Module) else None  # the ids must be on its device
        b, t, is_token = _inputs.ids_and_mask(input_ids, attention_mask, vocab, weight)  # (B, T) bool or None
        max_new_tokens, top_k, eos_token_id = _inputs.check_sampling(max_new_tokens, temperature, top_k, eos_token_id, vocab)
        _checks.boolean("compile", compile)
        _checks.boolean("cuda_graph", cuda_graph)
        if on_token is not None and not callable(on_token):
            raise TypeError(f"on_token must be a callable taking each step's (B,) tokens, or None, got {type(on_token).__name__}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator (sampling's random numbers) or None, got {type(generator).__name__}")
        walk = Walk(self)  # (asked again after each on_token: whether the steps may still run unchecked, on the same modules)
        check = not walk()[0]
        held = _held(self)  # the dtype and device the caches are made for
        weight_cache.verify()  # a write through .data since the projections' copies (or the frozen step) were made
        if cuda_graph:
            graph_allowed(input_ids.device, compile, check)
            if cache_dtype == torch.int8:
                raise ValueError("cache_dtype=torch.int8 with cuda_graph=True: the graph's step reads float32 or bfloat16 caches")
        _inputs.check_length(self, t, max_new_tokens, is_token)
        windowed = any(w is not None for w in getattr(self.config, "windows", None) or ())
        is_token = prompt_padding(is_token, windowed)  # None when nothing is padding; refuses prompts that end in padding
        caches = self.new_caches(b, min(t + max_new_tokens, 2**63 - 1), cache_dtype)  # (no limit: every layer a ring of its window)
        position = None if is_token is None else positions(is_token, b, t, input_ids.device)  # (B, T) or None: consecutive
        if not check and weight is not None:  # each layer against its new cache (heads, window, dtype), as a checked
            _inputs.caches_agree(self, caches, b, t, weight)  # prompt pass asks, without reading the inputs again
        logits = self(input_ids, is_token, positions=position, cache=caches, logits_to_keep=1, check=check)[:, 0]  # (B, vocab)
        if not check:  # each cache bound to its layer, as a checked prompt pass binds them (a layer moved later is told)
            for cache, attn in zip(caches, self.attention_layers(), strict=True):
                cache.bind(attn)
        checked_step = partial(_next_logits, self, True)  # the step after on_token changed the model: a checked forward
        run_step = decode_step(self, compile, check)  # (ids, positions, caches) -> (B, vocab): eager and unchecked under cuda_graph
        run_step = GraphStep(run_step) if cuda_graph else run_step
        if on_token is not None and not check:
            walk()  # (the walk's record taken again after the step's own set-up: a compiled step's table on the model)
        tokens, finished = [input_ids], torch.zeros(b, dtype=torch.bool, device=input_ids.device)
        recheck = False
        for step in range(max_new_tokens):
            token = next_token(logits, temperature, top_k, generator)  # (B,)
            if eos_token_id is not None:
                token = token.masked_fill(finished, eos_token_id)
                finished |= token == eos_token_id
            tokens.append(token[:, None])  # (B, 1)
            if on_token is not None:
                on_token(token)
                weight_cache.verify()  # a weight it wrote through .data: the kept copies made again
                if not check:  # (checked forwards call the modules as they are)
                    trusted, changed = walk()
                    if not trusted:  # a hook, a forward, a mode or an observer it set: checked steps from here
                        check, run_step = True, decode_step(self, compile, True)
                    elif changed or _held(self) != held:  # a module it replaced or added, an attribute it set, the model
                        # moved to another dtype or device: the step made again from the model as it is, and the next step
                        # a checked forward (the caches against the changed layers: its error, or its logits bit for bit)
                        run_step, held, recheck = decode_step(self, compile, False), _held(self), True
                        run_step = GraphStep(run_step) if cuda_graph else run_step
            if step == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):  # the one host read a step, with eos only
                break
            if position is not None:
                position = position[:, -1:] + 1  # (B, 1): HuggingFace's rule, last position + 1
            logits = (checked_step if recheck else run_step)(token[:, None], position, caches)  # (B, vocab)
            recheck = False
        return torch.cat(tokens, dim=1)  # (B, T + n)


def _held(model: CausalLM) -> tuple[torch.dtype, torch.device] | None:
    """The dtype and device of the model's first parameter (what ``new_caches`` made the caches for), or None."""
    weight = next(model.parameters(), None) if isinstance(model, torch.nn.Module) else None
    return None if weight is None else (weight.dtype, weight.device)


def decode_step(model: CausalLM, compile: bool, check: bool | None = None) -> Callable[[Tensor, Tensor | None, list[KVCache]], Tensor]:
    """The step ``generate`` runs after its prompt pass: (B, 1) ids, positions or None, caches -> (B, vocab).

    The model's forward with ``check`` (default: ``not trusts(model)``); unchecked and eager, the
    model's ``flat_step()`` where it offers one (the same logits, bit for bit); with ``compile``, under
    ``torch.compile(fullgraph=True, dynamic=True)`` (``compiled_step``: on the CPU with the weights
    frozen), kept on the model per ``check`` until a weight changes, so later calls reuse its graph
    (the cache length, a batch size > 1 and the prompt length are symbolic).
    """
    check = not trusts(model) if check is None else check
    step = partial(_next_logits, model, check)
    if not compile:
        flat = None if check else getattr(model, "flat_step", lambda: None)()  # the unchecked step written out, where the model has one
        return step if flat is None else flat
    return compiled_step(model, check, step, trusted=not check)


def graph_allowed(device: torch.device, compile: bool, check: bool) -> None:
    """Raise ValueError unless ``generate(..., cuda_graph=True)`` can capture its step: ids on a CUDA device, not also
    compiled, and a model whose steps may run unchecked (``trusts``: a replayed step checks nothing)."""
    if device.type != "cuda":
        raise ValueError(f"cuda_graph=True captures the decode step as a CUDA graph: input_ids and the model must be on a CUDA device, got {device}")
    if compile:
        raise ValueError("cuda_graph=True and compile=True: choose one (the graph replays the eager step)")
    if check:
        raise ValueError(
            "cuda_graph=True replays one unchecked step: the model must be in eval mode, with no forward hooks, "
            "its class's own forward and nobody observing (headwise.observe)"
        )


def _next_logits(model: CausalLM, check: bool, ids: Tensor, position_ids: Tensor | None, caches: list[KVCache]) -> Tensor:
    return model(ids, positions=position_ids, cache=caches, logits_to_keep=1, check=check)[:, 0]  # (B, vocab)


def trusts(model: object) -> bool:
    """Whether ``generate``'s forwards may skip their checks (``check=False``), decided once a call.

    ``generate`` checks its arguments, then feeds the model its own tokens, at the next
    positions, into caches it made with room for every new token: nothing a check could catch
    changes between steps, as long as nothing outside the model's own code sees or changes what
    a layer is given: no forward hooks (they may change a layer's input), a ``forward`` that is
    the class's own on the model and on every submodule (one set on an instance, e.g. by
    ``torch.compile(model.forward)`` or accelerate's hooks, is the caller's code: the unchecked
    step, which runs a layer's parts in one op, would pass it by), nobody observing
    (``headwise.observe`` reads the checked core's steps) and eval mode (the unchecked core runs
    no dropout). Otherwise every forward checks its arguments.
    """
    return Walk(model, keep=False)()[0]


class Walk:
    """``trusts(model)`` asked again and again of one model: ``walk()`` -> (whether the steps may run unchecked, whether
    its modules are others, or in another order, of other classes, or hold other attributes (plain ones, ``PLAIN``, by
    value; others by identity), than at the last call: a module replaced or added, a layer's window or rotary tables set;
    True at the first).

    Where headwise's C++ library is loaded the modules are walked in one C call (``linear/seen.cpp``: a Llama's 150
    modules' dictionaries read from Python took 0.24 ms, asked after every ``on_token`` and every ``Batcher`` step);
    elsewhere by ``walked``. ``keep=False``: nothing kept (``trusts``: the first answer only).
    """

    def __init__(self, model: object, keep: bool = True) -> None:
        self.model, self.tree, self.keep = model, None, keep
        self.native: Callable | None = None
        self.key = -1  # (the C call's key: negative keeps nothing)
        if native.loaded() and isinstance(model, torch.nn.Module):
            self.native = native.function("headwise_walk", ctypes.c_int, ctypes.c_int64, ctypes.py_object)
            if keep:
                self.key = native.keyed(self, "headwise_walk_forget")

    def __reduce__(self) -> tuple:
        return Walk, (self.model, self.keep)  # a copy walks afresh (its first call: changed), with a key of its own

    def __call__(self) -> tuple[bool, bool]:
        if self.native is None:
            trusted, tree = walked(self.model, self.keep)
            changed, self.tree = tree != self.tree, tree
            return trusted, changed
        if _plain_world():
            answer = self.native(self.key, self.model)
            return answer >= 0, answer != 1
        return False, True


#: The attribute values ``walked`` compares by value (a window, a softcap, a norm's eps, a GELU's ``approximate``); any
#: other (a rotary table's object, a dictionary) by identity.
PLAIN = frozenset({int, bool, float, str, type(None)})


class _Same:
    """An attribute's value in a walk's record, equal to another only where they hold the same object (held: no other
    object takes its id while the record lives)."""

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.value is self.value


def _plain_world() -> bool:
    """Nobody observing, no global forward hooks: what ``walked`` asks before the modules."""
    return not (observing() or _module._global_forward_hooks or _module._global_forward_pre_hooks)


def walked(model: object, attributes: bool = True) -> tuple[bool, tuple]:
    """(``trusts(model)``, the ids of its modules in the walk's order, each with its class and its attributes (with
    ``attributes``: names, and values compared by value where ``PLAIN``, else by identity), where it does: another tuple
    once a module was replaced or added, its class set, or an attribute set to another value), from Python (``Walk`` asks
    the C library where it is loaded)."""
    if not isinstance(model, torch.nn.Module) or not _plain_world():
        return False, ()
    seen, todo, order = {id(model)}, [model], []  # every submodule once, as ``model.modules()`` gives them (a walk of half
    while todo:  # its cost: the ``Batcher`` asks this every step)
        m = todo.pop()
        if m.training or m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
            return False, ()
        order.append((id(m), type(m), *[(k, v if type(v) in PLAIN else _Same(v)) for k, v in m.__dict__.items()]) if attributes else id(m))
        for child in m._modules.values():
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return True, tuple(order)


def prompt_padding(is_token: Tensor | None, windowed: bool = False) -> Tensor | None:
    """The prompts' padding mask to pass on (None when nothing is padding), after checking that
    no prompt ends in padding (generate continues every row from its last column) and, for a
    model with a sliding window (``windowed``), that no padding sits between real tokens (the
    window would count it as tokens, where positions skip it: a row would not continue as its
    real tokens alone). One host read answers the three questions (as ``_inputs.padding_only``
    answers the first)."""
    if is_token is None or not _checks.has_values(is_token):
        return is_token
    gaps = is_token[:, :-1] & ~is_token[:, 1:]  # (B, T - 1): a real token followed by padding
    left_only = ~gaps.any() if windowed else is_token.new_ones(())
    all_real, ends_real, left_only = torch.stack([is_token.all(), is_token[:, -1].all(), left_only]).tolist()  # one host read
    if not ends_real:
        rows = (~is_token[:, -1]).nonzero().flatten().tolist()
        raise ValueError(
            f"generate continues each prompt from its last column, but attention_mask marks it as padding in rows {rows}: "
            "pad prompts on the left (tokenizer.padding_side = 'left')"
        )
    if not left_only:
        rows = gaps.any(-1).nonzero().flatten().tolist()
        raise ValueError(
            f"attention_mask has padding between real tokens in rows {rows}: with a sliding window generate takes prompts "
            "padded on the left only (each row's zeros, then its ones; the window would count the gap as tokens); drop "
            "those tokens from the prompt instead"
        )
    return None if all_real else is_token


_GREEDY_DTYPES = (torch.float32, torch.bfloat16)  # what greedy's op reads


@cache
def _chunk(vocab: int) -> int | None:
    """The smallest divisor of ``vocab`` in [GREEDY_CHUNK, 16 * GREEDY_CHUNK] (None: none, or a vocab under 4 chunks)."""
    if vocab < 4 * GREEDY_CHUNK:
        return None
    return next((c for c in range(GREEDY_CHUNK, 16 * GREEDY_CHUNK + 1) if vocab % c == 0), None)


def greedy(logits: Tensor) -> Tensor:
    """(B, vocab) logits -> (B,) ids: ``logits.argmax(-1)``, the same index (the first largest; a NaN counts as
    largest, the first NaN). On the CPU torch's argmax walks a row one element at a time: float32 or bfloat16 rows
    take headwise's op where its library is loaded (one pass, 16 lanes at once: ``models/greedy.cpp``), other rows
    ``greedy_by_chunks``."""
    if (logits.is_cpu and logits.ndim == 2 and logits.dtype in _GREEDY_DTYPES and 0 < logits.shape[1] < 2**31
            and logits.stride(1) == 1 and not logits.requires_grad and native.loaded()):
        return torch.ops.headwise.greedy(logits)  # (B,)
    return greedy_by_chunks(logits)


def greedy_by_chunks(logits: Tensor) -> Tensor:
    """``greedy`` without headwise's op: on the CPU a row is cut into chunks (a divisor of the vocab, ``_chunk``), the
    first chunk holding the row's maximum is found from the chunks' maxima (``amax`` runs vectors), and the argmax runs
    inside it only; elsewhere, or where no divisor fits, torch's argmax."""
    size = _chunk(logits.shape[-1]) if logits.is_cpu and logits.ndim == 2 else None
    if size is None:
        return logits.argmax(dim=-1)  # (B,)
    chunks = logits.reshape(logits.shape[0], logits.shape[1] // size, size)  # (B, vocab / size, size)
    first = chunks.amax(dim=-1).argmax(dim=-1)  # (B,): the first chunk whose maximum is the row's (NaN: the first with one)
    rows = torch.arange(logits.shape[0], device=logits.device)  # (B,)
    return first * size + chunks[rows, first].argmax(dim=-1)  # (B,)


def next_token(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """(B, vocab) logits -> (B,) ids: the argmax at temperature 0 (``greedy``), else a top-k / temperature sample."""
    if temperature == 0:
        return greedy(logits)  # (B,)
    wide = logits.double()  # a temperature below float32's range (1e-300) must not round to 0 and make 0/0
    top = wide.max(dim=-1, keepdim=True).values  # (B, 1): +inf, NaN, or -inf for a row of nothing but -inf
    odd = ~top.isfinite()  # (B, 1): such a row takes greedy's token, the softmax's limit (no host read)
    wide = torch.where(odd, 0.0, wide - top) / temperature  # (B, vocab) <= 0: a tiny temperature gives -inf, never inf
    if top_k is not None:
        kth = wide.topk(min(top_k, wide.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        wide = wide.masked_fill(wide < kth, float("-inf"))
    probs = torch.softmax(wide, dim=-1)  # (B, vocab)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
    return torch.where(odd.squeeze(1), greedy(logits), drawn)  # (B,)
