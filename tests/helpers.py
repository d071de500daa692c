"""Helpers shared by the tests (none of them computes a reference: that is tests/reference.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import headwise as hw

#: The rule for low precision (flash-attention's tests): our error against a float64 reference
#: must be within ERROR_RATIO times the error of a plain implementation in the same dtype.
ERROR_RATIO = 3

BACKENDS = ["math", "sdpa", "auto"]


def make(kind: str, *, H=4, Hkv=None, D=4, ctx=32, window=None, backend="auto", dtype=torch.float32, seed=0, device="cpu"):
    """A MultiHeadAttention or GPT2MultiHeadAttention in eval mode on ``device``, random biases."""
    torch.manual_seed(seed)
    if kind == "mha":
        m = hw.MultiHeadAttention(H * D, H * D, ctx, 0.0, H, qkv_bias=True, num_kv_heads=Hkv, window=window, backend=backend)
    else:
        config = hw.GPT2Config(n_embd=H * D, n_head=H, n_kv_head=Hkv, n_positions=ctx, attn_pdrop=0.0, resid_pdrop=0.0)
        m = hw.GPT2MultiHeadAttention(config, window=window, backend=backend)
    m = m.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.ndim == 1:
                p.normal_()  # zero-initialised biases would hide a mis-split
    return m


def decode(m, x, schedule, cache, attention_mask=None, every_chunk=False):
    """Feed x (B, T, C) through m in chunks of the given sizes; each chunk's part of the mask goes
    with it if every_chunk, else the mask goes with the first chunk only (the rest must be real)."""
    outs, start = [], 0
    for i, n in enumerate(schedule):
        kpm = attention_mask[:, start : start + n] if (attention_mask is not None and (i == 0 or every_chunk)) else None
        outs.append(m(x[:, start : start + n], attention_mask=kpm, cache=cache))
        start += n
    return torch.cat(outs, dim=1)  # (B, T, C)


def new_cache(m, B, max_len, dtype=torch.float32):
    """A KVCache for module m on m's device."""
    return hw.KVCache(B, m.num_kv_heads, max_len, m.head_dim, dtype=dtype, device=next(m.parameters()).device)


def reference_weights(m: nn.Module) -> dict:
    """A headwise module's projections as ``reference_mha``'s keyword arguments (detached).

    The book's classes give W_query / W_key / W_value (and out_proj, None for CausalAttention);
    GPT-2's fused c_attn rows are [queries | keys | values].
    """
    get = lambda layer, attr: None if layer is None or getattr(layer, attr) is None else getattr(layer, attr).detach()  # noqa: E731
    if isinstance(m, hw.GPT2MultiHeadAttention):
        C, kv = m.d_in, m.num_kv_heads * m.head_dim
        w, b = m.c_attn.weight.detach(), m.c_attn.bias.detach()
        return {
            "wq": w[:C], "wk": w[C : C + kv], "wv": w[C + kv :], "bq": b[:C], "bk": b[C : C + kv], "bv": b[C + kv :],
            "wo": m.c_proj.weight.detach(), "bo": m.c_proj.bias.detach(),
        }
    out_proj = getattr(m, "out_proj", None)
    return {
        "wq": m.W_query.weight.detach(), "wk": m.W_key.weight.detach(), "wv": m.W_value.weight.detach(),
        "bq": get(m.W_query, "bias"), "bk": get(m.W_key, "bias"), "bv": get(m.W_value, "bias"),
        "wo": get(out_proj, "weight"), "bo": get(out_proj, "bias"),
    }


# ----------------------------------------------------------------------------- devices

#: Every device a test about numbers runs on here: the CPU always, CUDA when torch sees one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

_TOLERANCES = {  # (device type, dtype) -> (atol, rtol), for outputs of size ~1-10
    ("cpu", torch.float64): (1e-10, 1e-10),
    ("cpu", torch.float32): (1e-5, 0.0),
    # GPU kernels sum in other orders (fused SDPA kernels tile the keys): float32 a few ulps
    # of the largest partial sum away, float64 still far below any real error.
    ("cuda", torch.float64): (1e-9, 1e-9),
    ("cuda", torch.float32): (1e-4, 1e-5),
}


