"""A decode step's attention as one C++ pass per key head, for compiled steps and paged batches on the CPU.

Two ops over one core (``decode_attention.cpp``): each key head's G query heads take its keys and
values together (scores, softmax and the weighted sum in float32, each row of keys and values
read once), the context in the queries' dtype, zeros for a row that sees no key.

- ``headwise::decode_attention(q, k, v, real, scale, softcap=0, sinks=None, alibi=None)``: (B, H, 1, D) queries over a dense
  cache's (B, Hkv, S, D) keys and (B, Hkv, S, Dv) values, ``real`` (B, S) bool or None (padding), each score taken to
  softcap * tanh(score / softcap) where softcap > 0 (tanh within a few float32 ulps, as the prompt kernel's), ``sinks``
  (H,) float32 logits that join each head's softmax with no value, or None, ``alibi`` (1 or B, H) float32 slopes
  (each score less slope * its key's distance from the query, at position S - 1), or None -> (B, H, 1, Dv);
  or float32 queries over an 8-bit cache's rows (B, Hkv, S, D + 4) and (B, Hkv, S, Dv + 4) int8
  (``headwise.cache.quantize_rows``), each value read as ``dequantize_rows`` reads it: the same bits
  as the kernel over those rows read back in float32.
- ``headwise::paged_decode_attention(q, k_pool, v_pool, tables, seen_from, seen_to, block_size, scale, softcap=0,
  sinks=None, alibi=None)``: ``backends.paged.rows_over_blocks``'s call, each row over its own blocks of the pool, read
  in place (a float32, bfloat16 or 8-bit pool), with the same terms (each sequence's query at position seen_to - 1).

Inductor's loops for the same products and sums, and the same loops over a paged pool, read the
keys and values more slowly (docs: decoding, serving). The kernel is built at run time with
headwise's other C++ ops (``headwise.native``) at the first call that could use it; if it cannot
be built, ``available()`` says False, with one warning, and inductor's loops stay.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from .._checks import compiling
from ..cache.static import SCALE_BYTES
from .spec import Spec, kernel_terms

#: The dtypes the kernel reads and writes (queries, keys and values; sums in float32).
DTYPES = (torch.float32, torch.bfloat16)

torch.library.define(
    "headwise::decode_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor? real, float scale, float softcap=0.0, Tensor? sinks=None, Tensor? alibi=None) -> Tensor",
)
torch.library.define(
    "headwise::decode_step",
    "(Tensor q, Tensor k, Tensor v, Tensor? cos, Tensor? sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? real, int start, "
    "float scale, float softcap=0.0, Tensor? sinks=None, Tensor? alibi=None) -> Tensor",
)
torch.library.define(
    "headwise::paged_step",
    "(Tensor q, Tensor k, Tensor v, Tensor? cos, Tensor? sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor rows, "
    "Tensor tables, Tensor seen_to, int? window, int block_size, float scale, float softcap=0.0, Tensor? sinks=None, "
    "Tensor? alibi=None) -> Tensor",
)
torch.library.define("headwise::rotation_rounding", "() -> int")  # how decode_step's rotation rounds (``rotation_rounding``)
torch.library.define(
    "headwise::paged_decode_attention",
    "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor seen_from, Tensor seen_to, int block_size, float scale, "
    "float softcap=0.0, Tensor? sinks=None, Tensor? alibi=None) -> Tensor",
)


@torch.library.register_fake("headwise::decode_attention")
def _dense_shape(q: Tensor, k: Tensor, v: Tensor, real: Tensor | None, scale: float, softcap: float = 0.0, sinks: Tensor | None = None,
                 alibi: Tensor | None = None) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[1], 1, v.shape[3] - (SCALE_BYTES if v.dtype == torch.int8 else 0))  # (B, H, 1, Dv)


@torch.library.register_fake("headwise::paged_decode_attention")
def _paged_shape(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seen_from: Tensor, seen_to: Tensor, block_size: int,
                 scale: float, softcap: float = 0.0, sinks: Tensor | None = None, alibi: Tensor | None = None) -> Tensor:
    return q.new_empty(*q.shape[:3], v_pool.shape[-1] - (SCALE_BYTES if v_pool.dtype == torch.int8 else 0))  # (N, Hkv, G, Dv)


@torch.library.register_fake("headwise::decode_step")
def _step_shape(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor, v_cache: Tensor,
                real: Tensor | None, start: int, scale: float, softcap: float = 0.0, sinks: Tensor | None = None,
                alibi: Tensor | None = None) -> Tensor:
    return q.new_empty(q.shape[0], 1, q.shape[1] * v.shape[3])  # (B, 1, H * Dv)


@torch.library.register_fake("headwise::paged_step")
def _paged_step_shape(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, k_pool: Tensor, v_pool: Tensor,
                      slots: Tensor, rows: Tensor, tables: Tensor, seen_to: Tensor, window: int | None, block_size: int, scale: float,
                      softcap: float = 0.0, sinks: Tensor | None = None, alibi: Tensor | None = None) -> Tensor:
    return q.new_empty(1, q.shape[2], q.shape[1] * v.shape[3])  # (1, N, H * Dv)


@torch.compiler.assume_constant_result
def available() -> bool:
    """Whether the kernel is built and loaded on this machine (built at the first call; a constant in a compiled graph)."""
    return native.built()


def takes(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> bool:
    """Whether ``decode_attention`` computes this call: one query per row on the CPU, at least one query head (none: an
    empty answer, left to the runners that take zero sizes), float32 or bfloat16 operands of one dtype, key and value
    rows contiguous, every key seen but padding, or (eager) a causal window's last keys, no mask or documents, a
    softcap, ALiBi and sinks (none that wants a gradient) or not, and no dropout."""
    s = spec
    return (
        q.device.type == "cpu" and q.shape[2] == 1 and q.shape[1] > 0 and q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
        and k.stride(-1) == 1 and v.stride(-1) == 1 and s.mask is None and s.documents is None
        and s.dropout_p == 0.0 and (s.window is None or (s.causal and not compiling()))
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (s.sinks, s.alibi)))
    )


def run(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """(B, H, 1, D) x (B, Hkv, S, D) x (B, Hkv, S, Dv) -> (B, H, 1, Dv): the runner of a call ``takes`` accepts. A
    window's query (at position S - 1) sees the last W keys: the op reads those alone (views, nothing copied)."""
    real, S = spec.attention_mask, spec.S
    if spec.window is not None and spec.window < S:
        k, v = k[:, :, S - spec.window :], v[:, :, S - spec.window :]  # (B, Hkv, W, D), (B, Hkv, W, Dv)
        real = None if real is None else real[:, S - spec.window :]  # (B, W)
    return dense(q, k, v, real, spec.scale, *kernel_terms(spec))


