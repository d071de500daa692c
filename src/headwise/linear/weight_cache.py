"""Tensors made from weights (oneDNN's packed layout, the panels GEMM's, Q/K/V stacked into one), kept until a weight changes.

An entry is keyed by the ids of the tensors it was made from and remembers their state: storage
pointer, ``_version`` (bumped by in-place writes: optimizer steps, ``load_state_dict``), shape,
strides, dtype and ``epoch``. A lookup that finds another state makes the entry again; the entry dies
with its tensors. Under ``torch.distributed`` nothing is kept: FSDP2 refills its unsharded weights in
place, at the same address, without bumping ``_version``.

A write through ``p.data`` (an EMA's ``p.data.mul_``, a loader's ``p.data.copy_``) goes to a tensor
with a version counter of its own: ``_version`` does not see it. So each tensor a kept copy was made
from is watched (``watch``): a sample of its bytes is kept (a CPU tensor's first and last 64, read in
place; elsewhere its first and last element), and ``verify``, which every checked forward and every
``generate`` call runs before its projections, compares the samples and moves the ``epoch`` of a tensor
whose sample changed. A ``.data`` write that leaves both ends as they were (a few middle rows changed)
is not seen: write under ``torch.no_grad()`` instead, which bumps ``_version``. Where headwise's C++ library is loaded
(``native.loaded``), a contiguous CPU tensor's sample is kept there and every such sample compared in one call
(``linear/watched.cpp``): after a decode step has streamed the weights through the caches, reading them one by one
from Python took longer than some steps' arithmetic (a Llama's 255 weights: 0.5 ms).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import native
from .._checks import compiling

torch.library.define("headwise::watch_ends", "(Tensor t, int key) -> ()")  # t's ends kept in the library under key
torch.library.define("headwise::watch_forget", "(int key) -> ()")
torch.library.define("headwise::watched_changed", "() -> int[]")  # the keys whose ends changed (their new ends kept)

PACKED: dict[tuple[int], tuple] = {}  # (id(weight),) -> (its state, the weight in oneDNN's blocked layout)
STACKED: dict[tuple[int, ...], tuple] = {}  # ids of weights and biases -> (their state, what was stacked from them)
PANELS: dict[torch.dtype, dict] = {}  # rows' dtype -> {(id(weight),): (its state, the weight packed in panels for such rows)}
READY: dict[tuple, object] = {}  # (ids of layers, x's dtype and device, path setting) -> projection.Ready, a decode call decided once
WATCHED: dict[int, tuple] = {}  # id(tensor) -> (a weak reference to it, its storage pointer, its bytes or None, its sample)
NATIVE: dict[int, int] = {}  # id(tensor) -> its storage pointer, for a tensor whose sample the C++ library keeps
EPOCH: dict[int, int] = {}  # id(tensor) -> a number ``verify`` gives it each time it finds its sample changed (from _EPOCHS)
SERIAL: dict[int, int] = {}  # id(tensor) -> its ``serial``, dropped when the tensor dies
FINALIZERS: dict[int, list[weakref.finalize]] = {}  # id(tensor) -> what runs when it dies (``release`` runs them early)
_SERIALS = itertools.count(1)
_EPOCHS = itertools.count(1)  # never the same twice: a change seen late cannot bring back a number a stale copy holds
_moved = 0  # the last number ``verify`` gave a tensor (any tensor): ``Seen``'s one number for every tensor's epoch
_REGISTERING = threading.Lock()  # ``at_death``'s list of a tensor made once
_VERIFYING = threading.Lock()  # one ``verify`` at a time: its read, compare and update of a sample is one step
SPAN = 64  # bytes sampled at each end of a tensor
_scope = threading.local()  # .on: inside ``verified()``, where ``verify`` was run once already


def watchable() -> bool:
    """Whether a weight's storage pointer and ``_version`` tell every change (not under torch.distributed)."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def state(tensors: Sequence[Tensor]) -> tuple:
    """What changes when any of ``tensors`` is written or replaced (through ``.data`` too, once ``verify`` saw it): a
    tensor replaced by another is told apart by its ``serial`` even where the new one took the old one's address and id.
    An inference tensor keeps no version (a write under ``inference_mode`` leaves no trace): its state equals no other,
    so nothing made from it is reused."""
    try:
        return tuple([(t.data_ptr(), t._version, t.shape, t.stride(), t.dtype, EPOCH.get(id(t), 0), SERIAL.get(id(t)) or serial(t))
                      for t in tensors])
    except RuntimeError:  # an inference tensor's ``_version`` (the check only then: it would cost every call a tenth more)
        return tuple([(t.data_ptr(), object() if t.is_inference() else t._version, t.shape, t.stride(), t.dtype, EPOCH.get(id(t), 0),
                       SERIAL.get(id(t)) or serial(t)) for t in tensors])