def on(device: str | torch.device, x):
    """``x`` with every tensor in it (a tensor, or a dict / tuple / list of them) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {key: on(device, value) for key, value in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(on(device, value) for value in x)
    return x


def tol(device: str | torch.device, dtype: torch.dtype) -> dict[str, float]:
    """``assert_close`` tolerances for results computed in ``dtype`` on ``device``.

    Low precision (bf16/fp16) is not here: it is judged by the error ratio against a plain
    implementation in the same dtype, on any device.
    """
    atol, rtol = _TOLERANCES[(torch.device(device).type, dtype)]
    return {"atol": atol, "rtol": rtol}


# ----------------------------------------------------------------------------- host reads

#: The Tensor methods that read a tensor's values on the host: on a GPU each one waits for the device.
HOST_READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def host_reads(device: str | torch.device = "cpu", *, strict: bool = False) -> Iterator[list[str]]:
    """Count the host reads of tensor values made inside the block: yields the list of method names.

    Patches ``torch.Tensor``'s methods in ``HOST_READS`` to record each call (on any device:
    on the CPU a read is no sync, but the same line would be one on a GPU). With ``strict`` on
    CUDA it also sets ``torch.cuda.set_sync_debug_mode("error")``, which catches the syncs no
    Python method shows (a boolean-mask index, ``nonzero``, a device-to-host copy).
    """
    calls: list[str] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in HOST_READS}
    for name in HOST_READS:
        base = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _base=base, **kwargs):
            calls.append(_name)
            return _base(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    cuda = strict and torch.device(device).type == "cuda"
    mode = torch.cuda.get_sync_debug_mode() if cuda else None
    try:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        yield calls
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)
        for name, old in saved.items():
            if old is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, old)


# ----------------------------------------------------------------------------- stray tensors


class OffDevice(TorchDispatchMode):
    """Records every op whose output is not on ``device``: run meta inputs through the code
    inside it, and any tensor made without ``device=`` (a CPU one) shows up in ``stray``."""

    def __init__(self, device: str = "meta") -> None:
        super().__init__()
        self.device = device
        self.stray: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != self.device:
                self.stray.append(f"{func}: {tuple(t.shape)} on {t.device}")
        return out


def padded_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 9 ids in [2, vocab_size): no padding, left padding (3 pads), right padding
    (2 pads, as a model forward may see); pads hold id 0; the mask as 0/1 ints."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, vocab_size, (3, 9), generator=g)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, -2:] = 0
    ids[mask == 0] = 0
    return ids, mask


def hf_positions(real: torch.Tensor) -> torch.Tensor:
    """HuggingFace generate's position ids: count of real tokens before, 0 at padding."""
    return (real.long().cumsum(-1) - 1).masked_fill(~real, 0)


def equals_transformers_on(device: str | torch.device, model: torch.nn.Module, hf: torch.nn.Module,
                           batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A headwise causal LM and transformers' model of the same checkpoint, both on ``device``: the same
    logits on the (ids, mask) padded ``batch`` (atol 1e-4, float32) and the same 10 greedy tokens from its
    first two (left-padded) rows."""
    ids, mask = on(device, batch)
    real = mask.bool()
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=hf_positions(real)).logits
        got = model(ids, attention_mask=mask)
    assert got.device.type == torch.device(device).type
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=0)
    ids, mask = ids[:2], mask[:2]  # generation pads on the left
    want = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=10, pad_token_id=0)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=10), want)


def outputs_under_avx2(test_module: str, outputs: str, tmp_path) -> dict[str, torch.Tensor]:
    """``test_module.outputs()`` computed in a process whose torch runs its AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``:
    headwise's C++ library built with AVX2's flags), loaded back here."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    saved = tmp_path / "avx2.pt"
    code = (
        f"import sys, torch; sys.path.insert(0, {str(Path(__file__).parent)!r}); import {test_module} as t; "
        "assert torch.backends.cpu.get_cpu_capability() == 'AVX2', torch.backends.cpu.get_cpu_capability(); "
        f"torch.save(t.{outputs}(), {str(saved)!r})"
    )
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ATEN_CPU_CAPABILITY": "avx2"},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(saved, weights_only=True)
