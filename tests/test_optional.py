"""Optional dependencies: `import headwise` needs torch alone; a missing extra is named up front."""

from __future__ import annotations

import subprocess
import sys

import pytest

from headwise._optional import require

BLOCK = "import sys\nfor name in ('safetensors', 'tokenizers', 'matplotlib', 'transformers'): sys.modules[name] = None\n"


def test_require_names_the_extra():
    with pytest.raises(ModuleNotFoundError, match=r"reading weights needs the package 'no_such_pkg_hw', which is not installed: pip install 'headwise\[models\]'"):
        require("no_such_pkg_hw", "models", "reading weights")


@pytest.mark.slow
def test_import_and_core_work_without_the_optional_packages():
    code = BLOCK + (
        "import torch, headwise as hw\n"
        "m = hw.MultiHeadAttention(8, 8, 16, 0.0, num_heads=2)\n"
        "print(tuple(m(torch.randn(1, 4, 8)).shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(1, 4, 8)"


@pytest.mark.slow
def test_bench_without_matplotlib_says_which_extra_before_any_work():
    code = BLOCK + "from headwise.bench.cli import main\nmain(['--tokens', '16', '--batch', '1'])\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2
    assert "pip install 'headwise[bench]'" in out.stderr
    assert "GFLOP" not in out.stdout and out.stdout == ""  # nothing was measured


@pytest.mark.slow
def test_models_without_safetensors_say_which_extra(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    code = BLOCK + f"from headwise.models.loading import read_weights\nfrom pathlib import Path\nread_weights(Path({str(tmp_path / 'model.safetensors')!r}))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert "pip install 'headwise[models]'" in out.stderr


@pytest.mark.slow
def test_the_transformers_adapter_without_transformers_says_which_extra():
    code = BLOCK + "import headwise as hw\nhw.hf.register()\n"  # the part loads on first use, then names its extra
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1
    assert "running transformers models on headwise needs the package 'transformers'" in out.stderr
    assert "pip install 'headwise[hf]'" in out.stderr


@pytest.mark.slow
def test_a_command_missing_an_extra_says_so_in_one_line(tmp_path):
    """The command line's own error form, no traceback: the attention decode bench beside transformers, and --png."""
    for args in (["bench", "--modes", "decode", "--tokens", "16", "--batch", "1", "--plot", ""],
                 ["bench", "--modes", "forward,decode", "--preset", "tiny", "--tokens", "16", "--batch", "1", "--plot", ""],
                 ["heads", "--out", str(tmp_path / "h.html"), "--png", str(tmp_path / "h.png")]):
        code = BLOCK + f"from headwise.cli import main\nmain({args!r})\n"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and "pip install 'headwise[" in out.stderr, out.stderr
        assert out.stdout == ""  # before any table is measured (the forward table was lost after its run)
    assert not (tmp_path / "h.html").exists()  # checked before any work: no page without its picture
