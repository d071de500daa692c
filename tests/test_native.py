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
    with caplog.at_level(logging.WARNING, logger="headwise"), pytest.warns(UserWarning) as warned:
        assert native._build() is False
    assert [str(w.message) for w in warned] == [
        "headwise: the C++ kernels could not be built (ninja, which torch's builder runs, is not installed: "
        "pip install 'headwise[models]' or pip install ninja); decode steps keep torch's kernels and inductor's code"
    ]
    assert "building" not in caplog.text


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
