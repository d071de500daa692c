"""Argument checks shared by the package: each raises ValueError/TypeError naming the argument,
what was expected and what was given. One checker per kind of argument.

Checks of shapes, dtypes and Python values cost nothing. A check of a tensor's *values* reads
them on the host: on a GPU that is a device sync, so such checks sit only where a call enters
with user data (an int padding mask, token ids), never on a path a bool mask or a decode step
takes. Meta tensors have no values: ``has_values`` says so and value checks are skipped there.

Under ``torch.compile`` the checks of shapes, dtypes, devices and Python values run while Dynamo
traces (they become guards: a call that passes them runs the graph, nothing is re-checked inside
it). A value check cannot read the host there without breaking the graph: ``holds`` puts it in the
graph as ``torch._assert_async`` instead, which fails the call with a RuntimeError carrying the
same message (on a GPU, a device-side assert).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable

import torch
import torch.autograd.forward_ad as _forward_ad
from torch import Tensor


def compiling() -> bool:
    """Whether this call is being traced into a graph: by ``torch.compile`` (Dynamo: the constant True in the graph it
    makes, False in an eager call) or by ``torch.export``'s non-strict tracing (Python run on fake tensors). Not
    ``torch.compiler.is_compiling()``, one flag for the whole process that stays True in every thread while any thread
    compiles: another thread's eager call would take the traced branches (and the projections' op, which runs the
    eager path inside a graph, would call itself)."""
    return torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()


def integer(name: str, value: object, *, low: int = 1, high: int | None = None) -> int:
    """``value`` as a plain Python int in [low, high]; without ``high``, below 2**63 (torch's sizes are 64-bit: a larger
    one fails deep inside torch, or a loop over it never ends).

    Any integral that ``operator.index`` takes counts (an int, a numpy integer such as an id read from an array), and
    comes back as an ``int``: what a caller stores (a config's field, written to JSON) is never a numpy scalar. Refused
    with a TypeError: bools (``True`` is not a count) and tensors, even 0-d integer ones: reading one is a device sync on
    a GPU and breaks a ``torch.compile`` graph, so the caller says where that read happens (``int(t)``). A value of the
    right type out of range is a ValueError.
    """
    def expected() -> str:  # written only for an error: formatting a symbolic bound while compiling would pin its value
        return f"an int in [{low}, {high}]" if high is not None else ("a positive int" if low == 1 else f"an int >= {low}")

    if isinstance(value, Tensor):
        hint = ": pass int(t), which reads it" if value.ndim == 0 else ""
        raise TypeError(f"{name} must be {expected()}, got a tensor of shape {tuple(value.shape)} and dtype {value.dtype}{hint}")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {expected()}, got {value!r}")
    if not isinstance(value, int):  # an int (or a SymInt while compiling) is kept as given
        try:
            value = operator.index(value)
        except TypeError:  # a float, a string, None, numpy's bool (its __index__ refuses)
            raise TypeError(f"{name} must be {expected()}, got {value!r}") from None
    if value < low or value > (_INT64_MAX if high is None else high):
        below = " below 2**63" if high is None and value > _INT64_MAX else ""
        raise ValueError(f"{name} must be {expected()}{below}, got {value!r}")
    return value  # an int as given (int() would pin a SymInt to its traced value), else index()'s plain int


_INT64_MAX = 2**63 - 1


def device(name: str, value: object) -> torch.device | None:
    """None, or ``value`` (a torch.device, a device string or index) as a torch.device this process can use."""
    if value is None:
        return None
    try:
        d = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu', got {value!r}") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={value!r} needs a GPU that torch can see (torch.cuda.is_available() is False)")
    return d


def positive_int(name: str, value: object) -> int:
    return integer(name, value, low=1)


def integer_tensor(name: str, t: object, expected: str | Callable[[], str]) -> Tensor:
    """``t`` if it is a tensor of an integer dtype (not bool: a mask is not ids); else a TypeError, "``name`` must be
    ``expected``, got" its dtype or type. Text that names sizes comes as a callable, formatted only for the error (a
    symbolic size formatted while compiling would pin its value). Its shape and values are the caller's to check."""
    if not isinstance(t, Tensor) or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        text = expected if isinstance(expected, str) else expected()
        raise TypeError(f"{name} must be {text}, got {f'dtype {t.dtype}' if isinstance(t, Tensor) else type(t).__name__}")
    return t


