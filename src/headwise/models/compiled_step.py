"""``generate(..., compile=True)``'s step: the decode step under ``torch.compile``, on the CPU with its weights frozen.

On the CPU the step is compiled with inductor's ``freezing`` and ``max_autotune``: the weights
become constants of the graph, packed once when it is compiled. Where torch's kernels run AVX-512
the float32 projections (and the bfloat16 ones on CPUs with AVX512-BF16) are traced as headwise's
panels GEMM (``linear.panels``), whose packing inductor's constant folding does; the others as plain
``F.linear`` and int8 GEMMs, which inductor packs for its own GEMM kernels (C++ micro-kernels for
AVX-512, AMX, AVX2, timed at compile against ATen's and kept where faster; a float32 projection of
one row takes inductor's, never MKL's: ``projection.freezing``). Neither is one of headwise's opaque
ops that decide when they run (``projection.frozen()``). A frozen graph cannot see a weight change,
so the step is kept with the state of every parameter and buffer (``weight_cache.state``) and
compiled anew when any changed (an optimizer step, ``load_state_dict``, ``.data =``). Inductor
keeps its packed copies of the weights beside the model's own while the step lives. Each compiled
step runs a code object of its own, where Dynamo keeps its graphs: they are dropped with the step (a
step compiled anew frees the old weights' copies), and one model's graphs do not count against
another's ``recompile_limit``.

Elsewhere (CUDA, inference tensors, which have no version counter, torch.distributed) the step is
compiled as it is, its projections opaque ops (``linear.custom_ops``). A CPU model whose weights are
inference tensors (made or loaded under ``torch.inference_mode()``) is told so once, with a warning:
its steps run without the frozen weights' kernels, and building it outside inference mode gives them back.

Dynamo guards every graph on what its tracing read: on the model, thousands of checks of its modules
(each one's class, hooks, attributes, parameters) run before every step. A frozen step run
unchecked (a model without hooks, in eval mode: ``generate.trusts``) is kept with the model's
``structure`` as well (each module's class, attributes by value, read once a ``generate`` call) and
compiled anew when it changed, so Dynamo's own checks of the modules are dropped
(``guard_filter_fn``); its checks of the step's arguments (the ids, the positions, the caches'
tensors and lengths) and of global state stay. A model holding something ``structure`` cannot
compare by value, and a step compiled anew because the modules changed, keep Dynamo's checks.

Inductor's settings are per thread from torch 2.12 on. Before, ``freezing`` is one value for the whole
process: a frozen step running in one thread would freeze another thread's compile (whose weights may
change) and, ending, unfreeze the other's frozen step. There the compiled steps take turns (one lock).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import enum
import threading
import types
import warnings
import weakref
from functools import partial

import torch
import torch.fx.experimental._config as fx_config  # Dynamo's symbolic shapes' settings
from torch import Tensor, nn

from ..linear import projection
from ..linear.weight_cache import state, verify, watch, watchable


def config_per_thread() -> bool:
    """Whether inductor's settings are per thread (torch 2.12 on: each one a ``ContextVar``)."""
    import torch._inductor.config as inductor

    entry = getattr(inductor, "_config", {}).get("freezing")
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


#: Entered around every compiled step's run: nothing where each thread has its own settings, else one lock.
TURNS: contextlib.AbstractContextManager = contextlib.nullcontext() if config_per_thread() else threading.RLock()


def compiled_step(model: nn.Module, key: object, step: partial, trusted: bool = False) -> CompiledStep:
    """``step`` under ``torch.compile``, kept on the model under ``key`` and reused while its frozen weights are the
    model's (compiled anew when any parameter or buffer changed) and, for a ``trusted`` step (run unchecked: no
    hooks, eval mode, ``generate.trusts``), while it tracks them, its modules' ``structure``.

    The first time the modules alone changed, the step is compiled anew with Dynamo's own checks of the modules and
    ``structure`` is no longer read for it: a model that changes an attribute between calls pays one compile, as it
    would under Dynamo's checks, not one a call."""
    steps = model.__dict__.setdefault("_compiled_steps", {})  # plain attribute: not a submodule, not in state_dict
    tensors = [*model.parameters(), *model.buffers()]
    # frozen where a change can be seen: CPU tensors with version counters (not inference tensors), not under torch.distributed
    freeze = watchable() and bool(tensors) and all(t.device.type == "cpu" and not t.is_inference() for t in tensors)
    kept = steps.get(key)
    tracked = trusted and (kept is None or (kept[0] is not None and kept[0][1] is not None))
    if freeze:  # the frozen graph's weights: a write through .data since the last look moves their epochs first
        verify()
        watch(tensors)
    now = (state(tensors), structure(model) if tracked else None) if freeze else None
    if kept is None or kept[0] != now:
        if now is not None and now[1] is not None and kept is not None and kept[0] is not None and kept[0][0] == now[0]:
            now = (now[0], None)  # only the modules changed: Dynamo's checks of them from now on
        if not freeze and watchable() and all(t.device.type == "cpu" for t in tensors) and any(t.is_inference() for t in tensors):
            warnings.warn(
                "compile=True: the model's parameters are inference tensors (made or loaded under torch.inference_mode()), "
                "which have no version counter, so the compiled step cannot freeze them and runs without inductor's kernels "
                "for the frozen weights (slower); build or load the model outside inference mode, and decode inside it",
                UserWarning, stacklevel=4,
            )
        steps[key] = kept = (now, CompiledStep(step, freeze, known=now is not None and now[1] is not None))
    return kept[1]


