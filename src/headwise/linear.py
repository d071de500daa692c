"""The projections (Q/K/V, ``c_attn``, ``out_proj``, the MLPs, the LM head): ``F.linear`` or oneDNN, by one fixed rule.

``F.linear`` on a CPU goes to the BLAS torch was built with (MKL in the official wheels). On
AMD CPUs with AVX-512 (EPYC Zen 4 and Zen 5), MKL runs fp32 GEMMs at half to nine tenths of
the rate oneDNN's own inner product (``torch.ops.mkldnn._linear_pointwise``) reaches on the same
cores, with the same float32 accuracy; with one row of input (a decode step) MKL's gemv reads
GPT-2's tied LM head at half the bandwidth oneDNN's packed weight does. The path of a call is
decided by this rule, nothing timed:

1. ``set_path("onednn" | "torch")`` (or ``use_path``) if called, else ``HEADWISE_LINEAR`` =
   ``auto`` (default), ``onednn`` or ``torch``, read at each call;
2. ``auto`` chooses oneDNN only for float32, only on an AMD CPU whose torch kernels run AVX-512
   (``torch.backends.cpu.get_cpu_capability()``), only on the torch versions in ``TESTED_TORCH``;
   everything else (Intel, ARM, bf16: torch already sends bf16 matmuls to oneDNN) is ``torch``;
3. decode-shaped calls (at most ``DECODE_ROWS`` rows of input, a weight of at least
   ``MIN_DECODE_WEIGHT`` elements: every projection and LM head of a decode step) follow
   ``choose_few_rows``: float32 as in 2; bfloat16 on oneDNN's packed weight on any CPU whose
   flags name ``avx512_bf16`` or ``amx_bf16`` (native bf16 dot products; there torch's bf16
   matmul re-reads the plain (N, K) weight each call, ~1.3x slower for the blocks' GEMVs and
   ~3x for a 50257-row LM head on a family-26 EPYC), on the tested torch versions;
4. ``onednn`` (chosen or forced) needs the private ops to work: they are tried once per dtype on
   tiny tensors against ``F.linear`` (not timed); a failure means ``torch`` and one warning;
5. per call, a oneDNN decision still falls back to ``F.linear`` for anything else than plain
   (no subclass such as DTensor) dense CPU float32/bfloat16 tensors of one dtype, a weight that is
   not contiguous, few rows (fewer than ``MIN_ROWS`` with a weight under ``MIN_DECODE_WEIGHT``
   elements), ``torch.backends.mkldnn.enabled`` False, or ``torch.compile`` tracing.

``describe()`` returns the decisions (many rows and few rows, per dtype) and the machine facts
behind them. On the oneDNN path every
GEMM gets row-major storage: the expanded (stride-0) gradient of ``out.sum()`` is copied first
(handed over as it is, oneDNN ran the weight-gradient GEMM ~1000x slower: 24 s instead of 22 ms
at 2048x768x768), and so is a transposed or sliced input (~1.5x slower as it is); the weight
gradient then reads transposed views of those row-major tensors (copying them too cost 27% at
GPT-2's c_attn shape); a sliced weight (also ~1000x) goes to ``F.linear``. Training goes through
a custom autograd Function whose backward GEMMs also run on oneDNN, and without autograd the
weight is packed once into oneDNN's layout, repacked whenever it changes (storage pointer and
``_version``, bumped by optimizer steps and ``load_state_dict``); under ``torch.distributed``,
where FSDP2 refills weights in place without a version bump, nothing is cached. Nothing global
is changed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules import module as _module  # its global hook registries, read on every project()

TESTED_TORCH = ("2.13",)  # torch major.minor the oneDNN path was tested with (pyproject.toml [tool.headwise] says the same)
PATHS = ("auto", "onednn", "torch")
ENV = "HEADWISE_LINEAR"
MIN_ROWS = 32  # fewer rows (B*T) than this and a small weight: F.linear's lower overhead (~10 us a call) wins
MIN_DECODE_WEIGHT = 2**17  # weight elements from which a decode step reads oneDNN's packed weight faster than MKL's gemv
DECODE_ROWS = 16  # rows (B*T) up to which a call with a weight of MIN_DECODE_WEIGHT or more follows choose_few_rows
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU flags of native bf16 dot products (oneDNN's packed bf16 GEMV uses them)
_DTYPES = (torch.float32, torch.bfloat16)
_forced: str | None = None  # set_path's value; None = the environment decides


def set_path(path: str | None) -> str | None:
    """Force the path of every later call ("auto", "onednn", "torch"); None hands back to ``HEADWISE_LINEAR``.

    Returns:
        the previous ``set_path`` value (None if none was set).
    """
    global _forced
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None, got {path!r}")
    previous, _forced = _forced, path
    return previous


@contextlib.contextmanager
def use_path(path: str) -> Iterator[None]:
    """``set_path(path)`` inside a ``with`` block, the previous setting restored after it."""
    previous = set_path(path)
    try:
        yield
    finally:
        set_path(previous)


def _setting() -> tuple[str, str]:
    """The setting the rule starts from and where it came from ("set_path", ``ENV`` or "default")."""
    value = _path_setting()
    return value, "set_path" if _forced is not None else ENV if ENV in os.environ else "default"


def _path_setting() -> str:
    """``set_path``'s value, else ``HEADWISE_LINEAR``'s, else "auto" (read on every call: one dict lookup)."""
    if _forced is not None:
        return _forced
    value = os.environ.get(ENV)
    if value is None:
        return "auto"
    if value not in PATHS:
        raise ValueError(f"the environment variable {ENV} must be one of {PATHS}, got {value!r}")
    return value


@functools.cache
def cpu() -> dict:
    """The CPU facts the rule reads: vendor, family, model, name, torch's kernel ISA, relevant flags."""
    facts = {"vendor": "", "family": "", "model": "", "name": platform.processor() or platform.machine(), "flags": []}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = (s.strip() for s in line.partition(":"))
            for field, name in (("vendor_id", "vendor"), ("cpu family", "family"), ("model", "model"), ("model name", "name")):
                if key == field:
                    facts[name] = value
            if key in ("flags", "Features"):
                facts["flags"] = sorted({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"} & set(value.split()))
                break
    facts["capability"] = torch.backends.cpu.get_cpu_capability()
    return facts


def _lp(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """oneDNN inner product: (..., K) x (N, K) [dense, transposed (K, N)^T or packed] -> (..., N)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _reorder(weight: Tensor) -> Tensor:
    """(N, K) -> the same weight in oneDNN's blocked layout, which ``_lp`` reads as (N, K)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def inner_product_takes(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether oneDNN's inner product (``mkldnn._linear_pointwise``) computes ``F.linear(x, weight, bias)``,
    and ``_OneDNNLinear``'s backward GEMMs its gradients, for these operands.

    It takes plain dense CPU tensors of one dtype it runs (float32, bfloat16; float16 needs CPU flags,
    float64 none), x (..., K) against a 2-D weight (N, K), and a bias of shape (N,) or None. It refuses
    K = 0, N = 0 with a packed weight, a bias of another shape and mixed dtypes with a RuntimeError, and
    a 0-d bias gives wrong numbers where ``F.linear`` broadcasts it; rows M = 0 run forward, but the
    weight gradient's GEMM then has an empty inner dimension. So M, N and K must all be > 0.
    ``tests/test_private_ops.py`` runs the op on both sides of each condition.

    Args:
        x: (..., K).
        weight: (N, K).
        bias: (N,) or None.
    """
    if not _plain_tensors(x, weight, bias) or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False  # a tensor subclass (DTensor under tensor parallelism, ...) dispatches itself through F.linear
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1] or x.numel() == 0 or weight.numel() == 0:
        return False
    if x.layout != torch.strided or weight.layout != torch.strided or not (x.is_cpu and weight.is_cpu):
        return False
    return bias is None or (bias.shape == weight.shape[:1] and bias.dtype == x.dtype and bias.is_cpu and bias.layout == torch.strided)


def reorder_takes(weight: Tensor) -> bool:
    """Whether ``mkldnn._reorder_linear_weight`` packs ``weight`` (N, K) into oneDNN's blocked layout: a plain
    2-D CPU float32 or bfloat16 tensor with N and K > 0 (an empty one fails to create its reorder)."""
    return (_plain_tensors(weight) and weight.dtype in _DTYPES and weight.ndim == 2 and weight.numel() > 0
            and weight.is_cpu and weight.layout == torch.strided)


@functools.cache
def _ops_error(dtype: torch.dtype) -> str | None:
    """Why oneDNN's private ops cannot be used in ``dtype`` here (None: they work). Tried once, warns once."""
    try:
        if not torch.backends.mkldnn.is_available():
            raise RuntimeError("torch was built without oneDNN")
        gen = torch.Generator().manual_seed(0)
        x, w, b = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen)  # (M, K) (N, K) (N,)
        lo = [t.to(dtype) for t in (x, w, b)]
        with torch.no_grad():
            got = [_lp(*lo), _lp(lo[0], _reorder(lo[1]), lo[2]), _lp(lo[0] @ lo[1].t(), lo[1].t(), None)]
        want = [F.linear(x, w, b), F.linear(x, w, b), x @ w.t() @ w]
        for g, r in zip(got, want, strict=True):
            if g.shape != r.shape or not torch.allclose(g.float(), r, rtol=0.05, atol=0.05 * r.abs().max().item()):
                raise RuntimeError("results differ from F.linear")
    except Exception as e:  # any failure of a private op: use torch
        error = f"{type(e).__name__}: {str(e)[:200]}"
        warnings.warn(f"headwise.linear: oneDNN's private ops fail for {dtype} here ({error}); using F.linear", RuntimeWarning, stacklevel=3)
        return error
    return None


@functools.cache
def _auto(dtype: torch.dtype, few_rows: bool = False) -> tuple[str, str]:
    facts, version = cpu(), ".".join(torch.__version__.split(".")[:2])
    if few_rows and dtype == torch.bfloat16:
        native = sorted(set(_BF16_FLAGS) & set(facts["flags"]))
        if not native:
            return "torch", f"bfloat16 on a CPU without {' or '.join(_BF16_FLAGS)}: torch's own GEMM"
        if version not in TESTED_TORCH:
            return "torch", f"torch {torch.__version__}: the oneDNN path was tested with torch {', '.join(TESTED_TORCH)} only"
        return "onednn", f"bfloat16 with {', '.join(native)}: oneDNN's packed weight, read once per call"
    if dtype != torch.float32:
        return "torch", f"{str(dtype).removeprefix('torch.')}: torch's own GEMM, which runs bf16 on oneDNN already"
    if facts["vendor"] != "AuthenticAMD" or not facts["capability"].startswith("AVX512"):
        return "torch", f"{facts['vendor'] or facts['name']} with {facts['capability']} kernels: only AMD CPUs with AVX-512 take oneDNN"
    if version not in TESTED_TORCH:
        return "torch", f"torch {torch.__version__}: the oneDNN path was tested with torch {', '.join(TESTED_TORCH)} only"
    return "onednn", f"AMD family {facts['family']} with AVX-512 kernels: MKL's fp32 GEMM is slower here than oneDNN's"


def choose(dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """The path ("onednn" or "torch") for ``dtype`` and why, before the per-call checks (see the module docstring)."""
    return _decision(dtype, few_rows=False)


def choose_few_rows(dtype: torch.dtype = torch.float32) -> tuple[str, str]:
    """The path for ``dtype`` and why when a call has at most ``DECODE_ROWS`` rows and a weight of at
    least ``MIN_DECODE_WEIGHT`` elements (a decode step's projections and LM head; rule step 3)."""
    return _decision(dtype, few_rows=True)


def _decision(dtype: torch.dtype, few_rows: bool, setting: str | None = None) -> tuple[str, str]:
    """Rule steps 1-4 for ``dtype`` (``few_rows``: step 3's calls); ``setting`` read when not given."""
    setting = _path_setting() if setting is None else setting
    if setting == "torch":
        return "torch", f"forced by {_setting()[1]}"
    if dtype not in _DTYPES:
        return "torch", f"{dtype}: oneDNN's inner product runs float32 and bfloat16 only"
    path, reason = ("onednn", f"forced by {_setting()[1]}") if setting == "onednn" else _auto(dtype, few_rows)
    if path == "onednn" and (error := _ops_error(dtype)):
        return "torch", f"oneDNN's private ops fail here: {error}"
    return path, reason


def describe() -> dict:
    """The decision as data: CPU facts, torch version, setting and, per dtype, the path and why
    (``few_rows``: the same for decode-shaped calls, at most ``DECODE_ROWS`` rows).

    Example:
        >>> list(describe())
        ['cpu', 'float32', 'bfloat16', 'few_rows', 'setting', 'mkldnn_enabled', 'torch', 'tested_torch']
        >>> describe()["float32"]["path"] in ("onednn", "torch"), describe()["few_rows"]["rows"]
        (True, 16)
    """
    setting, source = _setting()
    names = [str(dtype).removeprefix("torch.") for dtype in _DTYPES]
    paths = {name: dict(zip(("path", "reason"), choose(dtype), strict=True)) for name, dtype in zip(names, _DTYPES, strict=True)}
    few = {name: dict(zip(("path", "reason"), choose_few_rows(dtype), strict=True)) for name, dtype in zip(names, _DTYPES, strict=True)}
    return {"cpu": cpu(), **paths, "few_rows": {"rows": DECODE_ROWS, "min_weight": MIN_DECODE_WEIGHT, **few},
            "setting": f"{setting} ({source})", "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
            "torch": torch.__version__, "tested_torch": list(TESTED_TORCH)}


def uses_onednn(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """True when ``linear(x, weight, bias)`` takes the oneDNN path (see the module docstring)."""
    if torch.compiler.is_compiling():  # first: the row count below would put a guard on T into every compiled graph
        return False  # (without autograd, a compiled call runs ``linear`` whole as one opaque op, which decides when it runs)
    if not inner_product_takes(x, weight, bias) or not weight.is_contiguous():
        return False  # a sliced weight (row stride != K) sends oneDNN down a path ~1000x slower
    dtype = x.dtype
    big, size, k = weight.numel() >= MIN_DECODE_WEIGHT, x.numel(), x.shape[-1]
    if (size < MIN_ROWS * k and not big) or not torch.backends.mkldnn.enabled:
        return False
    setting = _path_setting()
    if setting != "auto":  # forced: no reason to word
        return setting == "onednn" and _ops_error(dtype) is None
    return _decision(dtype, big and size <= DECODE_ROWS * k, setting)[0] == "onednn"


def _key(tensors: Sequence[Tensor]) -> tuple:
    return tuple((t.data_ptr(), t._version, t.shape, t.stride(), t.dtype) for t in tensors)


def _watchable() -> bool:
    """Whether a weight's storage pointer and ``_version`` tell every change. Not under torch.distributed:
    FSDP2 refills its unsharded weights in place, at the same address, without bumping ``_version``."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _cached(cache: dict, owners: Sequence[Tensor], make: Callable[[], object]) -> Any:
    """``make()``'s value for these tensors, made again whenever any of them changed; the entry dies with them."""
    if not _watchable():
        return make()
    ids, key = tuple(map(id, owners)), _key(owners)
    entry = cache.get(ids)
    if entry is None:
        for t in owners:
            weakref.finalize(t, cache.pop, ids, None)
    if entry is None or entry[0] != key:
        entry = cache[ids] = (key, make())
    return entry[1]


_PACKED: dict[tuple[int], tuple] = {}  # (id(weight),) -> (its state, the weight in oneDNN's blocked layout)
_STACKED: dict[tuple[int, ...], tuple] = {}  # ids of weights and biases -> (their state, (weights stacked, biases stacked))


def _packed(weight: Tensor) -> Tensor:
    """The weight reordered for oneDNN, remade whenever the weight changed since."""
    if weight.is_inference() or not _watchable() or not reorder_takes(weight):  # no change we could see: use it as it is, unpacked
        return weight
    return _cached(_PACKED, [weight], lambda: _reorder(weight.detach()))


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with oneDNN forward and backward GEMMs, operands from row-major storage."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        x = x.contiguous()  # (..., K): a transposed or sliced view would take oneDNN's slow strided path
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _lp(x, weight, None if bias is None else bias.contiguous())  # (..., N)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        N, K = weight.shape
        grad2d = grad.reshape(-1, N).contiguous()  # (M, N): out.sum() and out.mean() give an expanded (stride-0) gradient
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _lp(grad2d, weight.t(), None).view(x.shape)  # (M, N) x ((K, N) transposed-contiguous) -> (..., K)
        if ctx.needs_input_grad[1]:
            grad_w = _lp(x.reshape(-1, K).t(), grad2d.t(), None).t()  # ((K, M) x (M, N))^T = (N, K): views of row-major x and grad
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2d.sum(0)  # (N,)
        return grad_x, grad_w, grad_b


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with the same numbers (to float32 rounding), on the path ``choose`` picks.

    Args:
        x: (..., K) input, e.g. (B, T, C).
        weight: (N, K), PyTorch's ``nn.Linear`` layout.
        bias: (N,) or None.

    Returns:
        (..., N).

    Example:
        >>> lin = torch.nn.Linear(768, 2304)
        >>> linear(torch.randn(4, 128, 768), lin.weight, lin.bias).shape
        torch.Size([4, 128, 2304])
    """
    if torch.compiler.is_compiling() and weight.ndim == 2 and _opaque(x, weight, bias):
        return torch.ops.headwise.linear(x, weight, bias)  # (..., N): this function, run when the graph runs
    if not uses_onednn(x, weight, bias):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)  # (..., N)
    return _lp(x.contiguous(), _packed(weight), None if bias is None else bias.detach().contiguous())  # (..., N)


def _opaque(x: Tensor, *params: Tensor | None) -> bool:
    """Whether a call traced by ``torch.compile`` runs as one of the ops below: plain CPU tensors of a dtype oneDNN
    takes, no autograd (shape, dtype, device, grad mode and requires_grad become the graph's guards, not the rows)."""
    tensors = [t for t in (x, *params) if t is not None]
    if not _plain_tensors(*tensors) or any(t.device.type != "cpu" or t.dtype != x.dtype for t in tensors) or x.dtype not in _DTYPES:
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


@torch.library.custom_op("headwise::linear", mutates_args=())
def _linear_op(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``linear`` as an op ``torch.compile`` does not look into: the path is chosen when it runs, the weight
    packed once (the graph hands it the model's own parameter)."""
    return linear(x, weight, bias)


@_linear_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))  # (..., N)


@torch.library.custom_op("headwise::linear_many", mutates_args=())
def _linear_many_op(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """``project_many``'s stacked GEMM as one opaque op: (..., K) -> (..., sum N), the stack made once (biases: all or [])."""
    return _stacked_linear(x, weights, biases or [None] * len(weights))


@_linear_many_op.register_fake
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))  # (..., sum N)


def project(layer: nn.Module, x: Tensor) -> Tensor:
    """``layer(x)`` for a projection layer, through ``linear`` when the layer is a plain ``nn.Linear``.

    A subclass, a replaced module (LoRA, quantised) or one with hooks is called as it is, so
    whatever it adds still happens.

    Args:
        layer: usually an ``nn.Linear`` with weight (N, K).
        x: (..., K).

    Returns:
        (..., N).
    """
    if not _plain(layer):
        return layer(x)
    return linear(x, layer.weight, layer.bias)  # (..., N)


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
    run the same way: one stacked layer, made once and remade when any of their tensors changes.

    Args:
        layers: layers with weights (N_i, K).
        x: (..., K).

    Returns:
        one (..., N_i) tensor per layer.
    """
    if len(layers) > 1 and _stackable(layers):
        return _project_stacked(layers, x)
    if not (len(layers) > 1 and all(_plain(layer) for layer in layers)):
        return [project(layer, x) for layer in layers]
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers]
    params = [t for t in (*weights, *biases) if t is not None]
    mixed = (any(b is None for b in biases) and any(b is not None for b in biases)) or len({(t.dtype, t.device) for t in params}) > 1
    if mixed or not _plain_tensors(x, *params):
        return [project(layer, x) for layer in layers]
    sizes = [w.shape[0] for w in weights]
    if torch.compiler.is_compiling() and _opaque(x, *params):
        y = torch.ops.headwise.linear_many(x, weights, [] if biases[0] is None else biases)  # (..., sum N), stacked when it runs
    elif torch.compiler.is_compiling() or (torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in params))):
        y = linear(x, torch.cat(weights), None if biases[0] is None else torch.cat(biases))  # (..., sum N): every weight gets its gradient
    elif any(t.is_inference() for t in params):
        return [project(layer, x) for layer in layers]
    else:
        y = _stacked_linear(x, weights, biases)  # (..., sum N)
    return list(y.split(sizes, dim=-1))  # (..., N_i) each


def _stacked_linear(x: Tensor, weights: Sequence[Tensor], biases: Sequence[Tensor | None]) -> Tensor:
    """(..., K) through the weights stacked into one (sum N, K), made once and remade when any weight or bias changed."""
    if any(t.is_inference() for t in (*weights, *biases) if t is not None):  # no version to watch: stack for this call only
        return linear(x, torch.cat(list(weights)), None if biases[0] is None else torch.cat(list(biases)))  # (..., sum N)
    weight, bias = _cached(_STACKED, [t for t in (*weights, *biases) if t is not None], lambda: (
        torch.cat([w.detach() for w in weights]), None if biases[0] is None else torch.cat([b.detach() for b in biases])))
    return linear(x, weight, bias)  # (..., sum N)


def _stackable(layers: Sequence[nn.Module]) -> bool:
    """Layers of one class that offers ``stack(layers)`` (``headwise.quantize.Int8Linear``), none with hooks."""
    kind = type(layers[0])
    return callable(getattr(kind, "stack", None)) and all(type(layer) is kind and _hookless(layer) for layer in layers)


def _project_stacked(layers: Sequence[nn.Module], x: Tensor) -> list[Tensor]:
    """``project_many`` for layers of a class with ``stack``: one stacked layer, made once and remade when any
    of their tensors changes (as the stacked ``nn.Linear`` weights are), then split (..., N_i)."""
    if torch.compiler.is_compiling():  # each layer traced as it is (a stack made once cannot live in a graph)
        return [layer(x) for layer in layers]
    owners = [t for layer in layers for own in (layer._parameters, layer._buffers) for t in own.values() if t is not None]  # their own tensors
    if not _watchable() or not _plain_tensors(x, *owners) or any(t.is_inference() for t in owners):
        return [layer(x) for layer in layers]
    stacked = _cached(_STACKED, owners, lambda: type(layers[0]).stack(layers))
    y = stacked(x)  # (..., sum N)
    return list(y.split([layer.weight.shape[0] for layer in layers], dim=-1))  # (..., N_i) each


def _plain_tensors(*tensors: Tensor | None) -> bool:
    return all(type(t) in (Tensor, nn.Parameter) for t in tensors if t is not None)


def _plain(layer: nn.Module) -> bool:
    return type(layer) is nn.Linear and _hookless(layer)


def _hookless(layer: nn.Module) -> bool:
    return not layer._forward_hooks and not layer._forward_pre_hooks and not _global_module_hooks()


def _global_module_hooks() -> bool:
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks)
