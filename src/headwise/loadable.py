"""All-or-nothing loading: the one key check every loader runs, and the mixin that gives headwise's modules a strict
``load_state_dict`` that runs it first.

``remap`` renames, transposes and checks a whole state dict against the keys and shapes it must fill, and raises one
ValueError naming every missing, unexpected, duplicated, mis-shaped and mis-typed entry; ``check_state`` asks it of a
module. torch's ``nn.Module.load_state_dict(state, strict=True)`` copies every entry that fits before it raises about
the ones that do not, so a refused state dict leaves the module half loaded: ``AllOrNothing`` (the book's classes, the
attention layers, the models) checks first (``check_loadable``) and raises ``StateDictError`` naming every problem
before anything is copied. ``strict=False`` keeps torch's rules, and so does a module any of whose modules carries a
load hook that may turn the incoming entries into others; hooks that keep every entry's key and shape are marked
with ``keeps_keys`` (the book's ``mask``, accepted and dropped; a sharded model's, ``headwise.parallel``, which lay
a full tensor out as the parameter's DTensor of the same global shape).
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from . import _checks

_KEY_KEEPING: set[Callable] = set()


def remap(
    state: Mapping[str, Tensor],
    expected: Mapping[str, tuple[int, ...]],
    *,
    rename: Callable[[str], str] = lambda key: key,
    transposed: tuple[str, ...] = (),
    ignore: Callable[[str], bool] = lambda key: False,
    optional: Mapping[str, tuple[int, ...]] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    valued: Collection[str] = (),
    whole: Collection[str] = (),
    source: str = "state dict",
    named: Callable[[str], str] = lambda key: key,
    problems: Sequence[str] = (),
) -> dict[str, Tensor]:
    """Rename keys, transpose the named weights, check every key and shape; return a new dict.

    Args:
        state: the incoming tensors.
        expected: target key -> shape; every one must be produced, nothing else.
        rename: maps an incoming key to a target key.
        transposed: incoming 2-D weights whose key ends with one of these are transposed.
        ignore: incoming keys for which this is True are dropped.
        optional: target key -> shape of entries that may come but need not (the book's
            ``mask``, which its state dicts carry and headwise does not store).
        dtypes: target key -> the dtype it holds. A floating-point key takes any floating-point
            tensor (the copy casts between widths) and refuses an integer or bool one; any other
            key (int8 weights, an integer buffer) takes its own dtype alone. Refused rather than
            cast: a float truncated, a wider int wrapped. Keys not named here take any dtype.
        valued: target keys whose tensors hold values: a meta tensor (a shape, no values) for
            one of them is refused (torch's copy would fail there, after the entries before it).
        whole: target keys held as plain tensors: a DTensor (one rank's share, ``headwise.parallel``) for one of them
            is refused (torch's copy mixes the two and fails there, after the entries before it).
        source: names the origin (a file, say) in the error message.
        named: a target key's name in the incoming state (``rename``'s inverse): what a missing key is called in
            the message, as the state's other keys are.
        problems: what the caller found wrong with ``state`` beyond keys and shapes (a tied head that is no copy of
            its embedding), listed first in the same error.

    Raises:
        TypeError: ``state`` is not a mapping.
        ValueError: listing every missing, unexpected, duplicated, mis-shaped, valueless and
            mis-typed key at once.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"state must be a mapping of names to tensors (a state dict), got {type(state).__name__}")
    optional, dtypes = optional or {}, dtypes or {}
    out: dict[str, Tensor] = {}
    origin: dict[str, str] = {}  # target key -> the incoming key that gave it
    unexpected, duplicated, misshaped, mistyped, valueless = [], [], [], [], []
    for key, tensor in state.items():
        if ignore(key):
            continue
        name = rename(key)
        if name not in expected and name not in optional:
            unexpected.append(key)
            continue
        if name in origin:
            duplicated.append(f"{origin[name]} and {key} both give {name}")
            continue
        origin[name] = key
        if not isinstance(tensor, Tensor):
            mistyped.append(f"{key}: expected a tensor, got {type(tensor).__name__}")
            continue
        flip = bool(transposed) and key.endswith(transposed) and tensor.ndim == 2
        shape = tuple(expected[name] if name in expected else optional[name])
        if tuple(tensor.t().shape if flip else tensor.shape) != shape:  # both in the incoming layout in the message
            misshaped.append(f"{key}: expected {shape[::-1] if flip else shape}, got {tuple(tensor.shape)}"
                             + (" (stored transposed: (in, out))" if flip else ""))
            continue
        if flip:
            tensor = tensor.t()
        if name in dtypes and not _takes(dtypes[name], tensor.dtype):
            want = ("a floating-point tensor" + (" of 16 bits or more (8-bit floats are a quantized checkpoint's values)"
                                                 if tensor.is_floating_point() else "")) if dtypes[name].is_floating_point else str(dtypes[name])
            mistyped.append(f"{key}: expected {want}, got {tensor.dtype} (not cast silently)")
            continue
        if name in valued and tensor.is_meta:
            valueless.append(key)
            continue
        if name in whole and _checks.sharded(tensor):
            mistyped.append(f"{key}: expected a plain tensor, got a DTensor (one rank's share of a model split by "
                            "headwise.parallel: gather it with .full_tensor())")
            continue
        out[name] = tensor
    missing = [k for k in expected if k not in origin]
    if problems or missing or unexpected or duplicated or misshaped or mistyped or valueless:
        lines = [f"cannot load {source}; nothing was loaded:"]
        lines += [f"  {p}" for p in problems]
        lines += [f"  missing: {named(k)}" for k in missing]
        lines += [f"  unexpected: {k}" for k in unexpected]
        lines += [f"  duplicate: {d}" for d in duplicated]
        lines += [f"  wrong shape: {m}" for m in misshaped]
        lines += [f"  wrong dtype: {m}" for m in mistyped]
        lines += [f"  no values: {k} (a meta tensor: a shape without values)" for k in valueless]
        raise ValueError("\n".join(lines))
    return out


def _takes(target: torch.dtype, incoming: torch.dtype) -> bool:
    """Whether a tensor of dtype ``incoming`` loads into one of dtype ``target`` (``remap``'s ``dtypes`` rule): an 8-bit
    float only into one (a quantized checkpoint's values, their scales apart)."""
    if not target.is_floating_point:
        return incoming == target
    return incoming.is_floating_point and (incoming.itemsize > 1 or target.itemsize == 1)


def check_state(
    module: nn.Module,
    state: Mapping[str, Tensor],
    *,
    rename: Callable[[str], str] = lambda key: key,
    transposed: tuple[str, ...] = (),
    ignore: Callable[[str], bool] = lambda key: False,
    source: str | os.PathLike[str] = "state dict",
    named: Callable[[str], str] = lambda key: key,
    problems: Sequence[str] = (),
) -> dict[str, Tensor]:
    """``state`` renamed and checked against ``module`` (via ``remap``, ``named`` its missing keys, ``problems`` listed
    with the rest); nothing is loaded.

    Every parameter and persistent buffer must come, once, with its shape (a floating one as
    a floating-point tensor, an integer one in its own dtype); entries that ``state_dict`` adds without storing them (the
    book's ``mask``) may come. ``module`` may live on the meta device: only shapes are read.
    """
    stored = dict(module.named_parameters()) | dict(module.named_buffers())
    token = _SHAPES_ONLY.set(True)
    try:
        emitted = module.state_dict()  # (the entries it adds without storing them, on "meta": only their shapes are read)
    finally:
        _SHAPES_ONLY.reset(token)
    expected = {name: tuple(t.shape) for name, t in emitted.items() if name in stored}
    optional = {name: tuple(t.shape) for name, t in emitted.items() if name not in stored}
    dtypes = {name: stored[name].dtype for name in expected}
    valued = {name for name in expected if not stored[name].is_meta}
    whole = {name for name in expected if not _checks.sharded(stored[name])}
    return remap(state, expected, rename=rename, transposed=transposed, ignore=ignore, optional=optional, dtypes=dtypes,
                 valued=valued, whole=whole, source=str(source), named=named, problems=problems)


_SHAPES_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("headwise_state_shapes_only", default=False)


def shapes_only() -> bool:
    """Whether the ``state_dict`` being made is read for its keys and shapes only (``check_state``): an entry a module
    adds without storing it (the book's (ctx, ctx) ``mask``) may then be a "meta" tensor of its shape."""
    return _SHAPES_ONLY.get()


class StateDictError(ValueError, RuntimeError):
    """A state dict that does not fit its module, every problem named, nothing loaded: a ValueError, as headwise's loaders
    raise, and a RuntimeError, as ``torch.nn.Module.load_state_dict`` raises."""


def check_loadable(module: nn.Module, state: Mapping[str, Tensor]) -> None:
    """``check_state`` for ``module.load_state_dict(state)``: raises ``StateDictError`` naming every problem; loads nothing."""
    try:
        check_state(module, state, source=f"this state dict into {type(module).__name__}")
    except ValueError as e:
        raise StateDictError(str(e)) from None


def keeps_keys(hook: Callable) -> Callable:
    """Mark a load_state_dict pre-hook that keeps every entry's key and shape (it may drop an entry the check treats as
    optional, or replace a tensor by one of the same shape): the check before the hook still says what loads."""
    _KEY_KEEPING.add(hook)
    return hook


def _checkable(module: nn.Module) -> bool:
    """Whether every load pre-hook of ``module`` and its modules is one ``keeps_keys`` marked (or a partial of one)."""
    return all(_unwrapped(h) in _KEY_KEEPING for m in module.modules() for h in m._load_state_dict_pre_hooks.values())


def _unwrapped(hook: Callable) -> Callable:
    """The function behind torch's wrapper of a registered hook and any ``functools.partial`` around it."""
    hook = getattr(hook, "hook", hook)
    while isinstance(hook, partial):
        hook = hook.func
    return hook


class AllOrNothing:
    """Mixin for an ``nn.Module``: ``load_state_dict`` checks the whole state dict first when strict (module docstring)."""

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """torch's ``load_state_dict``, all-or-nothing when ``strict``: ``StateDictError`` (a ValueError and a
        RuntimeError, as torch raises) names every missing, unexpected, mis-shaped or mis-typed entry (an integer for a
        float, anything but its own dtype for an integer one) before
        any tensor is copied (torch's own load copies the entries that fit first)."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping of names to tensors (module.state_dict()), got {type(state_dict).__name__}")
        if strict and _checkable(self):
            check_loadable(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)
