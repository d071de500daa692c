"""Rotary position embeddings (RoPE): positions as rotations of query/key pairs.

Each head's first R dims (R = ``rotary_dim`` <= D, even) form R/2 pairs; pair i of the token at
position p turns by the angle ``p * inv_freq[i]``, ``inv_freq[i] = theta ** (-2i / R)``. A query
at p and a key at p' then score ``q · k`` rotated by ``(p - p') * inv_freq``: attention sees
relative positions, and the cache stores keys already rotated. Dims past R pass unchanged
(partial rotary, GPT-NeoX / Phi style).

Two layouts pair the dims differently (the same rotation, different weights):
    "rotate_half"  dims i and i + R/2 (HuggingFace's Llama, Qwen, Mistral, GPT-NeoX);
    "interleaved"  dims 2i and 2i + 1 (GPT-J, Meta's original Llama code).

Frequency scalings for longer contexts, HuggingFace's ``rope_scaling`` / ``rope_parameters``:
    "default"  none;
    "linear"   every inv_freq divided by ``factor`` (positions squeezed);
    "llama3"   Llama 3.1's: low frequencies divided by ``factor``, high ones kept, the band
               between (set by ``low_freq_factor``, ``high_freq_factor`` and
               ``original_max_position_embeddings``) blended smoothly.

Angles, cos and sin are computed in float64 and kept as float32 tables (float64 ones for float64
inputs), once per length (grown by doubling), device and dtype, shared by every layer that holds the same
``RotaryEmbedding``; explicit (B, T) positions (left padding) get theirs computed from the ids, with
no read back to the host. Half precision inputs are rotated in float32 and rounded once at the end.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from . import _checks

LAYOUTS = ("rotate_half", "interleaved")
SCALINGS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_HALF = (torch.float16, torch.bfloat16)
ONE_COPY = 1 << 16  # elements of a half x from which ``rotate`` keeps one float32 copy (a prompt's); below, fewer ops
_MAX_TABLE = 1 << 17  # positions kept in a table (128K: Llama 3.1's context); past it an int start gets its own angles


def check_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A ``rope_scaling`` dict checked to name a supported ``rope_type`` with its keys (None = no scaling).

    HuggingFace's older ``"type"`` key is read as ``"rope_type"``; other keys are ignored. The numbers come back as
    plain ``int``s (an integer given) or ``float``s (any other real, numpy's too), which write to JSON.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise TypeError(f"rope_scaling must be a dict with a 'rope_type' or None, got {type(scaling).__name__}")
    if "rope_type" not in scaling and "type" not in scaling and (keys := sorted(set(scaling) & {k for ks in SCALINGS.values() for k in ks})):
        raise ValueError(f"rope_scaling needs a 'rope_type' (or 'type') key to say how to scale by {keys}, got {dict(scaling)!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if not isinstance(kind, str) or kind not in SCALINGS:
        raise ValueError(f"rope_scaling's rope_type must be one of {list(SCALINGS)}, got {kind!r}")
    missing = [key for key in SCALINGS[kind] if key not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of rope_type {kind!r} needs {list(SCALINGS[kind])}, missing {missing}")
    values = {}
    for key in SCALINGS[kind]:
        value = _checks.number(f"rope_scaling[{key!r}]", scaling[key], low=0.0, low_open=True, high_open=True)
        values[key] = int(scaling[key]) if isinstance(scaling[key], numbers.Integral) else value
    if kind == "llama3" and not values["high_freq_factor"] > values["low_freq_factor"]:
        raise ValueError(f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got {values['high_freq_factor']} and {values['low_freq_factor']}")
    return {"rope_type": kind, **values}


def inverse_frequencies(rotary_dim: int, *, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None) -> Tensor:
    """The R/2 angular speeds, ``theta ** (-2i / R)``, scaled as ``scaling`` says; float64 on the CPU
    (made there whatever the default device: a model built on "meta" keeps real frequencies).

    Example:
        >>> inverse_frequencies(4, theta=100.0)
        tensor([1.0000, 0.1000], dtype=torch.float64)
    """
    if _checks.positive_int("rotary_dim", rotary_dim) % 2:
        raise ValueError(f"rotary_dim must be even (dims rotate in pairs), got {rotary_dim}")
    theta = _checks.number("theta", theta, low=1.0, low_open=True, high_open=True)
    scaling = check_scaling(scaling)
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim)  # (R/2,)
    scaled = _scaled(inv_freq, scaling)  # (R/2,)
    if not bool(scaled.isfinite().all()):  # a factor as small as 1e-310 passes its (0, inf) check: 1 / factor is inf
        raise ValueError(f"rope_scaling {scaling!r} makes the frequencies infinite (over theta={theta}): its factors are too small")
    return scaled


def _scaled(inv_freq: Tensor, scaling: dict[str, Any] | None) -> Tensor:
    """(R/2,) frequencies scaled as ``scaling`` (checked) says."""
    kind = "default" if scaling is None else scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high, old = (scaling[key] for key in SCALINGS["llama3"])
        wavelength = 2 * math.pi / inv_freq  # (R/2,)
        smooth = (old / wavelength - low) / (high - low)  # 0 at the long-wavelength edge, 1 at the short one
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelength > old / low, inv_freq / factor, inv_freq)  # long waves slowed, short kept
        middle = (wavelength >= old / high) & (wavelength <= old / low)
        return torch.where(middle, blended, scaled)  # (R/2,)
    return inv_freq


def rotate(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "rotate_half") -> Tensor:
    """Rotate the first R dims of x by tables from ``RotaryEmbedding.tables``; the rest pass.

    Args:
        x: (..., T, D) queries or keys, e.g. (B, H, T, D).
        cos: (T, R) or (B, 1, T, R) float32 (float64 for a float64 x), cos of each dim's angle, laid out for
            ``layout``.
        sin: like cos, the sin of each dim's angle, signed so that ``x·cos + swap(x)·sin``
            rotates, where swap exchanges the two dims of each pair.
        layout: "rotate_half" or "interleaved", as the tables were made.

    Returns:
        x's shape and dtype.
    """
    r = cos.shape[-1]
    if x.dtype in _HALF and layout == "rotate_half" and x.numel() >= ONE_COPY and not (x.requires_grad and torch.is_grad_enabled()):
        return _rotate_half_in_one_copy(x, cos, sin)
    work = x.float() if x.dtype in _HALF else x
    part = work[..., :r] if r < x.shape[-1] else work  # (..., T, R)
    if layout == "interleaved":
        out = torch.addcmul(part * cos, _swap_pairs(part, layout), sin)  # (..., T, R)
    elif layout != "rotate_half":
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    else:  # each half adds the other half's product in place: no swapped copy of x (torch.roll is a copy)
        h = r // 2
        out = part * cos  # (..., T, R)
        out[..., :h].addcmul_(part[..., h:], sin[..., :h])  # x1·cos - x2·sin
        out[..., h:].addcmul_(part[..., :h], sin[..., h:])  # x2·cos + x1·sin
    if r < x.shape[-1]:
        out = torch.cat((out, work[..., r:]), dim=-1)  # (..., T, D)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _rotate_half_in_one_copy(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``rotate`` for a half-precision x in the "rotate_half" layout, the same numbers bit for bit, in one float32 copy of
    x turned in place and a float32 copy of one half at a time (the partner each half reads), where ``rotate`` below
    makes two whole float32 tensors: a long prompt's two, freed together, could make glibc hand their pages back to
    the system, to be faulted in again by the next layer."""
    h = cos.shape[-1] // 2
    work = x.float()  # (..., T, D): dims past R pass unchanged
    partner = x[..., h:2 * h].float()  # (..., T, R/2): x2
    work[..., :h].mul_(cos[..., :h]).addcmul_(partner, sin[..., :h])  # x1·cos - x2·sin
    partner.copy_(x[..., :h])  # x1
    work[..., h:2 * h].mul_(cos[..., h:]).addcmul_(partner, sin[..., h:])  # x2·cos + x1·sin
    return work.to(x.dtype)