def boolean(name: str, value: object) -> bool:
    """TypeError naming ``name`` unless ``value`` is True or False (not 0/1, not None)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def floating_dtype(name: str, value: object) -> torch.dtype:
    """``value`` as a floating-point ``torch.dtype`` (what keys, values and weights are stored in)."""
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype (e.g. torch.float32, torch.bfloat16), got {value!r}")
    return value


def cache_storage(name: str, value: object, head_dim: int) -> torch.dtype:
    """``value`` as what a ``KVCache`` may store: a floating-point dtype, or ``torch.int8`` (8-bit rows, each with a
    float32 scale after its ``head_dim`` values: ``head_dim`` a multiple of 4)."""
    if value is torch.int8:
        if head_dim % 4:
            raise ValueError(f"{name}=torch.int8 needs a head_dim that is a multiple of 4 (each row's float32 scale follows "
                             f"its values, 4-byte aligned), got head_dim={head_dim}")
        return value
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype (e.g. torch.float32, torch.bfloat16) or torch.int8 "
                        f"(8-bit rows), got {value!r}")
    return value


def cache_dtype(name: str, held: torch.dtype, computed: torch.dtype, *, rows8: bool = False) -> None:
    """Raise TypeError unless a cache holding ``held`` may serve keys and values computed in ``computed``: the same
    dtype, or bfloat16 for float32 (half the bytes; float32's exponent range, so no key overflows to inf). 8-bit rows
    (``rows8``; ``held`` float32, what they take) keep float32 keys and values, or bfloat16 ones widened exactly."""
    if rows8:
        if computed not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} holds 8-bit rows of float32 or bfloat16 keys and values; they are {computed}")
        return
    if held != computed and (held, computed) != (torch.bfloat16, torch.float32):
        raise TypeError(
            f"{name} is {held}, but the keys and values are {computed}: a cache holds their dtype, "
            f"or torch.bfloat16 for float32 ones"
        )


def number(name: str, value: object, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float in the interval given: an int, a float or another real number (a numpy scalar), returned as a
    plain ``float``. Refused with a TypeError: bools, tensors (the caller says where a tensor is read: ``float(t)``) and
    anything not a real number; a NaN or a value out of the interval with a ValueError."""

    def interval() -> str:  # written only for an error (as ``integer``'s range)
        return f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    value = real(name, value, lambda: f"a number in {interval()}")
    ok = value == value  # NaN != NaN (math.isnan breaks a graph on a symbolic float)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        raise ValueError(f"{name} must be a number in {interval()}, got {value!r}")
    return float(value)


def real(name: str, value: object, expected: Callable[[], str]) -> int | float:
    """``value`` if an int or a float (symbolic ones too), another real number (a numpy scalar, a Fraction) as a float;
    else a TypeError saying ``name`` must be ``expected()`` (bools and tensors refused)."""
    if isinstance(value, (bool, Tensor)) or not isinstance(value, (int, float, numbers.Real)):
        raise TypeError(f"{name} must be {expected()}, got {value!r}")
    return value if isinstance(value, (int, float)) else float(value)


def dropout(name: str, value: object) -> float:
    """A dropout probability in [0, 1]: 1 drops everything in training, as ``nn.Dropout(1.0)`` does."""
    return number(name, value, low=0.0, high=1.0)


def epsilon(name: str, value: object) -> float:
    """A LayerNorm epsilon: a finite number > 0 (a negative or NaN one makes every output NaN)."""
    return number(name, value, low=0.0, high=math.inf, low_open=True, high_open=True)


def heads(
    width_name: str, width: int, num_heads: int, num_kv_heads: int | None, names: tuple[str, str] = ("num_heads", "num_kv_heads")
) -> int:
    """Check that the heads split the width; return num_kv_heads (default num_heads).

    ``names`` are the two head counts' names in the caller's vocabulary (a config's fields, say).
    """
    heads_name, kv_name = names
    num_heads = positive_int(heads_name, num_heads)
    if width % num_heads:
        raise ValueError(f"{width_name} ({width}) must be divisible by {heads_name} ({num_heads})")
    if num_kv_heads is None:
        return num_heads
    num_kv_heads = positive_int(kv_name, num_kv_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"{heads_name} ({num_heads}) must be divisible by {kv_name} ({num_kv_heads})")
    return num_kv_heads


def window(value: int | None, causal: bool) -> int | None:
    if value is None:
        return None
    try:
        value = positive_int("window", value)
    except (ValueError, TypeError) as e:
        raise type(e)(f"window must be a positive int or None, got {value!r}") from None
    if not causal:
        raise ValueError("window (sliding-window attention) needs causal=True, got causal=False")
    return value


def tokens(x: object, d_in: int, name: str = "x", width: str = "d_in") -> tuple[int, int]:
    """Check ``x`` is (batch, tokens, d_in) float (``width``: what the module calls d_in, kv_dim for a context); return (B, T)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (batch, tokens, {d_in}), got {type(x).__name__}")
    if x.ndim != 3 or x.shape[-1] != d_in:
        raise ValueError(f"{name} must have shape (batch, tokens, {width}={d_in}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x.shape[0], x.shape[1]


def attention_mask(
    mask: object, b: int, t: int, dims: str = "(batch, tokens)", name: str = "attention_mask", *, device: tuple[str, torch.device] | None = None
) -> Tensor | None:
    """A padding mask with HuggingFace's meaning, 1/True = real token, 0/False = padding.

    Bools or 0/1 integers, shape (b, t); ``dims`` names that shape in the message;
    ``device``, if given, is ``(what, device)``: the mask must be on that device.
    Returns it as a (b, t) bool tensor (None stays None). A bool mask is taken as it is; an
    int mask's values are checked, which reads them on the host (one device sync on a GPU):
    pass bools where that matters.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a bool or 0/1 int tensor of shape {dims} (1/True = real token), got {type(mask).__name__}")
    if tuple(mask.shape) != (b, t):
        raise ValueError(f"{name} must have shape {dims} = {(b, t)}, got {tuple(mask.shape)}")
    if device is not None:
        same_device(name, mask, *device)
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name} must be a bool or 0/1 int tensor (1/True = real token), got dtype {mask.dtype}")
    if has_values(mask):
        holds(
            ((mask == 0) | (mask == 1)).all(), f"{name} must hold only 0 (padding) and 1 (real token)",
            lambda: f", got values {sorted(mask.unique().tolist())}",
        )
    return mask != 0