class Seen:
    """Whether any tensor of ``modules`` (each one's own ``_parameters`` and ``_buffers``, read anew at each call: a
    tensor replaced counts) changed since the last ``same()``: what ``state`` compares (storage pointer, ``_version``,
    shape, strides, dtype, the tensor itself: a new one at a freed one's address differs, and a ``.data`` write that
    ``verify`` saw). The first call answers False, and so does every call where a tensor is an inference tensor, a
    tensor subclass or not strided; a ``.data`` write to another module's weight may too, once.

    Where headwise's C++ library is loaded, one call (``linear/seen.cpp``): a decode step asks this of each layer's some
    twenty tensors every step, which from Python (``state``) took about 40 µs a layer. Eager only.
    """

    def __init__(self, modules: Sequence[torch.nn.Module]) -> None:
        self.modules = tuple(modules)
        self.last: tuple | None = None  # the state seen last, without the library
        self.native: Callable | None = None
        if native.loaded():
            self.native = native.function("headwise_seen_same", ctypes.c_int, ctypes.c_int64, ctypes.py_object, ctypes.c_int64)
            self.key = native.keyed(self, "headwise_seen_forget")  # (its entry in the library's table, dropped with this object)

    def same(self) -> bool:
        """True where nothing changed since the last call (the first call: False)."""
        if self.native is not None:
            return self.native(self.key, self.modules, _moved) == 1  # (``_moved``: every tensor's epoch in one number)
        now = state([t for m in self.modules for own in (m._parameters, m._buffers) for t in own.values() if t is not None])
        same, self.last = now == self.last, now
        return same


def serial(t: Tensor) -> int | None:
    """A number no other tensor got (kept while ``t`` lives; None inside a graph being traced): a new tensor that lands at
    a freed one's address, with its id, version, shape and dtype (a weight replaced twice), still differs from it."""
    key = id(t)
    number = SERIAL.get(key)
    if number is None and not compiling():
        number = SERIAL[key] = next(_SERIALS)
        at_death(t, SERIAL.pop, key, None)
    return number


def sample(t: Tensor) -> tuple[int | None, bytes | tuple]:
    """(bytes, a sample of ``t``'s contents): a contiguous CPU tensor's byte count and its first and last ``SPAN``
    bytes, read in place (``_ends``); another's None and its first and last element, by bits (two host reads)."""
    if t.is_meta:
        return None, ()  # (no values)
    if is_traceable_wrapper_subclass(t):  # a DTensor (headwise.parallel) holds no storage at its pointer: its local shard's
        local = t.to_local() if hasattr(t, "to_local") else None  # (no byte count: ``verify`` asks this function again)
        return None, sample(local.detach())[1] if isinstance(local, Tensor) and not is_traceable_wrapper_subclass(local) else ()
    if t.device.type == "cpu" and t.is_contiguous():
        size = t.numel() * t.element_size()
        return size, _ends(t.data_ptr(), size)
    flat = t.detach().flatten()
    flat = flat.view(_BITS[flat.element_size()]) if flat.is_floating_point() and flat.element_size() in _BITS else flat  # NaN = NaN
    return None, tuple(flat[[0, -1]].tolist()) if flat.numel() else ()


def _ends(address: int, size: int) -> bytes:
    n = min(size, SPAN)
    return ctypes.string_at(address, n) + ctypes.string_at(address + size - n, n)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}  # a float's size -> the integer dtype of its bits


def watch(tensors: Sequence[Tensor]) -> None:
    """Keep a sample of each of ``tensors`` for ``verify`` (again where its storage moved); dropped with the tensor."""
    if compiling():
        return
    for t in tensors:
        key = id(t)
        known = NATIVE.get(key, WATCHED[key][1] if key in WATCHED else None)  # its storage pointer when watched
        if t.is_meta or known == t.data_ptr():
            continue
        if known is None:
            at_death(t, _forget, key)
        size, seen = sample(t)
        if size and native.loaded():  # a non-empty contiguous CPU tensor: its ends kept by the library
            WATCHED.pop(key, None)
            torch.ops.headwise.watch_ends(t, key)
            NATIVE[key] = t.data_ptr()
        else:
            if NATIVE.pop(key, None) is not None:
                torch.ops.headwise.watch_forget(key)
            WATCHED[key] = (weakref.ref(t), t.data_ptr(), size, seen)


