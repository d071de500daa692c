"""The C++ library's build cache: a build is announced exactly where torch's builder will compile."""

from __future__ import annotations

import os
import types

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
