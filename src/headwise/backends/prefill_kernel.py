"""A prompt's attention in C++ on the CPU: every query row of a head over its keys, a block of keys at a time.

``headwise::prefill_attention(q, k, v, causal, scale, window, sinks, real, softcap, alibi)`` (``prefill_attention.cpp``): (B, H, T, D)
queries over (B, Hkv, S, D) keys and values, H a multiple of Hkv (GQA), every key seen or causal with
the queries at positions S - T .. S - 1 (a prompt, or its next chunk after S - T cached keys), with a
window W > 0 each seeing only its last W keys (a block of queries reads the keys from its first query's
window on: W + 64 keys, not all before it), with sinks (H,) or not (gpt-oss's: a logit a head that joins each
row's softmax with no value, so the context is divided once by the keys' and the sink's sum), with padded keys
or not (``real`` (B, S) bool, False = padding: a row's keys before its first real one and after its last are not
read, those between are masked; a query that sees no real key gets zeros), with a softcap or not (Gemma 2's:
each score taken to cap * tanh(score / cap), tanh within a few float32 ulps), with ALiBi's slopes (1 or B, H) or not
(each score less slope * |the query's position - the key's|, after the softcap), the
scores, the softmax carried block by block and the weighted sums all in float32, the context in the
queries' dtype. Each item is one head's block of 64 queries: each block of 64 keys is widened once for
them and every 4 queries take it with their sums in registers; a causal block reads only the keys its
queries see. bfloat16 on a CPU with AVX512-BF16: the scores from the bfloat16 queries and keys as they
are, each pair of the head's elements by one ``vdpbf16ps`` (its two products exact in float32, added to
the float32 sums; half the instructions of widened multiply-adds), the rest as above; each output is then
the float64 reference rounded once in all but a few ties, as with the widened scores.

Taken by the plan (``plan.RULES``) on CPUs whose torch kernels run AVX-512 where MKL's GEMMs do not
(AMD's EPYC and Ryzen: there torch's flash kernel runs its blocks' GEMMs at a fraction of the cores'
rate; docs: performance, layers) and, for bfloat16, no AMX tiles (where torch's kernel multiplies in
them). Built with headwise's other C++ ops (``headwise.native``) at the first call that could use it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import native
from .._checks import compiling
from ..machine import cpu, mkl_avx512_on
from .spec import Spec, kernel_terms

#: What the kernel reads and writes (sums in float32).
DTYPES = (torch.float32, torch.bfloat16)
#: Head sizes it computes (queries, keys and values alike): MiniLM's 32, GPT-2's and Llama's 64 and 128, Phi-2's 80,
#: Phi-3's 96, Gemma's 256 (any multiple of 16 would do: each is a build of its own, so only these are built).
HEAD_SIZES = (32, 64, 80, 96, 128, 256)
#: The fewest query rows a call the plan gives it has: from 8 the kernel was the faster at every size timed, at 2-4
#: rows level with torch's kernel or slower (it scores 32 queries at a time; docs: performance, layers).
FEWEST_ROWS = 8

torch.library.define(
    "headwise::prefill_attention",
    "(Tensor q, Tensor k, Tensor v, bool causal, float scale, int window=0, Tensor? sinks=None, Tensor? real=None, float softcap=0.0, "
    "Tensor? alibi=None) -> Tensor",
)


@torch.library.register_fake("headwise::prefill_attention")
def _shape(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window: int = 0, sinks: Tensor | None = None, real: Tensor | None = None,
    softcap: float = 0.0, alibi: Tensor | None = None,
) -> Tensor:
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], v.shape[3]).transpose(1, 2)  # (B, H, T, Dv), laid out (B, T, H, Dv) as the op's


def _machine_takes() -> bool:
    """AVX-512 kernels in torch, MKL's GEMMs not on AVX-512 (not an Intel CPU's MKL), read once."""
    facts = cpu()
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and not mkl_avx512_on(facts, torch.backends.mkl.is_available())


_MACHINE = _machine_takes()
_AMX = {"amx_tile", "amx_bf16"} <= set(cpu()["flags"])


def takes(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> bool:
    """Whether ``prefill_attention`` computes this call here: a CPU this kernel is for (see the module), ``FEWEST_ROWS``
    or more query rows, float32 or bfloat16 operands of one dtype (bfloat16 not on a CPU with AMX tiles), one head size of
    ``HEAD_SIZES``, rows contiguous, every key seen or causal over S >= T keys (with a window or not), sinks or not, padded
    keys or not, a softcap or not, ALiBi or not, nothing else (no mask, documents or dropout), no autograd, not traced by
    ``torch.compile``."""
    s = spec
    return (
        not compiling()  # first: a traced call guards on every comparison after it (T's would split graphs)
        and _MACHINE and q.device.type == "cpu" and s.T >= FEWEST_ROWS and q.dtype in DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
        and not (q.dtype == torch.bfloat16 and _AMX) and q.shape[-1] in HEAD_SIZES and k.shape[-1] == q.shape[-1]
        and v.shape[-1] == q.shape[-1] and q.shape[0] > 0 and s.S > 0 and q.shape[1] % k.shape[1] == 0
        and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and (not s.causal or s.S >= s.T)
        and (s.window is None or s.causal) and s.mask is None and s.documents is None and s.dropout_p == 0.0
        and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, s.sinks, s.alibi)))
    )


def available() -> bool:
    """Whether the kernel is built and loaded on this machine (built at the first call)."""
    return native.built()


def run(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """(B, H, T, D) x (B, Hkv, S, D) x (B, Hkv, S, D) -> (B, H, T, D): the runner of a call ``takes`` accepts."""
    softcap, sinks, alibi = kernel_terms(spec)  # sinks (H,), slopes (1 or B, H)
    real = None if spec.attention_mask is None else spec.attention_mask.contiguous()  # (B, S) bool, False = padding
    return torch.ops.headwise.prefill_attention(q, k, v, spec.causal, spec.scale, spec.window or 0, sinks, real, softcap, alibi)