def dense(q: Tensor, k: Tensor, v: Tensor, real: Tensor | None, scale: float, softcap: float = 0.0, sinks: Tensor | None = None,
          alibi: Tensor | None = None) -> Tensor:
    """(B, H, 1, D) x (B, Hkv, S, D) x (B, Hkv, S, Dv), ``real`` (B, S) bool or None, the softcap (0: none), ``sinks`` (H,)
    and ``alibi`` (1 or B, H) float32 or None -> (B, H, 1, Dv): ``run``'s op, for a decode step whose plan was made once
    (``functional.decode_kernel_call``)."""
    return torch.ops.headwise.decode_attention(q, k, v, real, scale, softcap, sinks, alibi)


def step(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, k_cache: Tensor, v_cache: Tensor,
         real: Tensor | None, start: int, scale: float, softcap: float = 0.0, sinks: Tensor | None = None,
         alibi: Tensor | None = None) -> Tensor:
    """A decode step's attention in one op, for a step whose plan was made once (``functional.decode_kernel_call``):
    q (B, H, 1, D), k (B, Hkv, 1, D) and v (B, Hkv, 1, Dv), q and k turned by ``rope.rotate``'s "rotate_half" tables
    cos and sin ((1, D) or (B, 1, 1, D) float32) where given, k and v written at slot ``start`` of the caches
    (B, Hkv, L, D) and (B, Hkv, L, Dv) (an 8-bit cache's rows rounded as ``quantize_rows`` rounds them, the queries
    in float32), then ``dense`` over slots 0 .. start (``real`` (B, L) or None; the terms as ``dense``'s) -> (B, 1, H * Dv),
    the heads merged.
    The same ATen ops as ``rotate``, the cache's write and ``dense`` in Python: the same bits."""
    return torch.ops.headwise.decode_step(q, k, v, cos, sin, k_cache, v_cache, real, start, scale, softcap, sinks, alibi)


