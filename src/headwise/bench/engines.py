"""The engines the decode benchmark runs side by side, each on its own copy of one checkpoint.

Every engine reads the same checkpoint directory (``bench.models.checkpoint``), converted by its
own converter where it has one (``bench.conversions``), and generates greedily from token ids:
``runner(ids (B, T), new) -> Generated``: the (B, new) token ids, and the seconds from the call to
its first token (the prompt pass and one token) and to its end, taken where the engine runs, each
engine's first token seen through its own streaming hook. None stops at an end-of-sequence token,
so every engine does the same work, and the tokens can be compared.

- ``headwise``: ``headwise.models.load`` and ``generate``; ``headwise compiled``: ``generate(compile=True)``;
  ``headwise bf16 cache`` (and compiled): ``generate(cache_dtype=torch.bfloat16)`` for the precisions computed in
  float32, whose caches hold float32 otherwise (llama.cpp's f16 cache reads as many bytes); ``headwise int8 cache``
  (and compiled): ``generate(cache_dtype=torch.int8)``, 8-bit rows (llama.cpp's q8_0 cache, ``type_k``/``type_v``, reads as many);
- ``transformers``: ``AutoModelForCausalLM`` (SDPA attention) and ``generate`` (a streamer sees the
  first token); ``transformers compiled``: the same with a static cache and its ``forward`` under
  ``torch.compile``;
- ``CTranslate2``: the checkpoint converted by ``TransformersConverter`` (what
  ``ct2-transformers-converter`` runs), quantized when loaded (``compute_type``), and
  ``Generator.generate_batch`` greedy (``sampling_topk=1``; its ``callback`` sees the first token);
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
from time import perf_counter

import torch
from torch import Tensor

from . import conversions
from .models import ACTIVATIONS, headwise_model, transformers_model


@dataclass(frozen=True)
class Generated:
    """What one generate call gave: its tokens, and its times taken where the engine ran it.

    Attributes:
        tokens: (B, new) the generated ids.
        first_s: seconds from the call to its first token (the prompt pass and one token).
        total_s: seconds from the call to its end; the ``new - 1`` steps after the first token took ``total_s - first_s``.
    """

    tokens: Tensor
    first_s: float
    total_s: float


class Stopwatch:
    """Started when made; ``first()`` notes the first token's time (later calls change nothing); ``done(tokens)``
    gives the ``Generated``."""

    def __init__(self) -> None:
        self.start, self.first_at = perf_counter(), None

    def first(self, *_: object) -> None:
        if self.first_at is None:
            self.first_at = perf_counter()

    def done(self, tokens: Tensor) -> Generated:
        end = perf_counter()
        return Generated(tokens, (end if self.first_at is None else self.first_at) - self.start, end - self.start)


Runner = Callable[[Tensor, int], Generated]  # (ids (B, T), new tokens) -> (B, new) tokens and their times
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


def _torch_runner(generate: Callable[[Tensor, int, Stopwatch], Tensor]) -> Runner:
    def run(ids: Tensor, new: int) -> Generated:
        clock = Stopwatch()
        with torch.inference_mode():
            out = generate(ids, new, clock)[:, ids.shape[1]:]  # (B, new)
        return clock.done(out)

    return run


def _headwise(compile: bool, cache_dtype: torch.dtype | None = None) -> Callable[[Path, str, int], Runner]:
    def load(directory: Path, precision: str, threads: int) -> Runner:
        model = headwise_model(directory, precision)
        return _torch_runner(lambda ids, new, clock: model.generate(ids, max_new_tokens=new, compile=compile, cache_dtype=cache_dtype,
                                                                    on_token=clock.first))

    return load


def _transformers(compile: bool) -> Callable[[Path, str, int], Runner]:
    def load(directory: Path, precision: str, threads: int) -> Runner:
        model = transformers_model(directory, precision)
        options = {"do_sample": False, "pad_token_id": 0}
        if compile:
            model = copy.deepcopy(model)
            model.forward = torch.compile(model.forward, fullgraph=True)
            options["cache_implementation"] = "static"
        return _torch_runner(lambda ids, new, clock: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                                                    streamer=_Streamer(clock), **options))

    return load


class _Streamer:
    """transformers' streamer protocol (``put``, ``end``): its first ``put`` holds the prompt, the second the first token."""

    def __init__(self, clock: Stopwatch) -> None:
        self.clock, self.puts = clock, 0

    def put(self, value: Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.clock.first()

    def end(self) -> None:
        pass


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

    def run(ids: Tensor, new: int) -> Generated:
        prompts = [[vocabulary[i] for i in row] for row in ids.tolist()]
        clock = Stopwatch()
        results = generator.generate_batch(prompts, max_length=new, sampling_topk=1, include_prompt_in_result=False, end_token=[],
                                           callback=clock.first)  # called for each row's each token: the first marks the first step
        return clock.done(torch.tensor([r.sequences_ids[0] for r in results]))  # (B, new)

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

    def run(ids: Tensor, new: int) -> Generated:
        if ids.shape[0] != 1:
            raise ValueError(f"llama.cpp runs one sequence at a time here, got a batch of {ids.shape[0]}")
        clock = Stopwatch()
        llm.reset()  # the next eval writes from position 0, dropping what the cache held after it
        llm.eval(ids[0].tolist())
        vocab, out = llm.n_vocab(), []
        for i in range(new):
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))  # (vocab,): the last token's
            out.append(int(np.argmax(logits)))
            clock.first()
            if i < new - 1:
                llm.eval(out[-1:])
        return clock.done(torch.tensor([out]))  # (1, new)

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
        Engine("headwise int8 cache", _FLOAT32_KV, _TORCH_WEIGHT, dict.fromkeys(_FLOAT32_KV, 68 / 64), _headwise(False, torch.int8),
               variant=True),  # 68 / 64: a row of 64 int8 values and its float32 scale
        Engine("headwise compiled int8 cache", _FLOAT32_KV, _TORCH_WEIGHT, dict.fromkeys(_FLOAT32_KV, 68 / 64),
               _headwise(True, torch.int8), variant=True),
    )
}
