"""The wheel: built from this checkout, installed into a fresh virtual environment that holds torch
alone, it gives `import headwise`, every public name, `headwise demo` and the learner's tools.

The fresh environment borrows this interpreter's torch rather than downloading it: a folder of
links to torch and to what torch itself requires (nothing else), named by a ``.pth`` file. pip
installs the wheel with ``--no-index``, so a dependency the wheel declares beyond torch fails
the install instead of being fetched.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from headwise import native

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def requirements(name: str, seen: set[str] | None = None) -> set[str]:
    """``name`` and every distribution it requires, transitively (no extras; markers evaluated here)."""
    seen = set() if seen is None else seen
    key = name.lower().replace("_", "-")
    if key in seen:
        return seen
    seen.add(key)
    for line in metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            requirements(req.name, seen)
    return seen


def link_distributions(names: set[str], folder: Path) -> None:
    """A folder of links to these installed distributions' top-level files and folders (their dist-info included)."""
    folder.mkdir()
    for name in names:
        dist = metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            if not (folder / top).exists() and (base / top).exists():
                (folder / top).symlink_to(base / top)


def env() -> dict[str, str]:
    """The environment for the fresh interpreter: nothing that points back at this checkout."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment with torch (linked) and the headwise wheel built from this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # a copy, so that the build leaves nothing (build/, *.egg-info) in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(source)],
                   check=True, capture_output=True, text=True)
    (wheel,) = dist.glob("headwise-*.whl")

    target = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    link_distributions(requirements("torch"), tmp / "torch-only")
    (site / "torch-only.pth").write_text(str(tmp / "torch-only") + "\n")
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--no-cache-dir", "-q", str(wheel)],
                         capture_output=True, text=True, env=env())
    assert out.returncode == 0, out.stderr  # a requirement beyond torch would fail here: nothing to fetch it from
    return target


def run(venv: Path, *args: str) -> str:
    out = subprocess.run(args, capture_output=True, text=True, env=env(), cwd=venv)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_the_wheel_holds_the_package_the_heads_pages_files_and_the_kernels_source(venv):
    (wheel,) = venv.parent.glob("dist/headwise-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    kernels = {f"headwise/{path.relative_to(Path(native.__file__).parent).as_posix()}" for path in (*native.SOURCES, *native.HEADERS)}
    assert {"headwise/__init__.py", "headwise/grade/__init__.py", "headwise/viz/page.html", "headwise/viz/page.css", "headwise/viz/page.js",
            "headwise/backends/decode_attention.cpp", "headwise/backends/vectors.h", *kernels} <= set(names)  # every C++ file the build reads
    assert not any(n.startswith(("tests/", "docs/")) for n in names)
    requires = [line for line in zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode().splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert requires == ["Requires-Dist: torch>=2.5"]


def test_the_wheels_metadata_carries_the_classifiers(venv):
    (wheel,) = venv.parent.glob("dist/headwise-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
    classifiers = meta.get_all("Classifier") or []
    assert {
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Intended Audience :: Science/Research",
        "Intended Audience :: Education",
        "Intended Audience :: Developers",
        "Programming Language :: Python :: 3 :: Only",
    } <= set(classifiers)
    assert sum(c.startswith("Development Status :: ") for c in classifiers) == 1
    assert any(c.startswith("Operating System :: ") for c in classifiers)
    assert meta["License-Expression"] == "MIT" and not any(c.startswith("License ::") for c in classifiers)  # the SPDX field alone
    # every Python version named is one requires-python admits, the oldest admitted one among them
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Programming Language :: Python :: 3.")]
    allowed = SpecifierSet(meta["Requires-Python"])
    assert versions and all(allowed.contains(f"{v}.0") for v in versions)
    assert min(versions, key=lambda v: tuple(map(int, v.split(".")))) == str(allowed).removeprefix(">=")


def test_the_environment_holds_torch_and_no_optional_package(venv):
    code = textwrap.dedent(f"""
        import importlib.util, headwise, torch
        print(headwise.__file__.startswith({str(venv)!r}), torch.__version__)
        print([m for m in ("transformers", "safetensors", "tokenizers", "matplotlib", "nbformat", "pytest") if importlib.util.find_spec(m)])
    """)
    lines = run(venv, str(venv / "bin" / "python"), "-c", code).splitlines()
    assert lines[0].startswith("True ") and lines[1] == "[]"


def test_every_public_name_imports_and_the_learners_tools_work(venv):
    code = textwrap.dedent("""
        import headwise as hw
        names = {name: getattr(hw, name) for name in hw.__all__}
        parts = [getattr(hw, name).__name__ for name in hw.SUBMODULES]
        from headwise import *  # noqa: F403
        print(sorted(names), parts)
        print(hw.grade(hw.MultiHeadAttention).exit_code, hw.explain().steps[9].tensors["output"].shape)
        try:
            hw.hf.register()
        except ImportError as e:
            print(e)
    """)
    lines = run(venv, str(venv / "bin" / "python"), "-c", code).splitlines()
    import headwise

    assert lines[0] == f"{sorted(headwise.__all__)} {[f'headwise.{name}' for name in headwise.SUBMODULES]}"  # this checkout's names, from the wheel
    assert lines[1] == "0 torch.Size([1, 6, 2])"
    assert "pip install 'headwise[hf]'" in lines[2]


def test_headwise_demo_prints_the_books_numbers(venv):
    out = run(venv, str(venv / "bin" / "headwise"), "demo")
    assert "-0.4519,  0.2216,  0.4772,  0.1063" in out and "0.3190, 0.4858" in out
    assert out.count("matches the book to 4 decimals") == 2 and "DIFFERS" not in out
    assert "skipped:" in out and "pip install" in out  # the sentence encoder's weights are not installed: said, not a traceback


def test_the_installed_kernels_sources_build_and_run(venv):
    code = textwrap.dedent("""
        import torch
        from headwise.backends import decode_kernel
        from headwise.backends.spec import Spec
        from headwise import native
        print(all(s.is_file() for s in native.SOURCES), decode_kernel.available())
        q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 9, 64), torch.randn(1, 2, 9, 64)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
        print(torch.allclose(decode_kernel.run(q, k, v, Spec(1, 9, causal=True, scale=0.125)), want, atol=1e-6))
        from headwise.backends import prefill_kernel  # the prompt's kernel, from the same library
        q, k, v = torch.randn(1, 4, 70, 64), torch.randn(1, 2, 70, 64), torch.randn(1, 2, 70, 64)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        print(torch.allclose(prefill_kernel.run(q, k, v, Spec(70, 70, causal=True, scale=0.125)), want, atol=1e-5))
    """)
    assert run(venv, str(venv / "bin" / "python"), "-c", code).splitlines() == ["True True", "True", "True"]
