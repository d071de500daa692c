"""The GPU a CUDA run uses: its name, and its datasheet peak rates to read achieved TFLOP/s against.

Peaks are NVIDIA's datasheet numbers for dense math (the datasheets print tensor-core rates
with 2:4 sparsity, twice these), in TFLOP/s, per dtype path: "bf16" (bf16 tensor cores),
"tf32" (fp32 matmuls on tensor cores, when ``torch.get_float32_matmul_precision()`` allows
them) and "fp32" (plain fp32, torch's default). A GPU not in the table gets no share: a
guessed peak would make a wrong percentage.
"""

from __future__ import annotations

import torch

from .cases import Ceiling

#: Name fragment (as in ``torch.cuda.get_device_name()``, most specific first) -> (what it is, dense TFLOP/s per path).
PEAKS: list[tuple[str, str, dict[str, float]]] = [
    ("H100 PCIe", "H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100 NVL", "H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200 NVL", "H200 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("GH200", "GH200 (H100 SXM rates)", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H100", "H100 SXM", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # "NVIDIA H100 80GB HBM3"
    ("H200", "H200 SXM", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", "A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),  # SXM4 and PCIe alike
]


def matmul_path(dtype: str) -> str:
    """The peak that applies to a case in ``dtype`` ("fp32" / "bf16"): "bf16", "tf32" or "fp32"."""
    if dtype == "bf16":
        return "bf16"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def peak(name: str, dtype: str) -> Ceiling | None:
    """The datasheet peak for a GPU called ``name`` running ``dtype`` matmuls; None when unknown.

    Example:
        >>> peak("NVIDIA H100 80GB HBM3", "bf16")
        Ceiling(dtype='bf16', path='H100 SXM datasheet, dense bf16', gflops=989400.0)
        >>> peak("NVIDIA GeForce GTX 1080", "bf16") is None
        True
    """
    path = matmul_path(dtype)
    for fragment, model, rates in PEAKS:
        if fragment.lower() in name.lower():
            return Ceiling(dtype, f"{model} datasheet, dense {path}", rates[path] * 1e3)
    return None


def describe() -> str:
    """``"GPU NVIDIA H100 80GB HBM3 (79 GiB, sm_90), CUDA 12.8"`` for the current device."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return f"GPU {props.name} ({props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}), CUDA {torch.version.cuda}"
