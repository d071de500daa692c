"""``generate(..., cuda_graph=True)`` (``models/graph_step.py``, ``cache/slot.py``): the decode step captured once and
replayed gives the eager step's logits at every step, for GPT-2 and the Llama family, padded, on rings, and in bf16.

Without a GPU the capture is stood in for by ``make_fx``: it records the step's ops once and replays them, every
shape and Python value fixed at the capture as a CUDA graph's are, and a host read of a tensor's value fails the
trace as it would fail a capture. On a GPU the same checks run through ``generate`` and a real CUDA graph.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_flat_step import CASES, model_of
from torch.fx.experimental.proxy_tensor import make_fx

from headwise.cache import KVCache
from headwise.cache.slot import SlotCache
from headwise.models import graph_step
from headwise.models.generate import decode_step
from headwise.models.gpt2 import GPT2LMHeadModel
from headwise.models.llama import LlamaForCausalLM

#: fp32: max |whole buffer masked - eager| over the logits' scale (masked keys weigh exactly 0; the sums run over more terms).
CLOSE = 1e-5
#: bf16: the masked step's error against the fp32 model at most this many times the eager step's.
RATIO = 2.0


def traced_capture(step, *args):
    """``graph_step.capture`` without a GPU: a warm-up run (lazy choices made outside the recording, as ``capture``
    makes them), then the ops recorded once by ``make_fx`` and replayed on the same tensors."""
    step(*args)
    graph = make_fx(step)(*args)
    output = graph(*args).clone()

    def replay() -> None:
        output.copy_(graph(*args))

    return replay, output


@pytest.fixture
def capture_on(device, monkeypatch):
    """The device the steps run on: a CUDA graph on cuda, ``make_fx``'s recording standing in for it on the CPU."""
    if device == "cpu":
        monkeypatch.setattr(graph_step.GraphStep, "capture", staticmethod(traced_capture))
    return device


def rerun(step, *args):
    """A stand-in for ``capture`` that records nothing: every replay runs the step again, eagerly."""
    output = step(*args)
    return (lambda: output.copy_(step(*args))), output


class Uncaptured(graph_step.GraphStep):
    """The same step over the same ``SlotCache`` views, run eagerly every time: what a replay must equal bit for bit."""

    capture = staticmethod(rerun)


def stepped(runs: list, device: str, batch: int, steps: int, padded: bool):
    """Each (model, step, cache dtype) of ``runs`` on caches of its own: the same prompt, then greedy steps on the
    tokens of the third run. Yields each run's (B, vocab) logits a step."""
    ids = torch.randint(0, runs[0][0].vocab_size, (batch, 7), generator=torch.Generator().manual_seed(3)).to(device)
    mask = torch.ones(batch, 7, dtype=torch.bool, device=device)
    if padded:
        mask[0, :3] = False
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
    with torch.no_grad():
        caches = [model.new_caches(batch, 32, dtype) for model, _, dtype in runs]
        assert all(c.dtype == (dtype or model.embed_tokens.weight.dtype) for (model, _, dtype), cs in zip(runs, caches, strict=True) for c in cs)
        for (model, *_), c in zip(runs, caches, strict=True):
            model(ids, mask if padded else None, positions=positions if padded else None, cache=c, logits_to_keep=1, check=False)
        token, position = ids[:, -1:], positions[:, -1:] if padded else None
        for _ in range(steps):
            if position is not None:
                position = position + 1  # (B, 1)
            logits = [step(token, position, c) for (_, step, _), c in zip(runs, caches, strict=True)]  # (B, vocab) each
            yield logits
            token = logits[2].argmax(-1, keepdim=True)  # (B, 1)


