"""Cross-attention's cache: a context's keys and values (an encoder's output), projected once.

The layer fills and reads it (``AttentionLayer.forward(x, context=..., cache=...)``); the core
never does (cross-attention passes its keys to ``attention`` directly).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..linear import weight_cache
from .owner import Owned
from .spent import Spendable


class ContextCache(Owned, Spendable):
    """The context's keys and values (B, Hkv, S, D), projected once, and its padding (B, S).

    The first forward given a ``context`` projects and stores them; later forwards reuse them,
    with or without the context passed again; another context (other values, or another
    ``context_mask``) is projected and replaces them, and so is the kept context once the
    module's weights changed (``headwise.linear.weight_cache.state``). The context written in place
    is another context too: seen by its version counter, or, through ``.data`` or a shared numpy
    array (which leave that counter as it was), by a sample of its bytes (``weight_cache.sample``: as
    for weights, a write that leaves both ends of the tensor as they were is not seen). It belongs to the module that filled it
    (another module's projections are other numbers): another module given it gets a ValueError.

    Example:
        >>> import torch, headwise as hw
        >>> cross = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2, causal=False, kv_dim=6)
        >>> memory, cache = torch.randn(1, 5, 6), hw.ContextCache()
        >>> y = cross(torch.randn(1, 1, 8), context=memory, cache=cache)  # projects the 5 context tokens
        >>> y = cross(torch.randn(1, 1, 8), cache=cache)  # reuses them
        >>> len(cache)
        5
    """

    _why = "its keys and values are that module's projections of the context"

    def __init__(self) -> None:
        self.k: Tensor | None = None  # (B, Hkv, S, D)
        self.v: Tensor | None = None  # (B, Hkv, S, D)
        self.context_mask: Tensor | None = None  # (B, S) True = real context token, or None (no padding)
        self._context: Tensor | None = None  # (B, S, kv_dim) what k and v were projected from
        self._version: int | None = None  # its version counter then (None: not tracked, inference mode)
        self._sample: tuple | None = None  # a sample of its bytes then (``weight_cache.sample``: writes through .data too)
        self._weights: tuple | None = None  # the state of the owner's parameters then (``weight_cache.state``)

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def reset(self) -> None:
        """Forget the stored context (the next forward projects a new one); the cache stays with its module."""
        self.k = self.v = self.context_mask = self._context = self._version = self._sample = self._weights = None
        self.forget_recorded()

    @property
    def context(self) -> Tensor | None:
        """(B, S, kv_dim) the context the stored keys and values were projected from, or None."""
        return self._context

    def serves(self, owner: torch.nn.Module) -> bool:
        """Whether the stored keys and values serve a forward of ``owner`` as its weights are now: projected with
        them, unchanged since, and, where this forward records for autograd (grad on, a parameter that wants one),
        recorded too and not yet gone through by a backward (which frees their graph). Otherwise the layer projects
        the context again: every backward reaches the key and value projections, as without the cache."""
        params = _weights_of(owner)
        if self._weights is None or self._weights != weight_cache.state(params):
            return False
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return self.k.requires_grad and not self._spent
        return True

    def check_projectable(self) -> None:
        """A ValueError unless the kept context can be projected again (the weights changed since, or autograd needs keys
        of its own), before anything is computed: it must hold what it held when stored (a context written in place since
        would give keys of other values than the ones reused until now), and, where a backward went through the stored
        keys and autograd records this call, it must carry no graph of its own (that backward freed it: an encoder's
        output is to be passed again)."""
        ctx = self._context
        if (self._version is not None and _version(ctx) != self._version) or weight_cache.sample(ctx) != self._sample:
            raise ValueError("the context this ContextCache was filled from was written in place since: pass context= again "
                             "(it is projected again), or cache.reset()")
        if self._spent and torch.is_grad_enabled() and ctx.grad_fn is not None:
            raise ValueError("a backward has gone through this ContextCache's keys and values, and through the graph of the "
                             "context they were projected from: pass the context again (context=, a new encoder output), or "
                             "cache.reset()")

    def holds(self, context: Tensor, context_mask: Tensor | None) -> bool:
        """Whether the stored keys are those of ``context`` (B, S, kv_dim) with padding ``context_mask`` (B, S) bool or None:
        the same tensor, unchanged since, or equal values (one comparison, read on the host)."""
        if self._context is None or (self.context_mask is None) != (context_mask is None):
            return False
        if self.context_mask is not None and not torch.equal(self.context_mask, context_mask):
            return False
        unchanged = self._version is not None and _version(self._context) == self._version and weight_cache.sample(self._context) == self._sample
        if context is self._context:
            return unchanged
        return unchanged and context.shape == self._context.shape and torch.equal(context, self._context)

    def __getstate__(self) -> dict:
        """As ``Owned``'s, with whether the kept context is as it was when stored: a copy's context is a new tensor,
        whose version counter starts anew (``_recount``)."""
        state = super().__getstate__()
        ctx, version = self._context, state.pop("_version")  # a copy's counter is set by ``_recount``
        state["_unchanged"] = ctx is not None and _version(ctx) == version and weight_cache.sample(ctx) == self._sample
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._recount()

    def __deepcopy__(self, memo: dict) -> ContextCache:
        new = super().__deepcopy__(memo)  # (through __getstate__, without __setstate__)
        new._recount()
        return new

    def _recount(self) -> None:
        """After a copy: ``_version`` is the copied context's counter where the kept context was unchanged
        (``__getstate__``'s ``_unchanged``), else -1, which no counter equals (its keys are of older values: projected
        again only from a context passed again)."""
        unchanged, ctx = self.__dict__.pop("_unchanged"), self._context
        self._version = None if ctx is None else _version(ctx) if unchanged else -1

    def store(self, owner: object, context: Tensor, keys: Tensor, values: Tensor, context_mask: Tensor | None) -> None:
        """Keep ``owner``'s keys and values (B, Hkv, S, D) of ``context`` (B, S, kv_dim) with its padding (B, S) or None."""
        params = _weights_of(owner) if isinstance(owner, torch.nn.Module) else []
        weights, version, sample = weight_cache.state(params), _version(context), weight_cache.sample(context)  # read, then write
        weight_cache.watch(params)  # a write through .data is seen too (``weight_cache.verify``)
        self.k, self.v, self.context_mask, self._context, self._version = keys, values, context_mask, context, version
        self._sample, self._weights = sample, weights
        self.forget_recorded()
        self.mark_on_backward((keys, values))
        self.bind(owner)


def _weights_of(module: torch.nn.Module) -> list[Tensor]:
    """What a module's projections read: its parameters and its buffers (an ``Int8Linear`` holds its int8 weight,
    scales and bias as buffers)."""
    return [*module.parameters(), *module.buffers()]


def _version(t: Tensor) -> int | None:
    """``t``'s version counter (it counts in-place writes), or None where it is not tracked (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None

