"""The projections (Q/K/V, ``c_attn``, ``out_proj``, the MLPs, the LM head): ``F.linear``, oneDNN or the panels GEMM, by one fixed rule.

``F.linear`` on a CPU goes to the BLAS torch was built with (MKL in the official wheels). On AMD
CPUs with AVX-512, oneDNN's own inner product (``mkldnn._linear_pointwise``) runs
float32 GEMMs faster than MKL does on the same cores, with the same float32 accuracy. A decode
step's few rows read each weight once: on CPUs whose torch kernels run AVX-512 headwise's own GEMM
over the weight packed once in panels (``panels.cpp``) reads them at about memory's rate, faster
than either (the timings: the performance docs). Which path a call takes follows a fixed rule,
nothing timed:

- ``rule``: the rule (``choose``, ``choose_few_rows``, ``path_for``, ``uses_onednn``, ``describe``,
  ``set_path`` / ``use_path`` / ``HEADWISE_LINEAR``) over the CPU facts of ``headwise.machine``;
- ``onednn``: oneDNN's private ops behind their guards, their one-time self-test, the autograd
  Function whose backward GEMMs run on oneDNN too, the packed weight;
- ``panels``: the panels GEMM, its packing, the weight packed once (eager) or when a graph is compiled;
- ``weight_cache``: what is made from weights (packed, stacked), kept until a weight changes;
- ``projection``: ``linear``, ``project``, ``project_many``, the entry points the layers call (``release``: what is
  kept for a module dropped, for torch's ``swap_tensors``);
- ``custom_ops``: the opaque ops a compiled inference call runs them as.
"""

from . import custom_ops  # noqa: F401  (registers headwise::linear and headwise::linear_many)
from .projection import linear, owns_output, project, project_many, release
from .rule import (
    AVX2_ROWS,
    AVX2_WIDE_ROWS,
    DECODE_ROWS,
    ENV,
    GEMV_ROWS,
    MIN_DECODE_WEIGHT,
    MIN_ROWS,
    PATHS,
    TESTED_TORCH,
    choose,
    choose_few_rows,
    cpu,
    describe,
    path_for,
    set_path,
    use_path,
    uses_onednn,
)

__all__ = [
    "AVX2_ROWS", "AVX2_WIDE_ROWS", "DECODE_ROWS", "ENV", "GEMV_ROWS", "MIN_DECODE_WEIGHT", "MIN_ROWS", "PATHS", "TESTED_TORCH", "choose", "choose_few_rows", "cpu",
    "describe", "linear", "owns_output", "path_for", "project", "project_many", "release", "set_path", "use_path", "uses_onednn",
]
