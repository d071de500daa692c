"""A checkpoint converted by each engine's own converter, written once beside it.

- CTranslate2: ``ctranslate2.converters.TransformersConverter`` (the converter behind
  ``ct2-transformers-converter``), float32; the engine quantizes when it loads (``compute_type``).
- llama.cpp: ``convert_hf_to_gguf.py`` from llama.cpp's sources (f32, f16), then q8_0 from the
  f32 file by ``llama_model_quantize``, the function ``llama-quantize`` runs. llama-cpp-python
  installs the library but not the converter: the sdist carries it in ``vendor/llama.cpp``
  (``pip download --no-deps --no-binary :all: llama-cpp-python``, unpack), and
  ``$HEADWISE_LLAMA_CPP`` names that directory.

Each conversion runs in a subprocess (a crash in native code ends that process, not the
benchmark) and writes under a temporary name first, so a file that exists is whole.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

NO_CONVERTER = ("llama.cpp's convert_hf_to_gguf.py not found: set HEADWISE_LLAMA_CPP to the vendor/llama.cpp directory of the "
                "llama-cpp-python sdist (pip download --no-deps --no-binary :all: llama-cpp-python)")

# The converter names a BPE tokenizer by hashing how it splits a test text, and refuses one it does not
# know. The benchmark's tokenizer (bench.models.tokenizer) is byte-level, as GPT-2's is: it is given that
# name. The weights pass through the converter untouched.
_GGUF = """
import importlib.util, sys
script, rest = sys.argv[1], sys.argv[2:]
sys.path.insert(0, script.rsplit("/", 1)[0])
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
module = importlib.util.module_from_spec(spec)
sys.modules["convert_hf_to_gguf"] = module
spec.loader.exec_module(module)
for holder in (sys.modules.get("conversion.base"), module):
    for cls in (getattr(holder, "TextModel", None), getattr(holder, "Model", None)):
        if cls is not None and hasattr(cls, "get_vocab_base_pre"):
            cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [script, *rest]
module.main()
"""
_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
params.nthread = int(sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _written(out: Path, write) -> Path:
    """``out``, written by ``write(temporary path)`` unless it exists."""
    if out.exists():
        return out
    partial = out.with_name(out.name + ".partial")
    write(partial)
    partial.rename(out)
    return out


def ctranslate2_model(checkpoint: Path) -> Path:
    """The CTranslate2 model directory of ``checkpoint`` (float32)."""
    code = "import sys; from ctranslate2.converters import TransformersConverter; TransformersConverter(sys.argv[1]).convert(sys.argv[2], force=True)"
    return _written(checkpoint.with_name(checkpoint.name + ".ct2"),
                    lambda out: _run([sys.executable, "-c", code, str(checkpoint), str(out)], "CTranslate2's converter"))


def gguf_converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py`` in ``$HEADWISE_LLAMA_CPP``; None where it is not set or holds none."""
    root = os.environ.get("HEADWISE_LLAMA_CPP")
    script = Path(root) / "convert_hf_to_gguf.py" if root else None
    return script if script is not None and script.is_file() else None


def gguf_model(checkpoint: Path, kind: str, *, threads: int = 1) -> Path:
    """The GGUF file of ``checkpoint`` in ``kind`` ("f32", "f16", "bf16" or "q8_0")."""
    if kind not in ("f32", "f16", "bf16", "q8_0"):
        raise ValueError(f"kind must be one of 'f32', 'f16', 'bf16', 'q8_0', got {kind!r}")
    script = gguf_converter()
    if script is None:
        raise FileNotFoundError(NO_CONVERTER)
    out = checkpoint.with_name(f"{checkpoint.name}.{kind}.gguf")
    if kind == "q8_0":
        f32 = gguf_model(checkpoint, "f32")
        return _written(out, lambda p: _run([sys.executable, "-c", _QUANTIZE, str(f32), str(p), str(threads)], "llama_model_quantize"))
    argv = [sys.executable, "-c", _GGUF, str(script), str(checkpoint), "--outtype", kind, "--outfile"]
    return _written(out, lambda p: _run([*argv, str(p)], "convert_hf_to_gguf.py"))
