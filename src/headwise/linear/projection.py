"""``linear``, ``project`` and ``project_many``: the projections' entry points, on the path ``rule`` picks.

``linear`` is ``F.linear`` with the same numbers (to float32 rounding), on the path ``rule.path_for`` names. ``project`` runs a layer
through it when the layer is a plain ``nn.Linear``; ``project_many`` runs several layers that
read one input as one GEMM over their stacked weights. While ``torch.compile`` traces an
inference call (no autograd), both become opaque ops (``custom_ops``) that decide their path and
stack their weights when the graph runs, unless the graph freezes its weights (``frozen()``): then
they are ``panels.linear`` where it takes the operands (float32 on AVX-512, bfloat16 with
AVX512-BF16), else ``F.linear``; inductor packs the frozen weights for either once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as _module  # its global hook registries, read on every project()

from .._checks import compiling, transformed
from . import onednn, panels, weight_cache
from .onednn import DTYPES, plain_tensors, recorded
from .rule import DECODE_ROWS, GEMV_ROWS, _path_setting, path_for, under_cpu_autocast
from .weight_cache import READY, STACKED, at_death, cached, state, watch, watchable

_frozen = threading.local()  # .on: this thread runs a graph whose weights inductor freezes (``freezing``)


def frozen() -> bool:
    """Whether this thread runs a graph whose weights inductor freezes into constants (``models.compiled_step``): its
    projections are traced as ``panels.linear`` or ``F.linear``, whose weights are packed once when the graph is
    compiled, not as opaque ops."""
    return getattr(_frozen, "on", False)


@contextmanager
def freezing() -> Iterator[None]:
    """``frozen()`` and inductor's ``freezing`` on in this thread while the block runs, then as they were. Both are
    read when Dynamo traces and inductor compiles (not from ``torch.compile``'s options). ``frozen()`` is per
    thread; inductor's settings are from torch 2.12 on (before, ``models.compiled_step.TURNS`` makes compiled
    steps take turns), so a step in one thread leaves another thread's compiles unfrozen. What inductor compiles
    meanwhile runs its own GEMM, not MKL's, for a float32 projection where it has one (``_template_over_mkl``)."""
    import torch._inductor.config as inductor
    from torch._inductor import select_algorithm as choosing

    selector = getattr(choosing, "get_algorithm_selector_cache", None)  # an older torch without it: autotune chooses
    if selector is not None and _template_over_mkl not in selector().preprocessing_fns:
        choosing.add_preprocessing_fn(_template_over_mkl)  # once a process (again if someone cleared them)
    before = frozen(), inductor.freezing
    _frozen.on = inductor.freezing = True
    try:
        yield
    finally:
        _frozen.on, inductor.freezing = before


def _template_over_mkl(choices: list) -> list:
    """Inductor's GEMM choices for one projection, without MKL's packed float32 GEMM wherever a kernel of inductor's
    own (its C++ GEMM template) is among them, in a graph compiled under ``freezing()``; other compiles' pass unchanged.

    Freezing turns a float32 ``F.linear`` of a fixed row count (one decode row) into MKL's packed GEMM, and
    max-autotune times it against the template once, at the first compile, and caches the winner. The template
    wins that timing on every projection measured, but one timing that favours MKL (a busy host) keeps MKL, slower
    in the step, for as long as inductor's cache lives (the decoding performance page has the numbers). Left out of
    the timing, the choice is the same on every run."""
    from torch._inductor.select_algorithm import ExternKernelCaller

    if not frozen() or all(isinstance(c, ExternKernelCaller) for c in choices):  # no kernel of inductor's own to run
        return choices
    return [c for c in choices if getattr(getattr(c, "choice", None), "cpp_kernel_name", None) != "mkl::_mkl_linear"]