def error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def check_steps(model, device: str, batch: int = 3, steps: int = 8, padded: bool = False,
                cache_dtype: torch.dtype | None = None) -> None:
    """Three ways, each on its own caches of ``cache_dtype``: captured and replayed, the same masked step uncaptured,
    the eager step (and for bf16 weights or caches the eager step of the model in fp32 over fp32 caches). Replays equal
    the uncaptured step bit for bit; the masked step gives the eager step's numbers (fp32: within ``CLOSE`` of their
    scale; bf16: its error against fp32 within ``RATIO`` of the eager step's)."""
    model = model.to(device)
    half = torch.bfloat16 in (model.embed_tokens.weight.dtype, cache_dtype)
    runs = [(model, way(decode_step(model, False, False)), cache_dtype)
            for way in (graph_step.GraphStep, Uncaptured, lambda step: step)]
    if half:
        reference = copy.deepcopy(model).float()
        runs.append((reference, decode_step(reference, False, False), None))
    outputs = list(stepped(runs, device, batch, steps, padded))
    for i, (replayed, masked, eager, *fp32) in enumerate(outputs):
        assert replayed.dtype == eager.dtype and replayed.shape == eager.shape
        assert torch.equal(replayed, masked), f"step {i}: the replay differs from the step it captured"
        if not half:
            assert error(masked, eager) <= CLOSE * eager.abs().max().item(), f"step {i}"
        else:
            floor = 1e-2 * fp32[0].abs().max().item()  # bf16's own rounding of logits of this scale
            assert error(masked, fp32[0]) <= RATIO * error(eager, fp32[0]) + floor, f"step {i}"
    assert not all(torch.equal(outputs[0][2], o[2]) for o in outputs[1:]), "the steps differ (not one step replayed)"


@pytest.mark.parametrize("case", CASES)
def test_the_replayed_step_gives_the_eager_steps_logits(case, capture_on):
    cls, kw, dtype = CASES[case]
    check_steps(model_of(cls, kw, dtype), capture_on)  # 7 + 8 tokens: past a 4-slot ring twice


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_a_left_padded_batch_replays_at_its_position_ids(cls, capture_on):
    check_steps(model_of(cls, {}, torch.float32), capture_on, padded=True)


@pytest.mark.parametrize("case", ["llama gqa fp32", "gpt2 fp32", "mistral sliding window (ring caches)"])
def test_a_float32_model_over_bfloat16_caches_replays_its_eager_step(case, capture_on):
    """The graph's ``SlotCache`` views over bfloat16 buffers: the cast before the write and the queries' cast are
    captured with the step."""
    cls, kw, dtype = CASES[case]
    check_steps(model_of(cls, kw, dtype), capture_on, padded=True, cache_dtype=torch.bfloat16)


def test_what_the_graph_reads_lives_as_long_as_the_step(monkeypatch):
    """A CUDA graph reads its inputs at the addresses it captured: a tensor made for the capture and then freed would
    have its memory handed to the next tensor made, and every replay would read that. The step keeps them all."""
    import gc
    import weakref

    given = []

    def recording(step, *args):
        given.extend(weakref.ref(a) for a in (*args[:2], *args[2]))  # ids, positions, every SlotCache view
        given.extend(weakref.ref(view.slots) for view in args[2])
        return (lambda: None), step(*args)  # as a CUDA graph: the step's result, and no reference to what it read

    monkeypatch.setattr(graph_step.GraphStep, "capture", staticmethod(recording))
    model = model_of(GPT2LMHeadModel, {}, torch.float32)
    step = graph_step.GraphStep(decode_step(model, False, False))
    with torch.no_grad():
        caches = model.new_caches(1, 8)
        model(torch.tensor([[1, 2]]), cache=caches, check=False)
        step(torch.tensor([[3]]), None, caches)
    gc.collect()
    assert given and all(ref() is not None for ref in given)


def test_the_cache_is_written_where_the_eager_step_writes():
    """SlotCache on its own: the slot ``count`` says, the whole buffer answered, the written real slots unmasked."""
    cache = KVCache(2, 1, 5, 3)
    cache.update(torch.ones(2, 1, 2, 3), torch.ones(2, 1, 2, 3), torch.tensor([[False, True], [True, True]]))
    view = SlotCache(cache, torch.tensor([2]))
    k = torch.full((2, 1, 1, 3), 7.0)
    (run,) = view.append(k, 2 * k, check=False)
    assert run.keys is cache.k and run.values is cache.v
    assert torch.equal(cache.k[:, :, 2], k[:, :, 0]) and torch.equal(cache.v[:, :, 2], 2 * k[:, :, 0])
    assert run.attention_mask.tolist() == [[False, True, True, False, False], [True, True, True, False, False]]
    ring = KVCache.sliding(1, 1, 3, 2)
    ring.update(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2), torch.tensor([[False, True, True, True]]))
    (run,) = SlotCache(ring, torch.tensor([4])).append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), check=False)
    assert ring.k[0, 0, 1].tolist() == [1.0, 1.0]  # position 4 -> slot 1
    assert run.attention_mask.tolist() == [[True, True, True]]  # a full ring: every slot in the window


