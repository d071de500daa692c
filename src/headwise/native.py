"""headwise's C++ ops, built at run time into one library: the decode step's attention
(``backends/decode_attention.cpp``, run by ``backends.decode_kernel``) and the few-row GEMM of a
compiled step (``linear/panels.cpp``, run by ``linear.panels``).

``torch.utils.cpp_extension`` builds the library for the instruction set torch's own CPU kernels
run with (``torch.backends.cpu.get_cpu_capability()``), once per machine, torch and source (then
loaded from torch's extension cache), at the first call that could use it: those calls come from
``torch.compile`` or a paged batch made with ``compile=True``, which need a C++ compiler already.
If it cannot be built, ``built()`` is False, with one warning, and the callers keep inductor's code.
The ops' schemas are defined on the Python side (each caller's module, whenever it is imported: the dispatcher
takes a kernel before its schema), their CPU kernels in C++.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).parent
#: The C++ sources of the library, one file per op family.
SOURCES = (_HERE / "backends" / "decode_attention.cpp", _HERE / "linear" / "panels.cpp")
#: Compiler flags per torch CPU capability: the kernels' vector code is the instruction set torch's own kernels use.
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}


def _ninja_on_path() -> None:
    """torch's extension build runs ``ninja`` from PATH: where PATH has none, the PyPI package's (``pip install ninja``,
    in ``[test]``), whose binary sits in its own folder when its environment's ``bin`` is not on PATH."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def built() -> bool:
    """Build (or load from torch's extension cache) the library once a process; False, with one warning, where it
    cannot be built (no compiler, no ninja, a failed build)."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    isa = torch.backends.cpu.get_cpu_capability()
    flags = ISA_FLAGS.get(isa, ())
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES) + f"{isa} {torch.__version__}".encode()).hexdigest()[:16]
    try:
        cpp_extension.load(
            f"headwise_native_{digest}", [str(s) for s in SOURCES], extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: inductor's code stays
        warnings.warn(f"headwise: the C++ kernels could not be built ({type(e).__name__}: {e}); compiled steps keep "
                      "inductor's code", stacklevel=3)
        return False
    return True