GELUS = ("none", "tanh")  # GELU's approximate values linear's gelu takes (nn.GELU's)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, gelu: str | None = None) -> Tensor:
    """``F.linear`` with the same numbers (to float32 rounding), on the path ``path_for`` names.

    Args:
        x: (..., K) input, e.g. (B, T, C).
        weight: (N, K), PyTorch's ``nn.Linear`` layout.
        bias: (N,) or None.
        gelu: None, or GELU's ``approximate`` ("none", "tanh") to return ``F.gelu`` of the result: on the panels'
            and oneDNN's paths (without autograd) computed by the GEMM on its float32 sums, one pass over the output,
            not two; elsewhere ``F.gelu`` after the GEMM.

    Returns:
        (..., N).

    Raises:
        ValueError: ``gelu`` is not None, "none" or "tanh". The operands are not checked here (it runs for every
            projection of every step): like ``F.linear``, tensors of mismatched sizes or dtypes raise torch's errors.

    Example:
        >>> lin = torch.nn.Linear(768, 2304)
        >>> linear(torch.randn(4, 128, 768), lin.weight, lin.bias).shape
        torch.Size([4, 128, 2304])
    """
    if gelu is not None and gelu not in GELUS:
        raise ValueError(f"gelu must be None or GELU's approximate, one of {GELUS}, got {gelu!r}")
    if compiling():
        if frozen():
            if panels.takes(x, weight, bias):
                return _then(panels.linear(x, weight, bias), gelu)  # (..., N): the weight packed once, when the graph is compiled
            return _then(F.linear(x, weight, bias), gelu)  # (..., N): inductor packs the frozen weight for its own GEMM
        if weight.ndim == 2 and runs_as_op(x, weight, bias):
            return _then(torch.ops.headwise.linear(x, weight, bias), gelu)  # (..., N): this function, run when the graph runs
    path = path_for(x, weight, bias)
    if path == "panels":
        return panels.run(x, weight, bias, gelu)  # (..., N): the weight packed once, kept while unchanged
    if path == "torch":
        return _then(F.linear(x, weight, bias), gelu)
    if path == "widened":
        return _then(widened(x, weight, bias), gelu)  # (..., N)
    return onednn.run(x, weight, bias, gelu)  # (..., N)