def test_a_slot_cache_refuses_what_a_replayed_step_cannot_be():
    cache = KVCache(1, 1, 4, 2)
    view = SlotCache(cache, torch.tensor([0]))
    with torch.no_grad(), pytest.raises(ValueError, match="one new token"):
        view.append(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    with pytest.raises(ValueError, match="autograd"):
        view.append(torch.zeros(1, 1, 1, 2, requires_grad=True), torch.zeros(1, 1, 1, 2))
    with torch.no_grad(), pytest.raises(ValueError, match="time order"):
        SlotCache(KVCache.sliding(1, 1, 3, 2), torch.tensor([0])).append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), in_order=True)
    for v, error, match in ((torch.zeros(1, 1, 1, 3), ValueError, r"cache holds \(B=1, Hkv=1, \*, D=2\); v has shape \(1, 1, 1, 3\)"),
                            (torch.zeros(1, 1, 1, 2, dtype=torch.float64), TypeError, r"cache holds torch.float32; v is torch.float64")):
        with torch.no_grad(), pytest.raises(error, match=match):
            view.append(torch.ones(1, 1, 1, 2), v)  # checked before the keys are written
    assert torch.equal(cache.k, torch.zeros(1, 1, 4, 2)), "nothing written"


def test_generate_refuses_a_graph_it_cannot_capture_by_name():
    model = model_of(GPT2LMHeadModel, {}, torch.float32)
    ids = torch.randint(0, model.vocab_size, (1, 4))
    with pytest.raises(ValueError, match="CUDA device, got cpu"):
        model.generate(ids, max_new_tokens=2, cuda_graph=True)
    with pytest.raises(TypeError, match="cuda_graph"):
        model.generate(ids, max_new_tokens=2, cuda_graph=1)


def test_generate_refuses_a_graph_with_compile_or_checked_steps():
    """``graph_allowed``'s other two refusals, each by name, for a CUDA device (on the CPU the device's comes first)."""
    from headwise.models.generate import graph_allowed

    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="compile=True"):
        graph_allowed(cuda, True, False)
    with pytest.raises(ValueError, match="eval mode"):
        graph_allowed(cuda, False, True)
    graph_allowed(cuda, False, False)  # an unchecked, eager step on a GPU: allowed


@pytest.mark.parametrize("cls", [LlamaForCausalLM, GPT2LMHeadModel])
def test_generate_wires_the_replayed_step_as_its_eager_one(cls, monkeypatch):
    """generate's loop around the graph, on the CPU (the device check passed, the capture stood in for): padded and
    unpadded, sampling from a seeded generator, stopping at an end-of-sequence token: the eager loop's tokens."""
    import headwise.models.generate as generation

    monkeypatch.setattr(graph_step.GraphStep, "capture", staticmethod(traced_capture))
    monkeypatch.setattr(generation, "graph_allowed", lambda device, compile, check: None)
    model = model_of(cls, {}, torch.float32)
    ids = torch.randint(0, model.vocab_size, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, :3] = False
    for kw in (dict(), dict(attention_mask=mask), dict(temperature=0.8, top_k=20), dict(eos_token_id=int(ids[0, 3])),
               dict(attention_mask=mask, cache_dtype=torch.bfloat16)):
        runs = [model.generate(ids, max_new_tokens=12, generator=torch.Generator().manual_seed(7), cuda_graph=graph, **kw)
                for graph in (False, True)]
        assert torch.equal(runs[1], runs[0]), kw


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph needs a GPU")
@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2] == torch.float32])
def test_on_cuda_generate_with_a_graph_gives_the_eager_tokens(case):
    """fp32, weights of every scale (no near-ties): the same tokens, unpadded and left-padded."""
    cls, kw, dtype = CASES[case]
    model = model_of(cls, kw, dtype).cuda()
    ids = torch.randint(0, model.vocab_size, (3, 7), generator=torch.Generator().manual_seed(5)).cuda()
    mask = torch.ones(3, 7, dtype=torch.bool, device="cuda")
    mask[1, :3] = False
    for kw in (dict(), dict(attention_mask=mask), dict(attention_mask=mask, cache_dtype=torch.bfloat16)):
        want = model.generate(ids, max_new_tokens=12, **kw)
        assert torch.equal(model.generate(ids, max_new_tokens=12, cuda_graph=True, **kw), want), kw
