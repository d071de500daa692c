"""The C++ library's build cache: a build is announced exactly where torch's builder will compile."""

from __future__ import annotations

import logging
import os
import pathlib
import types

import pytest

from headwise import native


def _cache(directory):
    return types.SimpleNamespace(_get_build_directory=lambda name, verbose: str(directory))


def test_a_library_counts_as_cached_only_if_ninja_would_keep_it(tmp_path):
    name = "headwise_native_test"
    cache = _cache(tmp_path)
    assert not native._in_cache(cache, name)  # nothing built yet
    newest = max(s.stat().st_mtime for s in (*native.SOURCES, *native.HEADERS))
    (tmp_path / "build.ninja").write_text("\n".join(f"build x.o: compile {s}" for s in native.SOURCES))
    library = tmp_path / f"{name}.so"
    library.write_bytes(b"")
    os.utime(library, (newest + 10, newest + 10))
    assert native._in_cache(cache, name)  # built after the sources, from these paths: a load
    os.utime(library, (newest - 10, newest - 10))
    assert not native._in_cache(cache, name)  # the sources written since (a reinstall): ninja rebuilds
    os.utime(library, (newest + 10, newest + 10))
    (tmp_path / "build.ninja").write_text("build x.o: compile /elsewhere/decode_attention.cpp")
    assert not native._in_cache(cache, name)  # another environment's copy of the same sources: rebuilt too


def test_the_build_script_is_read_once_a_call(tmp_path, monkeypatch):
    name = "headwise_native_test"
    (tmp_path / "build.ninja").write_text("\n".join(f"build x.o: compile {s}" for s in native.SOURCES))
    (tmp_path / f"{name}.so").write_bytes(b"")
    newest = max(s.stat().st_mtime for s in (*native.SOURCES, *native.HEADERS))
    os.utime(tmp_path / f"{name}.so", (newest + 10, newest + 10))
    reads = []
    read_text = pathlib.Path.read_text
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: reads.append(self) or read_text(self, *a, **k))
    assert native._in_cache(_cache(tmp_path), name)
    assert reads == [tmp_path / "build.ninja"]


def test_without_ninja_the_warning_names_what_installs_it_and_no_build_is_announced(monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setattr(native, "_ninja_on_path", lambda: None)
    monkeypatch.setattr(native.shutil, "which", lambda cmd: None)

    def load(*args, **kwargs):  # what torch's builder raises without ninja
        raise RuntimeError("Ninja is required to load C++ extensions (pip install ninja to get it)")

    monkeypatch.setattr(cpp_extension, "load", load)
    assert _refused_build(caplog) == [
        "headwise: the C++ kernels could not be built (ninja, which torch's builder runs, is not installed: "
        "pip install 'headwise[models]' or pip install ninja); decode steps keep torch's kernels and inductor's code"
    ]


def _refused_build(caplog) -> list[str]:
    """``native._build()``'s warnings where it gives up (it must): no build announced on the ``headwise`` logger."""
    with caplog.at_level(logging.WARNING, logger="headwise"), pytest.warns(UserWarning) as warned:
        assert native._build() is False
    assert "building" not in caplog.text
    return [str(w.message) for w in warned]


def test_threads_racing_to_the_first_call_build_once(monkeypatch):
    """Four threads at the first ``built()``: one builds (and announces it), the others wait for its answer."""
    import threading
    import time

    calls = []

    def build():
        calls.append(threading.current_thread().name)
        time.sleep(0.2)  # a build takes a while: the others arrive meanwhile
        return True

    monkeypatch.setattr(native, "_ANSWER", [])
    monkeypatch.setattr(native, "_build", build)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(native.built())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert answers == [True] * 4 and len(calls) == 1


def test_what_a_killed_or_corrupted_build_left_is_cleared_before_a_load(tmp_path):
    """Under the build lock: torch's ``lock`` file of a killed build (it made every later load wait for ever) is
    removed; a library whose bytes are not those sealed after its last load, or with no seal (a truncated copy crashed
    the process with SIGBUS), is removed, so the load builds it again; a sealed, intact one is kept."""
    name = "headwise_native_test"
    library, seal = tmp_path / f"{name}.so", tmp_path / f"{name}.so.sha256"
    (tmp_path / "lock").write_text("")
    library.write_bytes(b"\x7fELF the library")
    native._seal(tmp_path, name)
    assert native._checked_cache(tmp_path, name) and library.exists() and not (tmp_path / "lock").exists()
    library.write_bytes(b"\x7fELF the libr")  # cut short
    assert not native._checked_cache(tmp_path, name)
    assert not library.exists() and not seal.exists()
    assert not native._checked_cache(tmp_path, name)  # nothing there: a build
    library.write_bytes(b"\x7fELF the libr")  # cut short, never sealed (a cache copied in part): loading it faulted
    assert not native._checked_cache(tmp_path, name) and not library.exists()


def test_the_build_lock_is_held_inside_and_released_after(tmp_path):
    import fcntl

    with native._one_builder(tmp_path) as alone:
        assert alone
        with open(tmp_path / "headwise.flock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file (as another process has): refused
    with open(tmp_path / "headwise.flock") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
    (tmp_path / "file").write_text("")
    with native._one_builder(tmp_path / "file" / "below") as alone:
        assert not alone  # a folder it cannot make: unguarded


def test_without_a_compiler_one_warning_says_so_and_no_build_is_announced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing cached: a build
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(native, "_ninja_on_path", lambda: None)
    monkeypatch.setattr(native.shutil, "which", lambda cmd: "/usr/bin/ninja" if cmd == "ninja" else None)
    assert _refused_build(caplog) == [
        "headwise: the C++ kernels could not be built (no C++ compiler: '/nonexistent/c++' is not on PATH; install one "
        "(g++) or set CXX to it); decode steps keep torch's kernels and inductor's code"
    ]


def test_a_failed_builds_reason_is_the_compilers_first_error():
    output = ("Error building extension 'headwise_native_x': [1/6] c++ -MMD -O3 decode_attention.cpp\nFAILED: decode_attention.o\n"
              "decode_attention.cpp:12:3: error: 'foo' was not declared in this scope\nninja: build stopped: subcommand failed.")
    assert native._reason(RuntimeError(output)) == "RuntimeError: decode_attention.cpp:12:3: error: 'foo' was not declared in this scope"
    assert native._reason(OSError("short")) == "OSError: short"


def test_each_installed_copy_keeps_a_library_of_its_own(monkeypatch, tmp_path):
    """Two environments with one torch hold the same sources in two folders: each names its own library (one folder,
    whose build script names one copy's paths, was rebuilt by each environment in turn); the same copy, the same name."""
    here = native.library_name("AVX2")
    assert native.library_name("AVX2") == here != native.library_name("AVX512")
    monkeypatch.setattr(native, "_HERE", tmp_path)  # the same source bytes, read from another environment's folder
    assert native.library_name("AVX2") != here