def widened(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` of bfloat16 operands as a float32 GEMM of them widened (the products exact), the sums plus the bias
    rounded once to x's dtype, as torch's bfloat16 GEMM rounds them: (..., K) x (N, K) (+ (N,)) -> (..., N)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)  # (..., N)


def _then(y: Tensor, gelu: str | None) -> Tensor:
    """``linear``'s result off oneDNN's eager path, with its GELU when asked (a graph's: inductor fuses it as it likes)."""
    return y if gelu is None else F.gelu(y, approximate=gelu)


def runs_as_op(x: Tensor, *params: Tensor | None) -> bool:
    """Whether a call traced by ``torch.compile`` runs as one of ``custom_ops``' ops: plain CPU tensors of a dtype
    oneDNN takes, no autograd (shape, dtype, device, grad mode and requires_grad become the graph's guards, not the rows)."""
    tensors = [t for t in (x, *params) if t is not None]
    if not plain_tensors(*tensors) or any(t.device.type != "cpu" or t.dtype != x.dtype for t in tensors) or x.dtype not in DTYPES:
        return False
    return not recorded(*tensors)


def project(layer: nn.Module, x: Tensor, act: nn.Module | None = None) -> Tensor:
    """``layer(x)`` for a projection layer, through ``linear`` when the layer is a plain ``nn.Linear``;
    ``act(layer(x))`` when given an activation module.

    A subclass, a replaced module (LoRA, quantised) or one with hooks is called as it is, so
    whatever it adds still happens. A plain ``nn.GELU`` without hooks after a plain ``nn.Linear``
    is ``linear``'s ``gelu``: inside the GEMM on the panels' and oneDNN's paths, at every row count alike.

    Args:
        layer: usually an ``nn.Linear`` with weight (N, K).
        x: (..., K).
        act: None, or the activation applied to the result (GPT-2's and BERT's MLP pass their GELU).

    Returns:
        (..., N).
    """
    gelu = _gelu(act) if act is not None and _plain(layer) else None
    if act is not None and gelu is None:
        return act(project(layer, x))  # (..., N)
    if (ready := _ready((layer,), x, gelu)) is not None:
        return ready(x)  # (..., N)
    if not _plain(layer):
        return layer(x)
    return linear(x, layer.weight, layer.bias, gelu=gelu)  # (..., N)


def _gelu(act: nn.Module) -> str | None:
    """GELU's ``approximate`` when ``act`` is a plain ``nn.GELU`` without hooks (``linear`` computes it), else None."""
    return act.approximate if type(act) is nn.GELU and _hookless(act) and act.approximate in GELUS else None


def project_many(layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """``[project(layer, x) for layer in layers]`` as one GEMM, on either path, where that is safe.

    When every layer is a plain, hook-free ``nn.Linear`` with weights of one dtype and device,
    all with a bias or all without, the weights are stacked into one (sum N, K) weight and x is
    read once: one GEMM instead of, say, three for Q, K, V. Under autograd (and when
    ``torch.compile`` traces) the stacking is a ``torch.cat`` in the graph, so every weight gets its gradient; without it the stack is made
    once and remade when any weight or bias changes (``_version``). The results are views of one
    (..., sum N) tensor. Otherwise (or for inference tensors, which have no version, and tensor
    subclasses such as DTensor, which shard their own way) each layer runs alone. Layers of one
    class with a ``stack(layers)`` classmethod (``headwise.quantize.Int8Linear``), none hooked,
    run the same way: one stacked layer, made once and remade when any of their tensors changes (in a graph whose
    weights inductor freezes, the class's ``frozen_stack(layers, x)`` where it has one, else each layer).

    Args:
        layers: layers with weights (N_i, K).
        x: (..., K).

    Returns:
        one (..., N_i) tensor per layer.
    """
    if (ready := _ready(layers, x)) is not None:
        return list(ready(x).split_with_sizes(ready.sizes, -1))  # (..., N_i) each (Tensor.split, less its Python)
    _same_width(layers, x)
    if len(layers) > 1 and _stackable(layers):
        return _project_stacked(layers, x)
    if len(layers) < 2 or _global_module_hooks() or not all(type(layer) is nn.Linear and _unhooked(layer) for layer in layers):
        return [project(layer, x) for layer in layers]
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers]
    params = [t for t in (*weights, *biases) if t is not None]
    dtype, device = params[0].dtype, params[0].device
    mixed = (any(b is None for b in biases) and any(b is not None for b in biases)) or any(t.dtype != dtype or t.device != device for t in params)
    if mixed or not plain_tensors(x, *params):
        return [project(layer, x) for layer in layers]
    sizes = [w.shape[0] for w in weights]
    if compiling() and not frozen() and runs_as_op(x, *params):
        y = torch.ops.headwise.linear_many(x, weights, [] if biases[0] is None else biases)  # (..., sum N), stacked when it runs
    elif compiling() or recorded(x, *params):
        y = linear(x, torch.cat(weights), None if biases[0] is None else torch.cat(biases))  # (..., sum N): every weight gets its gradient
    elif any(t.is_inference() for t in params):
        return [project(layer, x) for layer in layers]
    else:
        y = linear(x, *_stacked(weights, biases))  # (..., sum N)
    return list(y.split(sizes, dim=-1))  # (..., N_i) each


def _same_width(layers: Sequence[nn.Module], x: Tensor) -> None:
    """A ValueError naming the first layer whose (N, K) weight does not take x (..., K) (a stacked weight's error would
    name none of them)."""
    if not isinstance(x, Tensor) or not x.ndim:
        return  # (each layer's own call says what is wrong with x)
    k = x.shape[-1]
    for i, layer in enumerate(layers):
        own = getattr(layer, "_parameters", {}), getattr(layer, "_buffers", {})  # stored, not ``layer.weight``: a
        w = own[0].get("weight", own[1].get("weight"))  # parametrization would run one more step of its own there
        if isinstance(w, Tensor) and w.ndim == 2 and w.shape[1] != k:
            raise ValueError(f"layers[{i}] takes x (..., K={w.shape[1]}) (its weight is {tuple(w.shape)}), but x has shape "
                             f"{tuple(x.shape)}: project_many's layers share one input width, x's last dimension")


class Ready:
    """A decode-shaped inference call of some layers, decided and prepared once: the function, what it takes after x
    (the packed, stacked weight and bias; for layers of a class with ``decode_call``, what that gives), the output
    sizes; valid while ``state`` holds."""

    __slots__ = ("args", "k", "run", "sizes", "state")

    def __init__(self, state: tuple, run: Callable, args: tuple, k: int, sizes: list[int]) -> None:
        self.state, self.run, self.args, self.k, self.sizes = state, run, args, k, sizes

    def __call__(self, x: Tensor) -> Tensor:
        return self.run(x.contiguous(), *self.args)  # (..., sum N)

    def gemm(self) -> tuple[Callable, tuple]:
        """The GEMM's function and what it takes after x, without a GELU run over its output after it (``linear``'s
        ``gelu`` on torch's path); a GELU inside the GEMM (the panels', oneDNN's) stays."""
        if self.run is _linear_gelu:
            return F.linear, self.args[:-1]
        return self.run, self.args


class _Steps(threading.local):
    """``kept``: the decisions of a decode loop's steps in this thread (``planned``), None outside one. A class default, so
    that the attribute always exists: a compiled step's guard on it holds before and after an eager loop."""

    kept: dict | None = None


_steps = _Steps()


@contextmanager
def planned(kept: dict) -> Iterator[None]:
    """Inside the block, each decode-shaped call of a layer group (``_ready``) asks ``kept`` first: the decision its
    first call made (a ``Ready``, or None for the full path), made once and valid while the group's tensors have the
    ``state`` it was made from (a weight written or replaced between steps: decided again), so the steps after the
    first ask nothing else. For a loop whose every step is the same call, as ``generate``'s flat step
    (``models.flat_step``) runs them: without autograd, eager, outside autocast, hooks and the path setting as they
    were at its first step (``generate`` decides such things once a call: ``models.generate.trusts``). ``kept``
    belongs to one loop."""
    before = _steps.kept
    _steps.kept = kept
    try:
        yield
    finally:
        _steps.kept = before


def planned_world() -> tuple:
    """What a ``planned`` loop's kept decisions assume beside their layers' tensors: CPU autocast off or on, the path
    setting (``set_path``, ``HEADWISE_LINEAR``) and oneDNN's switch. A loop that outlives one call (the ``Batcher``'s
    decode steps) starts its ``kept`` afresh when this changes."""
    return torch.is_autocast_enabled("cpu"), _path_setting(), torch.backends.mkldnn.enabled


def _ready(layers: Sequence[nn.Module], x: Tensor, gelu: str | None = None) -> Ready | None:
    """``_decide`` for this call, kept by ``planned``'s loop where one runs."""
    kept = _steps.kept
    if kept is None:
        return _decide(layers, x, gelu)
    key = (*map(id, layers), gelu, type(x), x.dtype, x.shape)
    if key in kept:
        ready = kept[key]
        if ready is None or ready.state == state(_read(layers)):
            return ready
    kept[key] = ready = _decide(layers, x, gelu)
    return ready


def kept_call(layers: Sequence[nn.Module], x: Tensor, act: nn.Module | None = None) -> Ready | None:
    """The call ``project_many(layers, x)`` (one layer: ``project(layer, x, act)``, with its GELU where ``project`` puts
    it inside) keeps for this x in a decode loop, valid while its ``state`` holds; None where it takes the full path."""
    gelu = _gelu(act) if act is not None and _plain(layers[0]) else None
    return _ready(layers, x, gelu)


def _read(layers: Sequence[nn.Module]) -> list[Tensor]:
    """Every tensor a kept call of ``layers`` reads, in ``state``'s order: plain ``nn.Linear`` layers' weights, then
    their biases; another class's own parameters and buffers, layer by layer."""
    if type(layers[0]) is nn.Linear:
        weights = [layer._parameters["weight"] for layer in layers]
        return [t for t in (*weights, *(layer._parameters["bias"] for layer in layers)) if t is not None]
    return [t for layer in layers for own in (layer._parameters, layer._buffers) for t in own.values() if t is not None]


def _decide(layers: Sequence[nn.Module], x: Tensor, gelu: str | None = None) -> Ready | None:
    """What ``project_many(layers, x)`` (or ``project``) computes for a decode-shaped inference call,
    prepared by the full path once and reused while nothing it was decided from changes; None when
    the call takes the full path.

    The fast way serves hook-free layers under no_grad / inference mode, eager, a plain strided x of
    1..``DECODE_ROWS`` rows: plain ``nn.Linear`` layers, and layers of one class that offers
    ``decode_call(layers, x)`` (``headwise.quantize.Int8Linear``): what its layers run for such an x,
    prepared, as (a function, what it takes after x), or None. It is keyed by the layers, x's dtype and device, whether x has at most
    ``GEMV_ROWS`` rows, the path setting, and remade when any of the layers' tensors changes
    (``weight_cache.state``); an inference tensor, a changing world (torch.distributed) or a weight
    that cannot be packed once never gets one. The numbers are the full path's: the same function on
    the same prepared weight (with ``gelu``, a plain ``nn.Linear``'s: the full path's GELU, kept apart from the plain call).
    """
    if not _decode_call(x) or _global_module_hooks():
        return None
    kind = type(layers[0])
    if any(type(layer) is not kind or not _unhooked(layer) for layer in layers):
        return None
    if kind is nn.Linear:
        weights = [layer._parameters["weight"] for layer in layers]
        biases = [layer._parameters["bias"] for layer in layers]
        return _kept(layers, _read(layers), x, lambda params: _prepare(weights, biases, x, params, gelu), gelu)
    decide = getattr(kind, "decode_call", None)
    if decide is None:
        return None
    return _kept(layers, _read(layers), x, lambda params: _decided(decide, layers, x, params))


def _decided(decide: Callable, layers: Sequence[nn.Module], x: Tensor, params: list[Tensor]) -> Ready | None:
    """``decide(layers, x)``'s (function, its arguments after x) as a ``Ready``; None where it gives None."""
    made = decide(layers, x) if plain_tensors(x, *params) else None
    if made is None:
        return None
    run, args = made
    return Ready(state(params), run, args, x.shape[-1], [layer.weight.shape[0] for layer in layers])


def ready_for(weights: Sequence[Tensor], biases: Sequence[Tensor | None], x: Tensor) -> Ready | None:
    """``_ready`` for a compiled graph's projection ops (``custom_ops``), which get the weights, not their
    layers: the same decision, keyed by the weight and bias tensors, which must be ``nn.Parameter``s."""
    if not _decode_call(x):
        return None
    params = [t for t in (*weights, *biases) if t is not None]
    return _kept(params, params, x, lambda params: _prepare(list(weights), list(biases), x, params))


def _decode_call(x: Tensor) -> bool:
    """An eager inference call of 1..``DECODE_ROWS`` rows of a plain strided x, outside the CPU's autocast (which casts
    the full path's operands, where a kept call's packed weight would not)."""
    if torch.is_grad_enabled() or compiling() or type(x) is not Tensor or x.layout is not torch.strided:
        return False
    if transformed(x):  # a forward-mode tangent on x: torch's ops carry it
        return False
    if under_cpu_autocast(x):
        return False
    return 0 < x.numel() <= DECODE_ROWS * x.shape[-1]


def _kept(owners: Sequence[object], params: list[Tensor], x: Tensor, prepare: Callable[[list[Tensor]], Ready | None],
          gelu: str | None = None) -> Ready | None:
    """The ``Ready`` kept for ``owners`` (the layers, or the tensors themselves) and this x (and ``gelu``), made by
    ``prepare(params)`` when missing or stale (``params``: every tensor the call reads, whose ``state`` it holds)."""
    rows = x.numel() // x.shape[-1]  # the rule may decide 1..GEMV_ROWS rows apart from the rest
    key = (*map(id, owners), x.dtype, x.device, rows <= GEMV_ROWS, _path_setting(), torch.backends.mkldnn.enabled, gelu)
    entry = READY.get(key)
    if entry is not None and entry.state == state(params) and entry.k == x.shape[-1]:
        return entry
    if not watchable() or any(t.is_inference() for t in params):
        return None
    # The state and the samples before anything is read from the tensors: a write (another thread's) landing while the
    # call is prepared leaves them older than the copies, which a later check then remakes; taken after, they could
    # match the write while the copies hold what was there before it, for good.
    now = state(params)
    watch(params)  # every tensor the kept call reads (an int8 layer's scales and bias, stacked copies): a write through .data is seen too
    made = prepare(params)
    if made is not None:
        made.state = now
        if entry is None:
            for owner in owners:
                at_death(owner, READY.pop, key, None)
        READY[key] = made
    return made


def _prepare(weights: list[Tensor], biases: list[Tensor | None], x: Tensor, params: list[Tensor], gelu: str | None = None) -> Ready | None:
    """The full path's decision for this call (with ``gelu``, ``linear``'s), as a ``Ready``; None where it would not
    run one prepared GEMM."""
    if any(type(t) is not nn.Parameter for t in params):
        return None  # a subclass (DTensor, ...) dispatches its own way
    if any(w.ndim != 2 or w.shape[1] != x.shape[-1] for w in weights):
        return None  # the full path raises its own error; nothing is kept from a call that cannot run
    if len({b is None for b in biases}) != 1 or any(t.dtype != params[0].dtype or t.device != params[0].device for t in params):
        return None
    weight, bias = (weights[0], biases[0]) if len(weights) == 1 else _stacked(weights, biases)
    sizes, k = [w.shape[0] for w in weights], x.shape[-1]
    path = path_for(x, weight, bias)
    if path == "widened":
        return None  # many rows only: nothing to prepare
    if path == "panels":
        args = (panels.packed(weight, x.dtype), None if bias is None else bias.detach().contiguous(), weight.shape[0])
        if gelu is None:
            return Ready(state(params), torch.ops.headwise.panels_linear, args, k, sizes)
        return Ready(state(params), torch.ops.headwise.panels_linear_gelu, (*args, gelu), k, sizes)
    if path == "torch":
        # aliases, not the Parameters: an entry keyed by the weights themselves must not keep them alive
        args = (weight.detach(), None if bias is None else bias.detach())
        return Ready(state(params), F.linear, args, k, sizes) if gelu is None else Ready(state(params), _linear_gelu, (*args, gelu), k, sizes)
    ready = onednn.packed(weight)
    if ready is weight:  # not packed once: nothing to keep
        return None
    args = (ready, None if bias is None else bias.detach().contiguous())
    if gelu is None:
        return Ready(state(params), onednn.inner_product, args, k, sizes)
    return Ready(state(params), onednn.inner_product_gelu, (*args, gelu), k, sizes)


def _linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str) -> Tensor:
    """``F.gelu(F.linear(x, weight, bias))``: ``linear``'s ``gelu`` off oneDNN's path."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def stacked_linear(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> Tensor:
    """(..., K) through the weights stacked into one (sum N, K), made once and remade when any weight or bias changed."""
    if any(t.is_inference() for t in (*weights, *biases) if t is not None):  # no version to watch: stack for this call only
        return linear(x, torch.cat(list(weights)), None if biases[0] is None else torch.cat(list(biases)))  # (..., sum N)
    return linear(x, *_stacked(weights, biases))  # (..., sum N)


def _stacked(weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> tuple[Tensor, Tensor | None]:
    """The weights (N_i, K) stacked into one (sum N, K) and the biases into one (sum N,) or None, made once
    and remade when any of them changed; none of them an inference tensor (which has no version to watch).
    Made outside inference mode, so that a stack first made there is a plain tensor ``onednn.packed`` can pack."""

    def stack() -> tuple[Tensor, Tensor | None]:
        with torch.inference_mode(False):
            return torch.cat([w.detach() for w in weights]), None if biases[0] is None else torch.cat([b.detach() for b in biases])

    return cached(STACKED, [t for t in (*weights, *biases) if t is not None], stack)


def _stackable(layers: Sequence[nn.Module]) -> bool:
    """Layers of one class that offers ``stack(layers)`` (``headwise.quantize.Int8Linear``), none with hooks."""
    kind = type(layers[0])
    return callable(getattr(kind, "stack", None)) and all(type(layer) is kind and _hookless(layer) for layer in layers)


def _project_stacked(layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """``project_many`` for layers of a class with ``stack``: one stacked layer, made once and remade when any
    of their tensors changes (as the stacked ``nn.Linear`` weights are), then split (..., N_i)."""
    if compiling():  # a stack made once cannot live in a graph: the class's frozen stack, or each layer
        traced = getattr(type(layers[0]), "frozen_stack", None) if frozen() else None
        y = traced(layers, x) if traced is not None else None  # (..., sum N) or None
        if y is None:
            return [layer(x) for layer in layers]
        return list(y.split([layer.weight.shape[0] for layer in layers], dim=-1))  # (..., N_i) each
    owners = [t for layer in layers for own in (layer._parameters, layer._buffers) for t in own.values() if t is not None]  # their own tensors
    if not watchable() or not plain_tensors(x, *owners) or any(t.is_inference() for t in owners):
        return [layer(x) for layer in layers]
    try:
        stacked = cached(STACKED, owners, lambda: type(layers[0]).stack(layers))
    except ValueError:  # layers the class does not stack (other widths, biases or arithmetic): each runs alone
        return [layer(x) for layer in layers]
    y = stacked(x)  # (..., sum N)
    return list(y.split([layer.weight.shape[0] for layer in layers], dim=-1))  # (..., N_i) each


def release(module: nn.Module) -> None:
    """Drop what headwise keeps for ``module``'s parameters and buffers and for the module and its submodules (packed,
    stacked copies, decisions) with every weak reference to them: for torch's ``swap_tensors``, which refuses a tensor
    that has one, so a module converted or loaded by swapping (``torch.__future__.set_swap_module_params_on_conversion
    (True)``) after a headwise call is released first. The next call makes them again."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    weight_cache.release([*module.parameters(), *module.buffers(), *module.modules()])


def owns_output(layer: nn.Module) -> bool:
    """Whether ``project`` and ``project_many`` give for ``layer`` a new tensor that nothing else holds, which the caller
    may overwrite: a hook-free ``nn.Linear``'s (its GEMM's output, or a view of the stacked GEMM's), or a hook-free
    layer whose own class (not a subclass) sets ``fresh_output = True`` (``headwise.quantize.Int8Linear``). A hook may
    keep the output, so a hooked layer's never is."""
    return _hookless(layer) and (type(layer) is nn.Linear or vars(type(layer)).get("fresh_output", False) is True)


def _plain(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear and _hookless(layer)


def _hookless(layer: nn.Module) -> bool:
    return _unhooked(layer) and not _global_module_hooks()


def _unhooked(layer: nn.Module) -> bool:
    """No hooks of the layer's own, forward or backward (the global ones are ``_global_module_hooks``), and no
    ``forward`` set on the instance (what accelerate's hooks and offloading do): else the layer is called as it is."""
    return not (layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks or layer._backward_pre_hooks) \
        and "forward" not in layer.__dict__


def _global_module_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks)
