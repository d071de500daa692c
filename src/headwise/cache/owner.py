"""A cache belongs to one attention module: the first that writes it; any other module is refused by name.

Two layers sharing a cache would attend over each other's keys (a ``KVCache``, a paged pool) or over
another layer's projections of the context (a ``ContextCache``): numbers that run, and are wrong.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable, Iterator

from torch import Tensor


class Owned:
    """``check_owner`` (refuses, changing nothing) and ``bind`` (ties the cache, after its first write)."""

    _owner: weakref.ref | None = None  # the module this cache belongs to (a weak reference: a dead module frees it)
    _why = "a shared cache mixes their keys and values"  # what sharing would do, for the message

    def check_owner(self, owner: object) -> None:
        """Raise ValueError (changing nothing) if this cache belongs to another module than ``owner`` (still alive)."""
        bound = None if self._owner is None else self._owner()
        if bound is not None and bound is not owner:
            raise ValueError(
                f"this {type(self).__name__} belongs to {_describe(bound)}, not to {_describe(owner)}: "
                f"give every attention layer a cache of its own ({self._why})"
            )

    def bind(self, owner: object) -> None:
        """Tie this cache to ``owner``, the attention module that writes it.

        Raises:
            ValueError: the cache already belongs to another module (still alive).
        """
        self.check_owner(owner)
        if self._owner is None or self._owner() is None:
            self._owner = weakref.ref(owner)

    def __getstate__(self) -> dict:
        """Pickled without its owner (a module is not saved with its cache): the loaded cache belongs to the first module
        that writes it."""
        state = self.__dict__.copy()
        state.pop("_owner", None)
        return state

    def __copy__(self) -> Owned:
        """Refused: a shallow copy would share the buffers, each write to one cache landing in the other's slots (a
        continued copy silently changing the original's keys)."""
        raise TypeError(f"copy.copy of a {type(self).__name__} would share its buffers with the original (a write to one "
                        "lands in the other): take copy.deepcopy(cache), which copies the keys and values")

    def __deepcopy__(self, memo: dict) -> Owned:
        """A copy of the contents; it belongs to the copy of its owner where the same ``deepcopy`` copied that module
        (``copy.deepcopy((model, caches))``), else to the first module that writes it. Tensors autograd recorded (a
        training step's keys) are copied as their values: a copy cannot share the original's graph, so gradients through
        the copy stop at them, as after ``detach``."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        state = self.__getstate__()
        for t in _recorded(state.values()):
            memo.setdefault(id(t), t.detach().clone())  # (torch deep-copies graph leaves only)
        for name, value in state.items():
            object.__setattr__(new, name, copy.deepcopy(value, memo))
        owner = None if self._owner is None else self._owner()
        if owner is not None and id(owner) in memo:
            new._owner = weakref.ref(memo[id(owner)])
        return new


def _recorded(values: Iterable[object]) -> Iterator[Tensor]:
    """The tensors among ``values`` (and in their tuples and lists) that autograd recorded: those with a ``grad_fn``."""
    for value in values:
        if isinstance(value, Tensor) and value.grad_fn is not None:
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _recorded(value)


def _describe(module: object) -> str:
    return f"{type(module).__name__} at {id(module):#x}"