def at_death(t: object, func: Callable, *args: object) -> None:
    """``func(*args)`` when ``t`` (a tensor, a module) dies, or at ``release([t])``."""
    key = id(t)
    with _REGISTERING:  # (two threads' first finalizers of one tensor in one list: ``release`` finds them all)
        held = FINALIZERS.get(key)
        if held is None:
            held = FINALIZERS[key] = [weakref.finalize(t, FINALIZERS.pop, key, None)]
        held.append(weakref.finalize(t, func, *args))


def release(tensors: Iterable[object]) -> None:
    """Drop what is kept for ``tensors`` (their packed and stacked copies, their samples) and every weak reference to
    them, as if they had died: ``torch.utils.swap_tensors`` refuses a tensor that has one, so a module converted or
    loaded by swapping (``torch.__future__.set_swap_module_params_on_conversion(True)``) after a headwise call is
    released first (``headwise.linear.release(module)``). The next call makes the copies again."""
    for t in tensors:
        key = id(t)
        for finalizer in FINALIZERS.pop(key, ())[::-1]:  # (run: its callback once, its weak reference dropped)
            finalizer()
        _forget(key)  # its weak references


def _forget(key: int) -> None:
    WATCHED.pop(key, None)
    EPOCH.pop(key, None)
    if NATIVE.pop(key, None) is not None:
        with suppress(Exception):  # (a finalizer run as the interpreter exits, after torch's ops are gone)
            torch.ops.headwise.watch_forget(key)


def verify() -> None:
    """Compare every watched tensor with its sample: a changed one's ``epoch`` moves, so each copy made from it is made
    again at its next use. Eager only (a graph reads no sample); inside ``verified()``, nothing (it ran once there)."""
    if compiling() or not (WATCHED or NATIVE) or getattr(_scope, "on", False):  # (a graph must not read the dicts)
        return
    with _VERIFYING:  # (threads sharing a model: a sample or an epoch written back late would hide a change for good)
        if NATIVE:
            for key in torch.ops.headwise.watched_changed():
                _move(key)
        for key, (ref, address, size, seen) in _entries(WATCHED):
            t = ref()
            if t is None or t.data_ptr() != address:  # gone, or its storage replaced: ``state`` sees that
                continue
            now = _ends(address, size) if size is not None else sample(t)[1]
            if now != seen:
                WATCHED[key] = (ref, address, size, now)
                _move(key)


def _move(key: int) -> None:
    """A new epoch for the tensor of id ``key`` (under ``_VERIFYING``)."""
    global _moved
    EPOCH[key] = _moved = next(_EPOCHS)


def _entries(table: dict) -> list:
    """``list(table.items())``, taken again where the dict changed while it was read: a collection that the copy's own
    allocations started can free a watched tensor, whose finalizer (``_forget``) drops its entry mid-copy."""
    while True:
        try:
            return list(table.items())
        except RuntimeError:  # "dictionary changed size during iteration"
            continue


def checking(check: bool) -> AbstractContextManager:
    """``verified()`` for a checked eager forward; otherwise (unchecked, or traced by ``torch.compile``) nothing."""
    return verified() if check and not compiling() else nullcontext()


@contextmanager
def verified() -> Iterator[None]:
    """``verify()`` once, then the block, where the calls of its own are skipped (a model's layers, in its forward).
    Eager only: a traced forward uses ``contextlib.nullcontext()`` instead (``checking``)."""
    if getattr(_scope, "on", False):
        yield
        return
    verify()
    _scope.on = True
    try:
        yield
    finally:
        _scope.on = False


def cached(cache: dict, owners: Sequence[Tensor], make: Callable[[], object]) -> Any:
    """``make()``'s value for these tensors, made again whenever any of them changed; the entry dies with them."""
    if not watchable():
        return make()
    ids, now = tuple(map(id, owners)), state(owners)
    entry = cache.get(ids)
    if entry is None:
        for t in owners:
            at_death(t, cache.pop, ids, None)
    if entry is None or entry[0] != now:
        watch(owners)
        entry = cache[ids] = (now, make())
    return entry[1]
