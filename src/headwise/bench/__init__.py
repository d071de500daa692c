"""Benchmarks: headwise against the peers, side by side, on this machine.

Every implementation computes the same causal self-attention layer (B, T, C) -> (B, T, C):
Q/K/V projections, attention over H heads of size D = C / H, heads merged, an output
projection (the book's wrapper has none). Fairness rules:

- one case (mode, shape, dtype) builds every implementation, warms each up, then times them
  interleaved, A B C A B C ..., so that noise from other jobs hits all alike; median and
  quartiles are reported;
- forward runs under ``torch.no_grad()`` in eval mode (inference); "backward" times forward +
  ``backward`` of a fixed upstream gradient w.r.t. the input and every parameter;
- ``torch.nn.MultiheadAttention`` gets ``batch_first=True``, the causal mask it needs (bool,
  True = may NOT attend, its convention), ``need_weights=False`` and no projection on top;
- transformers' ``GPT2Attention`` eager gets the additive causal mask its model would build
  (once, outside the timer); its sdpa variant needs none (``is_causal``);
- "memory" runs each case in a fresh subprocess and reports the max RSS during one forward
  minus the RSS just before it (module and input already built);
- the machine's ceiling is measured in the same run: the best GEMM rate torch reaches here
  per dtype (``F.linear``'s BLAS and oneDNN's inner product), so achieved GFLOP/s can be
  read as a share of what the cores can do;
- the header names the CPU (vendor, family/model, AVX-512, AVX512-bf16, AMX), the path
  ``headwise.linear`` took per dtype and why (``headwise.linear.describe()``), and that path's
  GEMM rate as a share of the measured ceiling.

``device="cuda"`` (``headwise bench --device cuda``) runs the same cases on the GPU: each call
timed by CUDA events around it (warm-up waited for, interleaved, medians), rates in TFLOP/s
as a share of the GPU's datasheet peak for the dtype (bf16, or tf32/fp32 as torch's float32
matmul precision says; ``gpu``: none for a GPU the table does not know), and memory as
``torch.cuda.max_memory_allocated`` during one forward beyond what was allocated before it.

Useful FLOPs of one forward (causal, so QK^T and AV count half):
``2·B·T·C·(3C) + 2·B·T·C·C`` for the projections (no ``C·C`` term without an output
projection) plus ``2·B·T²·C`` for attention; forward + backward counts 3x the forward.

The functions return dataclasses; ``main`` (``headwise bench``, ``python -m headwise.bench``)
parses, prints a Markdown table, and plots. The pieces: ``cases`` (what is measured), ``peers``
(the implementations), ``timing`` (the one interleaved loop), ``memory``, ``decode`` (a cached
decode step against transformers'), ``compile`` (headwise's modules and the fused layer under
``torch.compile``, with compile time), ``gpu`` (a GPU's name and peaks), ``harness`` (``run``), ``report`` and ``cli``.
"""

from .cases import DTYPES, MODES, PRESETS, Case, Ceiling, Progress, Report, Row
from .cli import main
from .compile import CompileRow, compile_case
from .decode import DecodeRow, decode_latency
from .harness import machine, run
from .memory import memory_case
from .peers import DEFAULT_SKIP, IMPLS, FusedReference, Impl, select
from .report import fastest_peer, markdown, plot, summary
from .timing import interleaved, measure_ceiling, time_case

__all__ = [
    "DEFAULT_SKIP", "DTYPES", "IMPLS", "MODES", "PRESETS", "Case", "Ceiling", "CompileRow", "DecodeRow", "FusedReference", "Impl", "Progress",
    "Report", "Row", "compile_case", "decode_latency", "fastest_peer", "interleaved", "machine", "main", "markdown", "measure_ceiling", "memory_case",
    "plot", "run", "select", "summary", "time_case",
]