#: Types whose values ``structure`` compares as they are.
_PLAIN = frozenset({bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format})
#: Containers an empty one of which ``structure`` compares by type alone.
_CONTAINERS = frozenset({dict, collections.OrderedDict, list, tuple, set, frozenset})
#: Callables ``structure`` compares by identity: builtins, functions without a closure, a module's methods (a
#: closure's cells, another object's attributes may change unseen: such a callable is opaque).
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)


class _OpaqueError(Exception):
    """An attribute ``structure`` cannot compare by value."""


def structure(model: nn.Module) -> tuple | None:
    """What a traced step reads from ``model`` besides its weights' values, for comparing two calls: each module
    (by identity, in order), its classes' attributes (by identity), its own attributes by value (a tensor by
    ``state``, containers and plain objects walked, a submodule by identity: it has its own entry), which takes
    in its hooks, training flag and config. An object's attributes named in its class's ``untraced`` (caches
    its eager calls keep, never read under ``torch.compile``) are left out. None where an attribute holds
    something else (or an inference tensor)."""
    try:
        modules = tuple([(id(m), type(m), _fields(m, 0)) for m in model.modules()])
    except _OpaqueError:
        return None
    return modules, tuple([_class(c) for c in dict.fromkeys(c for m in modules for c in m[1].__mro__) if c not in _BASES])


#: Classes whose attributes ``structure`` does not compare (their methods are torch's own).
_BASES = frozenset({object, nn.Module})


#: Class attributes Python writes on first use, which no step reads: ``copyreg``'s ``__slotnames__`` (the first copy or
#: pickle of an instance), an empty ``__annotations__`` (the first read of a class that has none).
_LAZY = frozenset({"__slotnames__", "__annotations__"})


def _class(cls: type) -> tuple:
    """``cls`` with the identity of each attribute it defines (a method replaced is seen), less ``_LAZY``'s."""
    return cls, tuple([(k, id(v)) for k, v in vars(cls).items() if k not in _LAZY])


def _fields(obj: object, depth: int) -> tuple:
    """``obj``'s own attributes by value, less the steps kept on a model and its class's ``untraced`` caches."""
    skip = getattr(type(obj), "untraced", ())
    return tuple([
        (k, (t, v) if (t := type(v)) in _PLAIN else (t,) if t in _CONTAINERS and not v else _value(v, depth))  # the common cases inline
        for k, v in vars(obj).items() if k != "_compiled_steps" and k not in skip
    ])


def _value(v: object, depth: int) -> object:
    """``v`` as a value to compare (see ``structure``); raises ``_OpaqueError`` for what it cannot compare."""
    t = type(v)
    if t in _PLAIN or isinstance(v, enum.Enum):
        return t, v
    if t in _CONTAINERS and not v:  # most of a module's: its empty hook dicts
        return (t,)
    if isinstance(v, Tensor):
        if v.is_inference():  # no version counter: an in-place write would go unseen
            raise _OpaqueError
        return id(v), *state([v])[0]
    if isinstance(v, nn.Module):
        return t, id(v)
    if isinstance(v, _CALLABLES):
        owner = getattr(v, "__self__", None) if t is types.MethodType else None  # a method's object, walked nowhere else
        if getattr(getattr(v, "__func__", v), "__closure__", None) is not None or not (owner is None or isinstance(owner, nn.Module)):
            raise _OpaqueError
        return t, id(v), id(owner)
    if depth > 4:
        raise _OpaqueError
    if isinstance(v, partial):
        return t, _value(v.func, depth + 1), _value(v.args, depth + 1), _value(v.keywords, depth + 1)
    if isinstance(v, dict):
        if any(type(k) not in _PLAIN for k in v):
            raise _OpaqueError
        return t, tuple([(k, _value(x, depth + 1)) for k, x in v.items()])
    if isinstance(v, (tuple, list)):
        return t, tuple([_value(x, depth + 1) for x in v])
    if isinstance(v, (set, frozenset)):
        return t, frozenset([_value(x, depth + 1) for x in v])
    if t.__module__ != "builtins" and hasattr(v, "__dict__") and not hasattr(t, "__slots__"):
        return _class(t), _fields(v, depth + 1)  # a config object, a shared helper (RoPE): its class and fields
    raise _OpaqueError


class CompiledStep:
    """A decode step under ``torch.compile(fullgraph=True, dynamic=True)``; with ``freeze``, inductor's freezing and
    max-autotune, on whenever it runs (a new shape may recompile at any call).

    Dynamo compiles ``func``, a copy of the step's function with a code object of its own, called with the
    step's bound arguments (the model): Dynamo keeps a code object's graphs on it, so they count against
    this step's own ``recompile_limit``, not against every other model's, and are dropped with the step.
    """

    def __init__(self, step: partial, freeze: bool, known: bool = False) -> None:
        func = step.func
        self.func = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
        self.args, self.freeze, self.known = step.args, freeze, known
        options = {"max_autotune": True} if freeze else {}
        if known and hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):  # the modules' state is compared by compiled_step
            options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        self.compiled = torch.compile(self.func, fullgraph=True, dynamic=True, options=options or None)
        # the code object outlives the step (Dynamo's look-up caches hold code objects): its graphs, and the
        # frozen weights' copies in them, are dropped when the step goes (compiled anew, or its model gone)
        weakref.finalize(self, torch._dynamo.reset_code, self.func.__code__)

    def __call__(self, *args: object) -> Tensor:
        with TURNS, projection.freezing() if self.freeze else contextlib.nullcontext():
            # no duck sizing: a first call whose cache length or batch equals a size of the model (head_dim, heads)
            # would tie the two into one symbol, and the next call of another length would compile again (set and
            # restored as a plain attribute: a config patch costs tens of microseconds a step)
            duck, fx_config.use_duck_shape = fx_config.use_duck_shape, False
            try:
                return self.compiled(*self.args, *args)
            finally:
                fx_config.use_duck_shape = duck