def paged_step(q: Tensor, k: Tensor, v: Tensor, cos: Tensor | None, sin: Tensor | None, k_pool: Tensor, v_pool: Tensor,
               slots: Tensor, rows: Tensor, tables: Tensor, seen_to: Tensor, window: int | None, block_size: int, scale: float,
               softcap: float = 0.0, sinks: Tensor | None = None, alibi: Tensor | None = None) -> Tensor:
    """A paged batch's decode step in one op, every sequence feeding one token (``functional.paged_kernel_call``): q
    (1, H, N, D), k (1, Hkv, N, D) and v (1, Hkv, N, Dv), token n of sequence n, q and k turned by ``rope.rotate``'s
    "rotate_half" tables (1, 1, N, D) where given, k and v written at the contiguous pools' ``slots`` (N,) (an 8-bit
    pool's rows as ``step`` writes them), then ``paged``'s one call: query ``rows[n]`` over its block table
    ``tables[n]``, the keys before ``seen_to[n]`` (the last ``window`` of them where given), the terms as ``paged``'s ->
    (1, N, H * Dv), the heads merged. The same ops as the paged batch's path in Python (the write, the queries in the pool's dtype widened, the
    call, the context placed in the pool's dtype): the same bits."""
    return torch.ops.headwise.paged_step(q, k, v, cos, sin, k_pool, v_pool, slots, rows, tables, seen_to, window, block_size, scale,
                                         softcap, sinks, alibi)


def rotation_rounding() -> str:
    """How ``step`` rounds its rotation's ``x1·cos - x2·sin`` in its own loop: as torch's ``addcmul_`` does on this
    machine's CPU capability, which it asked once: "once" (a fused multiply-add), "twice" (the product, then the sum),
    or "neither" (``addcmul_`` gave neither everywhere, or the kernels are not built: ``step`` runs ``rotate``'s ATen ops)."""
    return ("neither", "once", "twice")[torch.ops.headwise.rotation_rounding()] if available() else "neither"


def paged(q: Tensor, k_pool: Tensor, v_pool: Tensor, tables: Tensor, seen_from: Tensor, seen_to: Tensor, block_size: int,
          scale: float, softcap: float = 0.0, sinks: Tensor | None = None, alibi: Tensor | None = None) -> Tensor:
    """``backends.paged.rows_over_blocks`` in C++: q (N, Hkv, G, D) float32 or bfloat16, contiguous pools (Hkv, P, D) and
    (Hkv, P, Dv) of either (or, under float32 queries, 8-bit rows (Hkv, P, D + 4) and (Hkv, P, Dv + 4) int8, each value
    read as ``dequantize_rows`` reads it), tables (N, nb) long, seen_from / seen_to (N,) long, the terms as ``dense``'s
    (sinks (H,) and slopes (1 or N, H) for H = Hkv * G; each sequence's query at position seen_to - 1 of its table) ->
    (N, Hkv, G, Dv) in q's dtype."""
    tables, seen_from, seen_to = (t.contiguous() for t in (tables, seen_from, seen_to))  # read as plain arrays
    return torch.ops.headwise.paged_decode_attention(q, k_pool, v_pool, tables, seen_from, seen_to, block_size, scale, softcap, sinks,
                                                     alibi)
