"""The engines the decode benchmark runs side by side, each on its own copy of one checkpoint.

Every engine reads the same checkpoint directory (``bench.models.checkpoint``), converted by its
own converter where it has one (``bench.conversions``), and generates greedily from token ids:
``runner(ids (B, T), new) -> (B, new)`` token ids. None stops at an end-of-sequence token, so
every engine does the same work, and the tokens can be compared.

- ``headwise``: ``headwise.models.load`` and ``generate``; ``headwise compiled``: ``generate(compile=True)``;
  ``headwise bf16 cache`` (and compiled): ``generate(cache_dtype=torch.bfloat16)`` for the precisions computed in
  float32, whose caches hold float32 otherwise (llama.cpp's f16 cache reads as many bytes);
- ``transformers``: ``AutoModelForCausalLM`` (SDPA attention) and ``generate``; ``transformers
  compiled``: the same with a static cache and its ``forward`` under ``torch.compile``;
- ``CTranslate2``: the checkpoint converted by ``TransformersConverter`` (what
  ``ct2-transformers-converter`` runs), quantized when loaded (``compute_type``), and
  ``Generator.generate_batch`` greedy (``sampling_topk=1``);
- ``llama.cpp``: GGUF written by llama.cpp's ``convert_hf_to_gguf.py``, q8_0 by
  ``llama_model_quantize`` (what ``llama-quantize`` runs); ``llama_cpp.Llama`` evaluates the
  prompt, then one token at a time, the argmax of each step's logits. One sequence at a time.

``Engine.formats`` names each engine's own format for a precision; ``weight_bytes`` and
``kv_bytes`` are the bytes a step reads per weight and per cached key or value element in that
format (per-row int8 scales left out: under 0.5 %; q8_0 stores 32 weights in 34 bytes; llama.cpp
keeps its KV cache in f16).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from . import conversions
from .models import ACTIVATIONS, headwise_model, transformers_model

Runner = Callable[[Tensor, int], Tensor]  # (ids (B, T), new tokens) -> (B, new)
NO_EXTRA = "pip install 'headwise[anchors]'"


@dataclass(frozen=True)
class Engine:
    """One way to generate: its formats per precision, the bytes they read, and how to load a runner."""

    name: str
    formats: dict[str, str]
    weight_bytes: dict[str, float]
    kv_bytes: dict[str, int]
    load: Callable[[Path, str, int], Runner]  # (checkpoint, precision, threads) -> runner
    module: str = ""  # a module that must be importable
    batches: bool = True
    variant: bool = False  # another way of an engine above (compiled: minutes of compiling; bfloat16 caches): run only when asked for
    limits: Callable[[str], str] = field(default=lambda precision: "")  # why this machine cannot run a precision ("" if it can)

    def missing(self, precision: str) -> str:
        """Why this engine cannot run ``precision`` here; "" when it can."""
        if self.module and not installed(self.module):
            return f"{self.name} is not installed ({NO_EXTRA})"
        if precision not in self.formats:
            return f"{self.name} has no {precision} format on the CPU"
        return self.limits(precision)


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    return importlib.util.find_spec(module) is not None


def _torch_runner(generate: Callable[[Tensor, int], Tensor]) -> Runner:
    def run(ids: Tensor, new: int) -> Tensor:
        with torch.inference_mode():
            return generate(ids, new)[:, ids.shape[1]:]  # (B, new)

    return run


def _headwise(compile: bool, cache_dtype: torch.dtype | None = None) -> Callable[[Path, str, int], Runner]:
    def load(directory: Path, precision: str, threads: int) -> Runner:
        model = headwise_model(directory, precision)
        return _torch_runner(lambda ids, new: model.generate(ids, max_new_tokens=new, compile=compile, cache_dtype=cache_dtype))

    return load


def _transformers(compile: bool) -> Callable[[Path, str, int], Runner]:
    def load(directory: Path, precision: str, threads: int) -> Runner:
        model = transformers_model(directory, precision)
        options = {"do_sample": False, "pad_token_id": 0}
        if compile:
            model = copy.deepcopy(model)
            model.forward = torch.compile(model.forward, fullgraph=True)
            options["cache_implementation"] = "static"
        return _torch_runner(lambda ids, new: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **options))

    return load


CT2_TYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8_float32", "int8-bf16": "int8_bfloat16", "int8-a8": "int8_float32"}


def _ct2_limits(precision: str) -> str:
    import ctranslate2

    have = ctranslate2.get_supported_compute_types("cpu")
    return "" if CT2_TYPES[precision] in have else f"CTranslate2 has no {CT2_TYPES[precision]} on this CPU (it has {', '.join(sorted(have))})"


def _ctranslate2(directory: Path, precision: str, threads: int) -> Runner:
    import ctranslate2

    converted = conversions.ctranslate2_model(directory)
    vocabulary = json.loads((converted / "vocabulary.json").read_text())
    generator = ctranslate2.Generator(str(converted), device="cpu", compute_type=CT2_TYPES[precision], intra_threads=threads, inter_threads=1)

    def run(ids: Tensor, new: int) -> Tensor:
        prompts = [[vocabulary[i] for i in row] for row in ids.tolist()]
        results = generator.generate_batch(prompts, max_length=new, sampling_topk=1, include_prompt_in_result=False, end_token=[])
        return torch.tensor([r.sequences_ids[0] for r in results])  # (B, new)

    return run


GGUF_TYPES = {"fp32": "f32", "bf16": "f16", "int8": "q8_0", "int8-a8": "q8_0"}


def _llama_cpp_limits(precision: str) -> str:
    return "" if conversions.gguf_converter() else conversions.NO_CONVERTER


def _llama_cpp(directory: Path, precision: str, threads: int) -> Runner:
    import llama_cpp
    import numpy as np

    path = conversions.gguf_model(directory, GGUF_TYPES[precision], threads=threads)
    context = json.loads((directory / "config.json").read_text())
    positions = context.get("n_positions") or context["max_position_embeddings"]
    # use_mmap=False: the weights in the process's own memory, as every other engine holds them; a
    # mapped file's pages can be dropped under memory pressure and read back from disk mid-step.
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=positions, n_batch=512, n_threads=threads, n_threads_batch=threads, use_mmap=False,
                          verbose=False)

    def run(ids: Tensor, new: int) -> Tensor:
        if ids.shape[0] != 1:
            raise ValueError(f"llama.cpp runs one sequence at a time here, got a batch of {ids.shape[0]}")
        llm.reset()  # the next eval writes from position 0, dropping what the cache held after it
        llm.eval(ids[0].tolist())
        vocab, out = llm.n_vocab(), []
        for i in range(new):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))  # (vocab,): the last token's
            out.append(int(np.argmax(logits)))
            if i < new - 1:
                llm.eval(out[-1:])
        return torch.tensor([out])  # (1, new)

    return run


_TORCH_KV = {p: torch.finfo(t).bits // 8 for p, t in ACTIVATIONS.items()}
_TORCH_WEIGHT = {"fp32": 4, "bf16": 2, "int8": 1, "int8-bf16": 1, "int8-a8": 1}  # bytes a weight: headwise's and CTranslate2's formats
_FLOAT32_KV = {p: p for p, t in ACTIVATIONS.items() if t == torch.float32}  # the precisions a bfloat16 cache changes
ENGINES: dict[str, Engine] = {
    e.name: e
    for e in (
        Engine("headwise", {p: p for p in ACTIVATIONS}, _TORCH_WEIGHT, _TORCH_KV, _headwise(False)),
        Engine("transformers", {"fp32": "fp32", "bf16": "bf16"}, {"fp32": 4, "bf16": 2}, _TORCH_KV, _transformers(False), "transformers"),
        Engine("CTranslate2", CT2_TYPES, _TORCH_WEIGHT, _TORCH_KV, _ctranslate2, "ctranslate2",
               limits=_ct2_limits),
        Engine("llama.cpp", GGUF_TYPES, {"fp32": 4, "bf16": 2, "int8": 34 / 32, "int8-a8": 34 / 32}, dict.fromkeys(GGUF_TYPES, 2), _llama_cpp, "llama_cpp",
               batches=False, limits=_llama_cpp_limits),
        Engine("headwise compiled", {p: p for p in ACTIVATIONS}, _TORCH_WEIGHT, _TORCH_KV, _headwise(True),
               variant=True),
        Engine("transformers compiled", {"fp32": "fp32", "bf16": "bf16"}, {"fp32": 4, "bf16": 2}, _TORCH_KV, _transformers(True), "transformers",
               variant=True),
        Engine("headwise bf16 cache", _FLOAT32_KV, _TORCH_WEIGHT, dict.fromkeys(_FLOAT32_KV, 2), _headwise(False, torch.bfloat16),
               variant=True),
        Engine("headwise compiled bf16 cache", _FLOAT32_KV, _TORCH_WEIGHT, dict.fromkeys(_FLOAT32_KV, 2), _headwise(True, torch.bfloat16),
               variant=True),
    )
}
