"""``generate(..., compile=True)``'s step: the decode step under ``torch.compile``, on the CPU with its weights frozen.

On the CPU the step is compiled with inductor's ``freezing`` and ``max_autotune``: the weights
become constants of the graph, so inductor packs each projection's weight once for its own GEMM
kernels (C++ micro-kernels for AVX-512, AMX, AVX2, timed at compile against ATen's and kept where
faster), and the projections are traced as plain ``F.linear`` and int8 GEMMs for it
(``projection.frozen()``), not as headwise's opaque ops. A frozen graph cannot see a weight change,
so the step is kept with the state of every parameter and buffer (``weight_cache.state``) and
compiled anew when any changed (an optimizer step, ``load_state_dict``, ``.data =``). Inductor
keeps its packed copies of the weights beside the model's own while the step lives. Each compiled
step runs a code object of its own, where Dynamo keeps its graphs (guarded by the identity of each
frozen weight): they are dropped with the step (a step compiled anew frees the old weights' copies),
and one model's graphs do not count against another's ``recompile_limit``.

Elsewhere (CUDA, inference tensors, which have no version counter, torch.distributed) the step is
compiled as it is, its projections opaque ops (``linear.custom_ops``). A CPU model whose weights are
inference tensors (made or loaded under ``torch.inference_mode()``) is told so once, with a warning:
its steps run without the frozen weights' kernels, and building it outside inference mode gives them back.

Inductor's settings are per thread from torch 2.12 on. Before, ``freezing`` is one value for the whole
process: a frozen step running in one thread would freeze another thread's compile (whose weights may
change) and, ending, unfreeze the other's frozen step. There the compiled steps take turns (one lock).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import types
import warnings
import weakref
from functools import partial

import torch
from torch import Tensor, nn

from ..linear import projection
from ..linear.weight_cache import state, watchable


def config_per_thread() -> bool:
    """Whether inductor's settings are per thread (torch 2.12 on: each one a ``ContextVar``)."""
    import torch._inductor.config as inductor

    entry = getattr(inductor, "_config", {}).get("freezing")
    return isinstance(getattr(entry, "user_override", None), contextvars.ContextVar)


#: Entered around every compiled step's run: nothing where each thread has its own settings, else one lock.
TURNS: contextlib.AbstractContextManager = contextlib.nullcontext() if config_per_thread() else threading.RLock()


def compiled_step(model: nn.Module, key: object, step: partial) -> CompiledStep:
    """``step`` under ``torch.compile``, kept on the model under ``key`` and reused while its frozen weights are the
    model's (compiled anew when any parameter or buffer changed)."""
    steps = model.__dict__.setdefault("_compiled_steps", {})  # plain attribute: not a submodule, not in state_dict
    tensors = [*model.parameters(), *model.buffers()]
    # frozen where a change can be seen: CPU tensors with version counters (not inference tensors), not under torch.distributed
    freeze = watchable() and bool(tensors) and all(t.device.type == "cpu" and not t.is_inference() for t in tensors)
    now = state(tensors) if freeze else None
    kept = steps.get(key)
    if kept is None or kept[0] != now:
        if not freeze and watchable() and all(t.device.type == "cpu" for t in tensors) and any(t.is_inference() for t in tensors):
            warnings.warn(
                "compile=True: the model's parameters are inference tensors (made or loaded under torch.inference_mode()), "
                "which have no version counter, so the compiled step cannot freeze them and runs without inductor's kernels "
                "for the frozen weights (slower); build or load the model outside inference mode, and decode inside it",
                UserWarning, stacklevel=4,
            )
        steps[key] = kept = (now, CompiledStep(step, freeze))
    return kept[1]


class CompiledStep:
    """A decode step under ``torch.compile(fullgraph=True, dynamic=True)``; with ``freeze``, inductor's freezing and
    max-autotune, on whenever it runs (a new shape may recompile at any call).

    Dynamo compiles ``func``, a copy of the step's function with a code object of its own, called with the
    step's bound arguments (the model): Dynamo keeps a code object's graphs on it, so they count against
    this step's own ``recompile_limit``, not against every other model's, and are dropped with the step.
    """

    def __init__(self, step: partial, freeze: bool) -> None:
        func = step.func
        self.func = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__, func.__closure__)
        self.args, self.freeze = step.args, freeze
        self.compiled = torch.compile(self.func, fullgraph=True, dynamic=True, options={"max_autotune": True} if freeze else None)
        # the code object outlives the step (Dynamo's look-up caches hold code objects): its graphs, and the
        # frozen weights' copies in them, are dropped when the step goes (compiled anew, or its model gone)
        weakref.finalize(self, torch._dynamo.reset_code, self.func.__code__)

    def __call__(self, *args: object) -> Tensor:
        with TURNS, projection.freezing() if self.freeze else contextlib.nullcontext():
            return self.compiled(*self.args, *args)
