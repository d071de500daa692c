"""The same code on any device: every tensor made on the inputs' device, no host reads on the
hot paths, and SDPA's fused kernels wherever no mask is needed.

Meta tensors have shapes and no values. Running the core and the modules on them shows that
every tensor is made on the inputs' device (``OffDevice`` sees each op's output, so a tensor
made without ``device=`` is caught even where it never meets another) and that nothing reads a
value on the host (reading a meta tensor raises). On the CPU ``host_reads`` counts the Tensor
methods that would wait for a GPU; on CUDA the same paths also run under
``torch.cuda.set_sync_debug_mode("error")``.

The hot paths: a decode step (one token over a KVCache), a prefill with ``is_causal`` (no
padding), a prefill with a bool padding mask (and the steps after it), and training steps.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import OffDevice, host_reads

import headwise as hw
from headwise.models import BertModel, GPT2LMHeadModel
from headwise.models.bert import BertConfig

BACKENDS = ["math", "sdpa"]


def module(kind: str, device, *, window=None, backend="sdpa", dtype=torch.float32, width=16, heads=4, kv_heads=2, context=32):
    """A small attention module of each kind on ``device``, in eval mode."""
    torch.manual_seed(0)
    if kind == "causal":
        m = hw.CausalAttention(width, width, context, 0.1, backend=backend)
    elif kind == "wrapper":
        m = hw.MultiHeadAttentionWrapper(width, width // heads, context, 0.1, heads, backend=backend)
    elif kind == "mha":
        m = hw.MultiHeadAttention(width, width, context, 0.1, heads, qkv_bias=True, num_kv_heads=kv_heads, window=window, backend=backend)
    else:
        config = hw.GPT2Config(n_embd=width, n_head=heads, n_kv_head=kv_heads, n_positions=context)
        m = hw.GPT2MultiHeadAttention(config, window=window, backend=backend)
    return m.to(device=device, dtype=dtype).eval()


def new_cache(m, batch: int, *, window=None, max_len=32):
    p = next(m.parameters())
    if window is not None:
        return hw.KVCache.sliding(batch, m.num_kv_heads, window, m.head_dim, dtype=p.dtype, device=p.device)
    return hw.KVCache(batch, m.num_kv_heads, max_len, m.head_dim, dtype=p.dtype, device=p.device)


def left_padded(lengths: list[int], t: int, device) -> torch.Tensor:
    """(B, T) bool, True = real token, each row left padded to t."""
    return torch.arange(t, device=device) >= t - torch.tensor(lengths, device=device)[:, None]


def tiny_gpt2(device) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(hw.GPT2Config(vocab_size=50, n_positions=32, n_embd=16, n_layer=2, n_head=4)).to(device).eval()


# ----------------------------------------------------------------------------- meta: nothing made elsewhere


def _core_cases(B=2, H=4, Hkv=2, T=5, S=5, D=4):
    m = "meta"
    bool_mask = torch.ones(T, S, dtype=torch.bool, device=m)
    float_mask = torch.zeros(B, 1, T, S, device=m)
    real = torch.ones(B, S, dtype=torch.bool, device=m)
    return {
        "plain": {}, "causal": {"causal": True}, "causal-window": {"causal": True, "window": 2},
        "bool-mask": {"mask": bool_mask}, "float-mask": {"mask": float_mask, "causal": True},
        "padding": {"attention_mask": real}, "causal-padding": {"causal": True, "attention_mask": real},
        "scale": {"causal": True, "scale": 0.5},
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(_core_cases()))
@pytest.mark.parametrize(("Hkv", "T"), [(4, 5), (2, 5), (2, 1)], ids=["mha", "gqa", "one-query"])
def test_core_makes_nothing_off_the_inputs_device(backend, kind, Hkv, T):
    kw = _core_cases(T=T)[kind]
    q = torch.randn(2, 4, T, 4, device="meta", requires_grad=True)
    k, v = (torch.randn(2, Hkv, 5, 4, device="meta", requires_grad=True) for _ in range(2))
    with OffDevice() as seen:
        out = hw.attention(q, k, v, backend=backend, dropout_p=0.1, **kw)
        out.sum().backward()
        hw.attention_weights(q, k, **kw)
    assert out.device.type == "meta" and out.shape == (2, 4, T, 4)
    assert seen.stray == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 3])
def test_cache_makes_nothing_off_the_inputs_device(backend, window):
    q, k, v = (torch.randn(2, 4, 9, 4, device="meta") for _ in range(3))
    cache = hw.KVCache.sliding(2, 4, window, 4, device="meta") if window else hw.KVCache(2, 4, 16, 4, device="meta")
    real = torch.ones(2, 5, dtype=torch.bool, device="meta")
    with OffDevice() as seen:
        hw.attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], causal=True, window=window, attention_mask=real, cache=cache, backend=backend)
        for i in range(5, 7):  # decode steps
            hw.attention(q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1], causal=True, window=window, cache=cache, backend=backend)
        hw.attention(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], causal=True, window=window, cache=cache, backend=backend)  # a chunk
    assert len(cache) == 9 and seen.stray == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["causal", "wrapper", "mha", "gpt2"])
def test_modules_make_nothing_off_their_device(kind, backend):
    m = module(kind, "meta", backend=backend)
    x = torch.randn(2, 6, 16, device="meta")
    real = torch.ones(2, 6, dtype=torch.bool, device="meta")
    with OffDevice() as seen:
        assert m(x).device.type == "meta"
        m(x, attention_mask=real)
        m.train()
        m(x.requires_grad_(), attention_mask=real).sum().backward()  # dropout and gradients too
        m.eval()
        if hasattr(m, "mask"):
            assert m.mask.device.type == "meta"  # the book's buffer, built on demand
        if kind in ("mha", "gpt2"):
            cache = new_cache(m, 2)
            m(x.detach(), attention_mask=real, cache=cache)
            m(x.detach()[:, :1], cache=cache)
    assert seen.stray == []


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_sliding_window_modules_make_nothing_off_their_device(kind):
    m = module(kind, "meta", window=3)
    x = torch.randn(2, 9, 16, device="meta")
    with OffDevice() as seen:
        cache = new_cache(m, 2, window=3)
        for chunk in (x[:, :5], x[:, 5:6], x[:, 6:7], x[:, 7:]):
            m(chunk, cache=cache)
    assert len(cache) == 9 and seen.stray == []


def test_models_make_nothing_off_their_device():
    gpt2 = tiny_gpt2("meta")
    ids = torch.zeros(2, 5, dtype=torch.long, device="meta")
    real = torch.ones(2, 5, dtype=torch.bool, device="meta")
    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32))
    bert = bert.to("meta").eval()
    with OffDevice() as seen:
        assert gpt2(ids, attention_mask=real).shape == (2, 5, 50)
        assert gpt2.generate(ids, max_new_tokens=3, attention_mask=real).shape == (2, 8)
        assert bert(ids, attention_mask=real).shape == (2, 5, 16)
    assert seen.stray == []


def test_a_stray_cpu_tensor_is_caught():
    """The detector itself: a tensor made without device= shows up."""
    with OffDevice() as seen:
        torch.randn(2, 3, device="meta") + 1
        torch.arange(4)
    assert seen.stray == ["aten.arange.default: (4,) on cpu"]


# ----------------------------------------------------------------------------- host reads on the hot paths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("window", [None, 3], ids=["linear-cache", "sliding-cache"])
def test_a_decode_step_reads_nothing_on_the_host(device, kind, backend, window):
    m = module(kind, device, window=window, backend=backend)
    x = torch.randn(2, 8, 16, device=device)
    with torch.no_grad():
        for real in (None, left_padded([5, 3], 5, device)):  # after a plain and after a padded prefill
            cache = new_cache(m, 2, window=window)
            m(x[:, :5], attention_mask=real, cache=cache)  # prefill
            m(x[:, 5:6], cache=cache)  # a first step may set things up
            with host_reads(device, strict=True) as reads:
                m(x[:, 6:7], cache=cache)
                m(x[:, 7:8], cache=cache)
            assert reads == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["causal", "wrapper", "mha", "gpt2"])
def test_an_is_causal_prefill_reads_nothing_on_the_host(device, kind, backend):
    m = module(kind, device, backend=backend)
    x = torch.randn(2, 6, 16, device=device)
    q, k, v = (torch.randn(2, 4, 6, 4, device=device) for _ in range(3))
    with torch.no_grad():
        m(x)  # a first call may set things up
        with host_reads(device, strict=True) as reads:
            m(x)
            hw.attention(q, k, v, causal=True, backend=backend)
            if kind in ("mha", "gpt2"):
                m(x, cache=new_cache(m, 2))  # prefill into an empty cache
    assert reads == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_a_bool_padded_prefill_and_training_step_read_nothing_on_the_host(device, kind, backend):
    m = module(kind, device, backend=backend)
    x = torch.randn(3, 6, 16, device=device)
    real = left_padded([6, 2, 1], 6, device)  # row 2: five queries see only padding (the math backend's dead rows)
    with torch.no_grad():
        m(x, attention_mask=real, cache=new_cache(m, 3))
        with host_reads(device, strict=True) as reads:
            m(x, attention_mask=real)
            m(x, attention_mask=real, cache=new_cache(m, 3))
    assert reads == []
    m.train()
    m(x, attention_mask=real).sum().backward()
    with host_reads(device, strict=True) as reads:
        m(x, attention_mask=real).sum().backward()  # dropout on, gradients through the padding
    assert reads == []


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
def test_an_int_padding_mask_is_read_once_per_call_and_never_by_the_steps_after(device, kind):
    """0/1 ints are checked for other values: one host read where the mask enters, none later."""
    m = module(kind, device)
    x = torch.randn(2, 8, 16, device=device)
    real = left_padded([5, 3], 5, device).long()
    with torch.no_grad():
        cache = new_cache(m, 2)
        with host_reads(device) as reads:
            m(x[:, :5], attention_mask=real, cache=cache)
        assert reads == ["__bool__"]
        with host_reads(device, strict=True) as reads:
            for i in range(5, 8):
                m(x[:, i : i + 1], cache=cache)
        assert reads == []


@pytest.mark.parametrize("padded", [False, True])
def test_generate_reads_the_prompt_and_no_decode_step(device, padded):
    """The models read their inputs once per call (token id range; with a mask: its values and
    whether it holds any padding); the decode steps read nothing, however many there are."""
    model = tiny_gpt2(device)
    ids = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(0)).to(device)
    mask = left_padded([5, 3], 5, device).long() if padded else None
    counts = []
    for n in (1, 6):
        with host_reads(device) as reads:
            model.generate(ids, max_new_tokens=n, attention_mask=mask)
        counts.append(sorted(reads))
    want = ["__bool__", "__bool__", "tolist"] if padded else ["tolist"]  # int mask values, any padding; ids' min and max
    # generate asks "any padding?" and "does a prompt end in padding?" in one read (a tolist)
    want_generate = ["__bool__", "tolist", "tolist"] if padded else ["tolist"]
    assert counts == [want_generate, want_generate]
    with host_reads(device) as reads:
        model(ids, attention_mask=mask)
    assert sorted(reads) == want


def test_the_counter_counts(device):
    """The counter itself: each kind of host read is seen."""
    t = torch.ones(3, device=device)
    with host_reads(device) as reads:
        bool(t.all()), t.sum().item(), t.tolist(), int(t[0]), float(t[0])
    assert reads == ["__bool__", "item", "tolist", "__int__", "__float__"]


# ----------------------------------------------------------------------------- SDPA without a mask


def _spy(monkeypatch) -> list[tuple[bool, bool]]:
    """Record (attn_mask is None, is_causal) of every SDPA call."""
    seen: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *args, is_causal=False, **kwargs):
        seen.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask, *args, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return seen


@pytest.mark.parametrize("kind", ["causal", "wrapper", "mha", "gpt2"])
def test_sdpa_gets_is_causal_for_an_unpadded_prefill(device, kind, monkeypatch):
    m = module(kind, device)
    x = torch.randn(2, 6, 16, device=device)
    seen = _spy(monkeypatch)
    with torch.no_grad():
        m(x)
        if kind in ("mha", "gpt2"):
            m(x, cache=new_cache(m, 2))
            m(x, attention_mask=torch.ones(2, 6, dtype=torch.bool, device=device), cache=None)  # a mask, even all real, is a mask
    calls = 4 if kind == "wrapper" else 1  # the wrapper: one call per head
    assert seen[: calls * (2 if kind in ("mha", "gpt2") else 1)] == [(True, True)] * calls * (2 if kind in ("mha", "gpt2") else 1)
    if kind in ("mha", "gpt2"):
        assert seen[-1] == (False, False)


@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("window", [None, 3, 20], ids=["no-window", "sliding", "window-longer-than-the-context"])
def test_sdpa_gets_no_mask_for_a_decode_step(device, kind, window, monkeypatch):
    from headwise.backends import decode_kernel

    monkeypatch.setattr(decode_kernel, "available", lambda: False)  # on the CPU the C++ kernel takes these steps where built
    m = module(kind, device, window=window)
    x = torch.randn(2, 9, 16, device=device)
    with torch.no_grad():
        cache = new_cache(m, 2, window=window if window == 3 else None)
        m(x[:, :5], cache=cache)
        seen = _spy(monkeypatch)
        for i in range(5, 9):
            m(x[:, i : i + 1], cache=cache)
    assert seen == [(True, False)] * 4  # one query that may see every key it is given: nothing to mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: SDPA's flash / memory-efficient / cuDNN kernels run only there")
@pytest.mark.parametrize("kind", ["mha", "gpt2"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_fused_kernels_run_prefill_decode_and_training_on_cuda(kind, kv_heads):
    """With SDPA restricted to its fused kernels, a math fallback would raise "No available kernel"."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    m = module(kind, "cuda", dtype=torch.bfloat16, width=256, heads=4, kv_heads=kv_heads, context=64)  # D = 64
    x = torch.randn(2, 64, 256, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(fused):
        with torch.no_grad():
            want = m(x)  # is_causal prefill
            cache = new_cache(m, 2, max_len=64)
            got = [m(x[:, :48], cache=cache)] + [m(x[:, i : i + 1], cache=cache) for i in range(48, 64)]  # decode steps
        torch.testing.assert_close(torch.cat(got, dim=1), want, atol=3e-2, rtol=3e-2)  # bf16, two kernels
        m.train()
        m(x.requires_grad_()).float().sum().backward()
    assert all(math.isfinite(p.grad.float().abs().sum().item()) for p in m.parameters())
