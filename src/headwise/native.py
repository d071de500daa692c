"""headwise's C++ ops, built at run time into one library: the decode step's attention
(``backends/decode_attention.cpp``, run by ``backends.decode_kernel``), a prompt's attention
(``backends/prefill_attention.cpp``, run by ``backends.prefill_kernel``), the few-row GEMM of a
compiled step (``linear/panels.cpp``, run by ``linear.panels``), RMSNorm's rows
(``models/rms_norm.cpp``, run by ``models.llama.RMSNorm``) and a Llama-family layer's decode step
(``models/decoder_layer.cpp``, run by ``models.native_layer``).

``torch.utils.cpp_extension`` builds the library for the instruction set torch's own CPU kernels
run with (``torch.backends.cpu.get_cpu_capability()``), once per machine, torch and source (then
loaded from torch's extension cache), at the first call that could use it: a decode step's attention on
the CPU (eager or compiled), a compiled step's projections, a paged batch made with ``compile=True``.
A build (seconds to a minute) is announced on the ``headwise`` logger; a load from torch's cache takes
about a second. If it cannot be built, ``built()`` is False, with one warning, and the callers
keep torch's kernels and inductor's code.
The ops' schemas are defined on the Python side (each caller's module, whenever it is imported: the dispatcher
takes a kernel before its schema), their CPU kernels in C++.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import warnings
from pathlib import Path

import torch

_HERE = Path(__file__).parent
#: The C++ sources of the library, one file per op family.
SOURCES = (_HERE / "backends" / "decode_attention.cpp", _HERE / "backends" / "prefill_attention.cpp", _HERE / "linear" / "panels.cpp",
           _HERE / "models" / "rms_norm.cpp", _HERE / "models" / "decoder_layer.cpp")
#: Headers the sources include: hashed with them (a changed header is a new library).
HEADERS = (_HERE / "backends" / "vectors.h",)
#: The extra that installs ninja, which torch's extension builder runs.
NINJA_EXTRA = "headwise[models]"
#: Compiler flags per torch CPU capability: the kernels' vector code is the instruction set torch's own kernels use.
ISA_FLAGS = {
    "AVX512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"),
    "AVX2": ("-mavx2", "-mfma"),
}


def _ninja_on_path() -> None:
    """torch's extension build runs ``ninja`` from PATH: where PATH has none, the PyPI package's (``pip install ninja``, in
    ``[models]``), whose binary sits in its own folder when its environment's ``bin`` is not on PATH."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


_BUILDING = threading.Lock()  # threads racing to the first call: one builds, the others wait for its answer


def built() -> bool:
    """Build (or load from torch's extension cache) the library once a process; False, with one warning, where it
    cannot be built (no compiler, no ninja, no setuptools for torch's builder, a failed build)."""
    if (answer := _answer()) is not None:
        return answer
    with _BUILDING:
        if (answer := _answer()) is None:
            answer = _build()
            _ANSWER.append(answer)
        return answer


_ANSWER: list[bool] = []  # built()'s answer, once given


def _answer() -> bool | None:
    return _ANSWER[0] if _ANSWER else None


def _build() -> bool:
    try:
        from torch.utils import cpp_extension  # imports setuptools, which a Python 3.12+ environment may lack
    except ImportError as e:
        _cannot_build(f"{type(e).__name__}: {e}")
        return False
    _ninja_on_path()
    if shutil.which("ninja") is None:  # torch's builder runs it for a load from its cache too: say so before announcing a build
        _cannot_build(f"ninja, which torch's builder runs, is not installed: pip install '{NINJA_EXTRA}' or pip install ninja")
        return False
    isa = torch.backends.cpu.get_cpu_capability()
    flags = ISA_FLAGS.get(isa, ())
    digest = hashlib.sha256(b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + f"{isa} {torch.__version__}".encode()).hexdigest()[:16]
    name = f"headwise_native_{digest}"
    try:
        if not _in_cache(cpp_extension, name):
            logging.getLogger("headwise").warning(
                "headwise: building its C++ kernels for this machine and torch version (once, seconds to a minute; later "
                "processes load them from torch's extension cache)")
        cpp_extension.load(
            name, [str(s) for s in SOURCES], extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
        )
    except Exception as e:  # no compiler, a failed build: torch's kernels and inductor's code stay
        _cannot_build(f"{type(e).__name__}: {e}")
        return False
    return True


def _cannot_build(reason: str) -> None:
    warnings.warn(f"headwise: the C++ kernels could not be built ({reason}); decode steps keep "
                  "torch's kernels and inductor's code", stacklevel=4)


def _in_cache(cpp_extension: object, name: str) -> bool:
    """Whether torch's extension cache holds the library ``name`` as ninja would keep it (a load, not a build): built
    after the sources were last written, from these sources' paths (a reinstall or another environment's copy of
    the same sources is rebuilt)."""
    folder = getattr(cpp_extension, "_get_build_directory", None)  # a private helper of torch's: if it is gone or
    try:  # changed, say nothing
        if folder is None:
            return True
        directory = Path(folder(name, verbose=False))
        library, script = directory / f"{name}.so", directory / "build.ninja"
        if not (library.is_file() and script.is_file()):
            return False
        newest = max(s.stat().st_mtime for s in (*SOURCES, *HEADERS))
        if library.stat().st_mtime < newest:
            return False
        text = script.read_text()
        return all(str(s) in text for s in SOURCES)
    except Exception:
        return True