def _count(name: str, value: object) -> None:
    """An int >= 0 (not a bool); a symbolic size (torch.compile with dynamic shapes) passes as it is."""
    if not isinstance(value, torch.SymInt):
        _checks.integer(name, value, low=0)


def _swap_pairs(x: Tensor, layout: str) -> Tensor:
    """(..., R) -> (..., R) with the two dims of every rotating pair exchanged (``rotate`` does the
    "rotate_half" swap in place, half by half)."""
    if layout == "interleaved":
        return x.unflatten(-1, (x.shape[-1] // 2, 2)).flip(-1).flatten(-2)  # pairs (2i, 2i+1)
    return x.roll(x.shape[-1] // 2, dims=-1)  # pairs (i, i + R/2): the halves change places


def _table_dtype(dtype: torch.dtype) -> torch.dtype:
    """The tables' dtype for rotating ``dtype``: float64 for float64 (rounded to float32 they would move a float64
    model's logits by up to ~1e-6), float32 for any other (half precision is rotated in float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RotaryEmbedding:
    """Rotary position embeddings for heads of size D, shared by the layers of a model.

    Not a module: the tables are float32 whatever ``model.to(dtype)`` does (float64 for float64
    inputs, whose rotation is then exact to float64's rounding), and hold no parameters.
    ``rotary(x, start)`` rotates x (B, H, T, D) as tokens ``start .. start+T-1``;
    ``rotary(x, positions)`` with a (B, T) tensor puts each token where ``positions`` says.

    Args:
        head_dim: D.
        rotary_dim: R, the dims that rotate (even, <= D); default D.
        theta: the base wavelength (HuggingFace's ``rope_theta``).
        scaling: HuggingFace's ``rope_scaling`` dict (``rope_type`` "default", "linear" or
            "llama3" with its keys), or None.
        layout: "rotate_half" (HuggingFace) or "interleaved" (GPT-J).

    Example:
        >>> rope = RotaryEmbedding(64)
        >>> q = torch.randn(1, 12, 5, 64)
        >>> torch.allclose(rope(q, 3)[:, :, 1:], rope(q[:, :, 1:], 4), atol=1e-6)   # same token, same position
        True
    """

    #: Caches of eager calls, never read under ``torch.compile`` (``models.compiled_step.structure`` leaves them out).
    untraced = ("_tables", "_freqs")

    def __init__(
        self, head_dim: int, *, rotary_dim: int | None = None, theta: float = 10000.0, scaling: Mapping[str, Any] | None = None, layout: str = "rotate_half"
    ) -> None:
        self.head_dim = _checks.positive_int("head_dim", head_dim)
        if rotary_dim is None and head_dim % 2:
            raise ValueError(f"head_dim must be even to rotate every dim (dims rotate in pairs), got {head_dim}; or pass an even "
                             "rotary_dim below it")
        self.rotary_dim = head_dim if rotary_dim is None else _checks.integer("rotary_dim", rotary_dim, low=2, high=head_dim)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
        self.layout = layout
        self.inv_freq = inverse_frequencies(self.rotary_dim, theta=theta, scaling=scaling)  # (R/2,) float64, on the CPU
        self._inv_freq_values = tuple(self.inv_freq.tolist())  # the same numbers as constants, for torch.compile (see ``at``)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}
        self._freqs: dict[torch.device, Tensor] = {}

    def _inv_freq(self, device: torch.device) -> Tensor:
        """inv_freq (R/2,) float64 on ``device`` (copied there once)."""
        if device not in self._freqs:
            self._freqs[device] = self.inv_freq.to(device)
        return self._freqs[device]

    def _cos_sin(self, angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(..., R/2) float64 angles -> (cos, sin), each (..., R) in ``dtype``'s tables (``_table_dtype``), in this layout
        (sin signed for ``rotate``)."""
        c, s = angles.cos(), angles.sin()  # (..., R/2) each
        if self.layout == "interleaved":
            cos = c.repeat_interleave(2, dim=-1)  # (..., R): c0 c0 c1 c1 ...
            sin = torch.stack((-s, s), dim=-1).flatten(-2)  # (..., R): -s0 s0 -s1 s1 ...
        else:
            cos = torch.cat((c, c), dim=-1)  # (..., R): c0 .. c_{R/2-1} c0 ..
            sin = torch.cat((-s, s), dim=-1)  # (..., R): -s .. then +s
        table = _table_dtype(dtype)
        return cos.to(table), sin.to(table)

    def tables(self, length: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """(cos, sin) for positions 0 .. at least length-1, each (L, R) on ``device``: float32, or float64 for ``dtype``
        float64 (the dtype of what they rotate).

        The tables grow by doubling and are kept, so every later call up to that length
        slices them. ``sin`` carries the signs of the rotation (see ``rotate``).
        """
        _count("length", length)
        device = device if isinstance(device, torch.device) else _checks.device("device", device)  # ('gpu': a ValueError)
        key = (device, _table_dtype(dtype))
        cos, sin = self._tables.get(key, (None, None))
        if cos is None or cos.shape[0] < length:
            _checks.device("device", device)  # (a table to make: on a device this process can use)
            n = max(64, 1 << max(0, length - 1).bit_length())
            angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * self._inv_freq(device)  # (L, R/2)
            cos, sin = self._cos_sin(angles, dtype)  # (L, R) each
            self._tables[key] = (cos, sin)
        return cos, sin

    def at(self, positions: int | Tensor, t: int, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        """(cos, sin) for T tokens at ``positions``, for rotating ``dtype`` (float64 tables for float64, float32 ones
        for any other): an int start -> (T, R) slices of the kept tables;
        (B, T) ids (left padding, or the caller's own positions) -> (B, 1, T, R), computed from the ids
        on the device, so no value is read back to the host. Compute once, rotate queries and keys.

        Under ``torch.compile`` nothing is kept: tables filled inside a graph would fix its lengths and
        make the next call trace again, so an int start's (T, R) come from its positions (the same
        angles as the tables'), and the frequencies enter the graph as constants (a tensor input
        would get a symbolic size that Dynamo may tie to T)."""
        _count("t", t)
        if _checks.compiling():
            if isinstance(positions, Tensor):
                _checks.position_table("positions", positions, t)
            ids = positions if isinstance(positions, Tensor) else torch.arange(positions, positions + t, device=device)  # (B, T) or (T,)
            inv_freq = torch.tensor(self._inv_freq_values, dtype=torch.float64, device=device)  # (R/2,)
            cos, sin = self._cos_sin(ids.to(torch.float64)[..., None] * inv_freq, dtype)  # (B, T, R) or (T, R) each
            return (cos.unsqueeze(1), sin.unsqueeze(1)) if isinstance(positions, Tensor) else (cos, sin)  # (B, 1, T, R) or (T, R)
        if isinstance(positions, Tensor):
            _checks.position_table("positions", positions, t, device=device)
            angles = positions.to(torch.float64)[..., None] * self._inv_freq(device)  # (B, T, R/2)
            cos, sin = self._cos_sin(angles, dtype)  # (B, T, R) each
            return cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, R) each
        _count("positions (an int start)", positions)
        if positions + t > _MAX_TABLE:  # far positions: their own angles, not a table of every position before them
            angles = torch.arange(positions, positions + t, dtype=torch.float64, device=device)[:, None] * self._inv_freq(device)  # (T, R/2)
            return self._cos_sin(angles, dtype)  # (T, R) each
        cos, sin = self.tables(positions + t, device, dtype)
        return cos[positions : positions + t], sin[positions : positions + t]  # (T, R) each

    def __call__(self, x: Tensor, positions: int | Tensor) -> Tensor:
        """Rotate x (..., T, D) as tokens at ``positions``: an int start >= 0, or (B, T) or (1, T)
        integer ids for x (B, H, T, D)."""
        _checks.head_input("x", x, self.head_dim)
        if isinstance(positions, Tensor):
            _checks.position_table("positions", positions, x.shape[-2], batch=x.shape[0] if x.ndim == 4 else None, device=x.device)
            if x.ndim != 4:
                raise ValueError(f"x must have shape (batch, heads, tokens, head_dim) with position ids, got {tuple(x.shape)}")
        cos, sin = self.at(positions, x.shape[-2], x.device, x.dtype)
        return rotate(x, cos, sin, self.layout)