def transformed(*tensors: Tensor | None) -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...) wraps any of these tensors, or one carries
    a forward-mode tangent (``torch.autograd.forward_ad``): then only torch's own ops run (the library's autograd
    Functions, C++ ops and packed weights neither take wrapped tensors nor carry a tangent)."""
    if compiling():
        return False
    if any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return True
    return _forward_ad._current_level >= 0 and any(t is not None and _forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def has_values(t: Tensor) -> bool:
    """False for a meta tensor (shapes and dtypes only, nothing to read) and for one ``vmap`` batches at any level (its
    examples have no one value to read); True otherwise (``grad``'s wrapped tensors read as they are)."""
    if t.device.type == "meta":
        return False
    return compiling() or not _batched(t)  # (Dynamo cannot trace the functorch test)


def _batched(t: Tensor) -> bool:
    """Whether a ``vmap`` level batches ``t`` under any other transform's wrapping."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def holds(ok: Tensor, message: str, detail: Callable[[], str] | None = None, error: type[Exception] = ValueError) -> None:
    """Raise ``error(message + detail())`` unless the one-element bool tensor ``ok`` is True.

    Eager: one host read (a device sync on a GPU), then ``detail`` (what was given) is computed
    only for the message. While ``torch.compile`` traces: ``torch._assert_async(ok, message)`` in
    the graph, no host read and no graph break; a failing call raises RuntimeError(message).
    """
    if compiling():
        torch._assert_async(ok, message)
        return
    if not bool(ok):
        raise error(message + (detail() if detail is not None else ""))


def position_ids(ids: object, b: int, t: int, name: str = "position_ids", device: tuple[str, torch.device] | None = None) -> None:
    """None, or a (b, t) int64 or int32 tensor of positions (what an embedding indexes with) on ``device`` (what lives
    there, and where), if given; its values are not read (no host sync)."""
    if ids is None:
        return
    integer_tensor(name, ids, lambda: f"an integer tensor of shape (batch, tokens) = {(b, t)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold int64 or int32 positions (torch.long, as a tokenizer's ids), got dtype {ids.dtype}")
    if tuple(ids.shape) != (b, t):
        raise ValueError(f"{name} must have shape (batch, tokens) = {(b, t)}, got {tuple(ids.shape)}")
    if device is not None:
        same_device(name, ids, *device)


def broadcasts(name: str, t: Tensor, shape: tuple[int, ...], dims: str, given: tuple[int, ...] | None = None) -> None:
    """``t`` must broadcast to ``shape`` (named ``dims``, e.g. "(B, H, T, S)"); ``given``: the shape to name if not t's."""
    try:
        ok = torch.broadcast_shapes(t.shape, shape) == shape
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must broadcast to {dims} = {shape}, got shape {tuple(t.shape) if given is None else given}")


def same_device(name: str, t: Tensor, what: str, device: torch.device) -> None:
    """``t`` must be on ``device``, where ``what`` lives; the message names both devices."""
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but {what} on {device}: move one to the other's device")


def module_input(module: torch.nn.Module, x: Tensor, name: str) -> None:
    """``x`` must be on the device of ``module``'s parameters and of their dtype (under autocast, which casts the other
    floating dtypes, neither of them float64, which it leaves as it is)."""
    p = next(module.parameters(), None)
    if p is None:  # int8 weights (``int8_weights``) are buffers: their device says where x must be, not their dtype
        if (b := next(module.buffers(), None)) is not None:
            same_device(name, x, f"{type(module).__name__}'s buffers are", b.device)
        return
    owner = f"{type(module).__name__}'s parameters are"
    same_device(name, x, owner, p.device)
    if x.dtype != p.dtype and (torch.float64 in (x.dtype, p.dtype) or not torch.is_autocast_enabled(x.device.type)):
        raise TypeError(f"{name} has dtype {x.dtype} but {owner} {p.dtype}: convert one (module.to({x.dtype}) or {name}.to({p.dtype}))")


def context(t: int, past: int, context_length: int, sliding: bool, longest: Callable[[], int] | None = None) -> None:
    """Tokens beyond context_length break the book's mask: say so instead. ``longest``: where the ``past`` cached slots
    may hold padding, the most real tokens a row will hold (asked only where the slots would not fit: padding takes no
    position)."""
    if sliding or past + t <= context_length:
        return
    n = past + t if longest is None else longest()
    if n > context_length:
        slots = f"{past} cached + {t} new slots" if past else f"{t} slots"
        cached = (f" ({past} cached + {t} new)" if past else "") if n == past + t else f" in a row, padding not counted ({slots})"
        raise ValueError(f"got {n} tokens{cached}, more than context_length={context_length}")


#: The caps a softcap may take: every runner computes them to its dtype's precision (float32 for
#: half inputs). A cap below the range leaves the scores within 1e-6 of each other, one above it
#: leaves them as they are, and near float32's limits 1 / cap or cap itself no longer fits.
SOFTCAP_RANGE = (1e-6, 1e30)


def softcap(value: object) -> float | None:
    """None, or a logit softcap: a number in ``SOFTCAP_RANGE`` (scores become cap * tanh(scores / cap))."""
    if value is None:
        return None
    low, high = SOFTCAP_RANGE

    def expected() -> str:
        return (f"a number in [{low:g}, {high:g}] (scores become cap * tanh(scores / cap); a cap beyond {high:g} caps nothing: "
                f"pass None)")

    value = real("softcap", value, expected)
    if not low <= value <= high:  # False for NaN
        raise ValueError(f"softcap must be {expected()}, got {value!r}")
    return float(value)


def per_head(
    name: str, t: object, b: int, h: int, device: torch.device, *, batched: bool, minus_inf: str | None = None,
    scores: torch.dtype = torch.float32, distance: int | None = None,
) -> Tensor | None:
    """None, or (H,) floats (also (B, H) when ``batched``) on ``device``; returned as (1, H) or (B, H) when batched.

    The values must be finite in ``scores``, the dtype the scores are computed in (one host read: a float64 1e300
    would be inf in float32's scores); ``minus_inf``, if given, says what -inf means there, and -inf is taken too.
    ``distance``, if given, is the farthest a query sits from a key: each value times it must stay finite in ``scores``
    (ALiBi's bias ``-slope * distance``; -2e38 at a distance of 2 would be +inf, and the row's weights NaN).
    """
    if t is None:
        return None
    dims = f"(H={h},) or (B={b}, H={h})" if batched else f"(H={h},)"
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a float tensor of shape {dims}, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a float tensor of shape {dims}, got dtype {t.dtype}")
    if tuple(t.shape) != (h,) and not (batched and tuple(t.shape) == (b, h)):
        raise ValueError(f"{name} must have shape {dims}, one per query head, got {tuple(t.shape)}")
    same_device(name, t, "q, k and v are", device)
    if has_values(t):
        finite = "finite numbers" + (f" in {scores} (the scores' dtype)" if t.dtype.itemsize > scores.itemsize else "")
        if distance is not None:  # the product in the scores' dtype, as the bias is computed (inf, or NaN, fails)
            good = t.to(scores).abs() * distance <= torch.finfo(scores).max  # (at distance 0 or 1: finite)
            finite += f" whose bias -slope * distance stays finite in {scores}"
        else:
            wide = t.to(scores) if t.dtype.itemsize > scores.itemsize else t  # (as the runners take it: wider values narrowed)
            good = (wide < math.inf) if minus_inf is not None else wide.isfinite()  # (wide < inf: False at NaN and +inf only)
        expected = f"{finite} or -inf ({minus_inf})" if minus_inf is not None else finite
        holds(good.all(), f"{name} must hold {expected}", lambda: f"{_slope_bound(distance, scores)}, got {t.detach().cpu().tolist()}")
    return (t.unsqueeze(0) if t.ndim == 1 else t) if batched else t  # (1, H) or (B, H); H may be 0


def _slope_bound(distance: int | None, scores: torch.dtype) -> str:
    """What the error of a slope too large for ``distance`` adds (eager only: a symbolic size is not written)."""
    if distance is None or distance < 2:
        return ""
    return f" at distances up to {distance} (|slope| at most {torch.finfo(scores).max / distance:.4g})"


def documents(t: object, b: int, s: int, dims: str, device: torch.device) -> Tensor | None:
    """None, or (b, s) integer document ids on ``device`` (their values are not read here)."""
    if t is None:
        return None
    integer_tensor("documents", t, lambda: f"an integer tensor of document ids, shape {dims} = {(b, s)}")
    if tuple(t.shape) != (b, s):
        raise ValueError(f"documents must have shape {dims} = {(b, s)}, one id per key, got {tuple(t.shape)}")
    same_device("documents", t, "q, k and v are", device)
    return t


def position_table(name: str, ids: object, t: int, *, batch: int | None = None, device: torch.device | None = None) -> Tensor:
    """Positions for T tokens: an integer tensor (B, T), or (1, T) shared by the batch, on ``device`` (x's), if given.

    ``batch``, if given, is x's B: the ids' first dim must be B or 1 (ids of another batch
    would widen or narrow x's). Values are not read (no host sync).
    """
    integer_tensor(name, ids, lambda: f"an int start or an integer tensor of shape (batch, tokens={t})")
    if ids.ndim != 2 or ids.shape[1] != t or (batch is not None and ids.shape[0] not in (1, batch)):
        expected = f"(batch, {t})" if batch is None else (f"(1, {t})" if batch == 1 else f"({batch}, {t}) or (1, {t})")
        raise ValueError(f"{name} must have shape (batch, tokens) = {expected}, got {tuple(ids.shape)}")
    if device is not None:
        same_device(name, ids, "x is", device)
    return ids


def head_input(name: str, x: object, head_dim: int) -> Tensor:
    """A floating-point tensor (..., T, D) of queries or keys with D = ``head_dim``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (..., tokens, head_dim={head_dim}), got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.ndim < 2 or x.shape[-1] != head_dim:
        raise ValueError(f"{name} must have shape (..., tokens, head_dim={head_dim}), got {tuple(x.shape)}")
    return x


def sharded(t: object) -> bool:
    """Whether ``t`` is a DTensor (one shard of a tensor-parallel layer: ``headwise.parallel``)."""
    if not isinstance(t, Tensor) or type(t) in (Tensor, torch.nn.Parameter) or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
