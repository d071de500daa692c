"""headwise's C++ ops, built at run time into one library: the decode step's attention
(``backends/decode_attention.cpp``, run by ``backends.decode_kernel``), a prompt's attention
(``backends/prefill_attention.cpp``, run by ``backends.prefill_kernel``), the few-row GEMM of a
compiled step (``linear/panels.cpp``, run by ``linear.panels``), RMSNorm's rows
(``models/rms_norm.cpp``, run by ``models.llama.RMSNorm``), a Llama-family layer's decode step
(``models/decoder_layer.cpp``, run by ``models.native_layer``), greedy decoding's token (``models/greedy.cpp``, run by
``models.generate.greedy``), the samples of the weights that kept copies were
made from (``linear/watched.cpp``, read by ``linear.weight_cache.verify``) and a few modules' tensors' state compared in
one call (``linear/seen.cpp``, asked by ``linear.weight_cache.Seen``: plain C functions called through ``ctypes``,
``function``).

``torch.utils.cpp_extension`` builds the library for the instruction set torch's own CPU kernels
run with (``torch.backends.cpu.get_cpu_capability()``), once per machine, torch, source and installed copy (then
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
import ctypes
import functools
import hashlib
import itertools
import logging
import os
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

_HERE = Path(__file__).parent
#: The C++ sources of the library, one file per op family.
SOURCES = (_HERE / "backends" / "decode_attention.cpp", _HERE / "backends" / "prefill_attention.cpp", _HERE / "linear" / "panels.cpp",
           _HERE / "models" / "rms_norm.cpp", _HERE / "models" / "decoder_layer.cpp", _HERE / "models" / "greedy.cpp",
           _HERE / "linear" / "watched.cpp", _HERE / "linear" / "seen.cpp")
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
    """torch's extension build runs ``ninja`` from PATH: the PyPI package's (``pip install ninja``, in ``[models]``) first
    where it is installed, so that every process runs the same one (two ninjas take turns throwing each other's build
    log away, and rebuild the library unannounced); else whichever PATH gives."""
    with contextlib.suppress(ImportError):
        import ninja

        if shutil.which("ninja") != shutil.which("ninja", path=ninja.BIN_DIR):
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


_BUILDING = threading.Lock()  # threads racing to the first call: one builds, the others wait for its answer


def built() -> bool:
    """Build (or load from torch's extension cache) the library once a process; False, with one warning, where it
    cannot be built (no compiler, no ninja, no setuptools for torch's builder, a failed build)."""
    if not _ANSWER:
        with _BUILDING:
            if not _ANSWER:
                _ANSWER.append(_build())
    return _ANSWER[0]


_ANSWER: list[bool] = []  # built()'s answer, once given


def loaded() -> bool:
    """Whether the library is loaded in this process (``built()`` answered True): asks nothing, builds nothing."""
    return bool(_ANSWER) and _ANSWER[0]


_PATH: list[str] = []  # the loaded library's file


@functools.cache
def function(name: str, restype: object, *argtypes: object) -> Callable:
    """The library's plain C function ``name`` (an ``extern "C"`` one that takes Python objects) through ``ctypes.PyDLL``,
    which keeps the GIL and checks Python's error flag after each call; for a loaded library only (``loaded()``)."""
    function = getattr(ctypes.PyDLL(_PATH[0]), name)
    function.restype, function.argtypes = restype, argtypes
    return function


_KEYS = itertools.count(1)


def keyed(owner: object, forget: str) -> int:
    """A key no other object got (from 1), for ``owner``'s entry in a table the library keeps: the library's
    ``forget(key)`` drops the entry when ``owner`` dies."""
    key = next(_KEYS)
    weakref.finalize(owner, function(forget, None, ctypes.c_int64), key).atexit = False
    return key


def library_name(isa: str) -> str:
    """The library's name in torch's extension cache: its sources' and headers' bytes, the instruction set, torch's
    version and the installed copy's folder (two environments with one torch keep a library each: a folder's build
    script names its sources' paths, so a shared one was rebuilt by each environment in turn)."""
    where = f"{isa} {torch.__version__} {_HERE.resolve()}"
    return "headwise_native_" + hashlib.sha256(b"".join(s.read_bytes() for s in (*SOURCES, *HEADERS)) + where.encode()).hexdigest()[:16]


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
    name = library_name(isa)
    directory = _build_directory(cpp_extension, name)
    try:
        with _one_builder(directory) as alone:  # released by the kernel when this process ends, however it ends
            cached = _checked_cache(directory if alone else None, name) and _in_cache(cpp_extension, name)
            if not cached:
                compiler = os.environ.get("CXX", "c++")
                if shutil.which(compiler) is None:
                    _cannot_build(f"no C++ compiler: {compiler!r} is not on PATH; install one (g++) or set CXX to it")
                    return False
                logging.getLogger("headwise").warning(
                    "headwise: building its C++ kernels for this machine and torch version (once, seconds to a minute; "
                    "later processes load them from torch's extension cache)")
            try:
                _load(cpp_extension, name, flags)
            except OSError as e:  # a library that links but cannot be loaded: removed
                library = None if directory is None else directory / f"{name}.so"
                if not alone or library is None or not library.exists():
                    raise
                library.unlink()  # (torch's builder does not build it again within this process)
                raise OSError(f"the cached library {library} could not be loaded ({e}): it was removed, and the next "
                              "process builds it again") from None
            _seal(directory, name)
    except Exception as e:  # no compiler, a failed build: torch's kernels and inductor's code stay
        _cannot_build(_reason(e))
        return False
    return True


def _load(cpp_extension: object, name: str, flags: tuple[str, ...]) -> None:
    _PATH[:] = [cpp_extension.load(
        name, [str(s) for s in SOURCES], extra_cflags=["-O3", "-fopenmp", *flags],
        extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False,
    )]  # (the library's path, where torch loaded it from)


def _build_directory(cpp_extension: object, name: str) -> Path | None:
    """torch's folder for the library ``name`` (None where its private helper is gone or fails)."""
    try:
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except Exception:
        return None


@contextlib.contextmanager
def _one_builder(directory: Path | None) -> Iterator[bool]:
    """One process at a time builds or loads the library: an exclusive ``flock`` on a file of the build folder, which
    the kernel releases when its holder ends (killed or not); True inside. Where it cannot be taken (no folder, no
    ``fcntl``, a read-only folder), False: the block runs unguarded, as torch's own builder would."""
    try:
        import fcntl

        directory.mkdir(parents=True, exist_ok=True)
        held = open(directory / "headwise.flock", "a")  # noqa: SIM115 (held open for the block)
    except Exception:
        yield False
        return
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield True
    finally:
        held.close()  # (closing releases the lock)


def _checked_cache(directory: Path | None, name: str) -> bool:
    """Under ``_one_builder``'s lock (``directory`` None elsewhere: nothing checked): clear what a killed or corrupted build left (torch's ``lock`` file, whose builder no longer
    holds the flock, would make ``cpp_extension.load`` wait for ever; a library whose bytes are not the ones sealed after
    it last loaded, or with no seal, would be loaded and crash the process: a truncated one faults in the loader, SIGBUS,
    which no ``except`` catches), so that the next load builds anew. False where the library is not there (then or now)."""
    if directory is None:
        return True
    (directory / "lock").unlink(missing_ok=True)
    library, seal = directory / f"{name}.so", directory / f"{name}.so.sha256"
    if not library.is_file():
        return False
    if not seal.is_file() or seal.read_text().strip() != _digest(library):  # unsealed: never loaded whole here (a
        library.unlink()  # build killed before its first load, a cache copied in part): linked again from its objects
        seal.unlink(missing_ok=True)
        return False
    return True


def _seal(directory: Path | None, name: str) -> None:
    """After a load: the library's sha256 beside it, which ``_checked_cache`` compares at the next process's load."""
    if directory is None:
        return
    library = directory / f"{name}.so"
    with contextlib.suppress(OSError):
        (directory / f"{name}.so.sha256").write_text(_digest(library) + "\n")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _reason(e: Exception) -> str:
    """The cause of a failed build in a line or two: the compiler's first error where torch quotes the build's output."""
    text = str(e)
    errors = [line.strip() for line in text.splitlines() if "error" in line.lower() or "not found" in line]
    first = errors[1] if len(errors) > 1 and errors[0].startswith("Error building extension") else (errors[0] if errors else text)
    return f"{type(e).__name__}: {first[:300]}"


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
