"""Benchmarks: headwise against the peers and the engines, side by side, on this machine.

One command per question, each timed with the one interleaved loop (``timing.interleaved``: A B C,
B C A, ... so that noise from other jobs hits every contender alike; medians kept), each table
naming the machine and its load before and after every measurement (``host``); ``--busy N``
runs N spinning processes beside it.

| question | command | module |
|---|---|---|
| how fast is the attention layer against the peers (forward, backward, memory, compiled, a decode step of the attention stack)? | ``headwise bench`` | ``harness``, ``cases``, ``peers``, ``timing``, ``memory``, ``compile``, ``decode``, ``report``, ``cli`` |
| how fast do whole models decode, against transformers, CTranslate2 and llama.cpp? | ``python -m headwise.bench.model_decode`` (``headwise bench --modes model-decode``) | ``model_decode``, ``generation``, ``engines``, ``conversions``, ``models`` |
| does ``attn_implementation="headwise"`` speed up a transformers model? | ``headwise bench --modes hf`` | ``hf`` |
| what do packed documents, softcap, sinks and ALiBi cost, against the other ways? | ``headwise bench --variants`` | ``variants`` |
| how fast is serving many requests (continuous batching vs alone vs a static batch)? | ``python -m headwise.bench.serving`` | ``serving``, ``paged_attention`` (the ways to read paged blocks) |
| which path is faster for one projection at a given row count, F.linear or oneDNN's packed weight, and which does the rule take? | ``python -m headwise.bench.projections`` | ``projections`` |
| which way should a decode step's attention run (torch's ways, headwise's C++ kernel)? | ``python -m headwise.bench.decode_attention`` | ``decode_attention`` |
| what does the C++ kernel gain a whole decode step, compiled or eager (``--eager``)? | ``python -m headwise.bench.compiled_attention`` | ``compiled_attention`` |
| how many calls should a causal prompt's attention take on the CPU, quiet or with a core busy? | ``python -m headwise.bench.causal_blocks`` | ``causal_blocks`` |
| how fast does the compiled step's panels GEMM read the weights, against torch's kernel for the same operands? | ``python -m headwise.bench.panels`` | ``panels`` |
| how fast does greedy pick its token (torch's argmax against ``greedy``)? | ``python -m headwise.bench.greedy`` | ``greedy`` |
| how fast do whole models generate on a GPU, against transformers? | ``python -m headwise.bench.cuda_generate`` | ``cuda_generate`` |

The layer benchmark: every implementation computes the same causal self-attention layer
(B, T, C) -> (B, T, C): Q/K/V projections, attention over H heads of size D = C / H, heads
merged, an output projection (the book's wrapper has none). Fairness rules:

- one case (mode, shape, dtype) builds every implementation, warms each up, then times them
  interleaved; median and quartiles are reported;
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
timed by CUDA events around it (warm-up waited for, interleaved, medians), rates in TFLOP/s as a
share of an 8192³ GEMM's rate measured there the same way, and memory as
``torch.cuda.max_memory_allocated`` during one forward beyond what was allocated before it.

Useful FLOPs of one forward (causal, so QK^T and AV count half):
``2·B·T·C·(3C) + 2·B·T·C·C`` for the projections (no ``C·C`` term without an output
projection) plus ``2·B·T²·C`` for attention; forward + backward counts 3x the forward.

The functions return dataclasses; the commands parse, print Markdown tables, and plot.
"""

from .cases import DTYPES, MODES, PRESETS, Case, Ceiling, Progress, Report, Row
from .cli import main
from .compile import CompileRow, compile_case
from .decode import DecodeRow, decode_latency
from .harness import run
from .host import machine
from .memory import memory_case
from .peers import DEFAULT_SKIP, IMPLS, FusedReference, Impl, select
from .report import fastest_peer, markdown, plot, summary
from .timing import interleaved, measure_ceiling, time_case

__all__ = [
    "DEFAULT_SKIP", "DTYPES", "IMPLS", "MODES", "PRESETS", "Case", "Ceiling", "CompileRow", "DecodeRow", "FusedReference", "Impl", "Progress",
    "Report", "Row", "compile_case", "decode_latency", "fastest_peer", "interleaved", "machine", "main", "markdown", "measure_ceiling", "memory_case",
    "plot", "run", "select", "summary", "time_case",
]
