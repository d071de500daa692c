"""A misuse catalogue: bad and edge inputs to the public API, each with the only acceptable outcomes.

Every case is either
- ``Raises(error, match)``: a ValueError/TypeError (or FileNotFoundError for paths) whose message
  names the argument, what was expected and what was given; or
- ``Agrees(fn)``: ``fn()`` returns ``(got, want)`` where ``want`` is an independent float64
  reference (``tests/reference.py``, or a formula written here): an edge input must still give
  the right answer, finite, never a silent wrong result.

A case that raised something else, or returned something the reference disagrees with, fails.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from reference import reference_attention, reference_gpt2_logits, reference_mha

import headwise as hw
from headwise.convert import load_checked, remap
from headwise.models import BertModel, GPT2LMHeadModel, SentenceEncoder, head_roles
from headwise.models.bert import BertConfig

F64 = torch.float64
META = torch.device("meta")


class Raises(NamedTuple):
    error: type[Exception]
    match: str


class Agrees(NamedTuple):
    fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    atol: float = 1e-10


def rnd(*shape: int, seed: int = 0, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(B=1, H=2, T=3, S=None, D=4, Hkv=None, seed=0, dtype=F64):
    S, Hkv = S or T, Hkv or H
    return rnd(B, H, T, D, seed=seed, dtype=dtype), rnd(B, Hkv, S, D, seed=seed + 1, dtype=dtype), rnd(B, Hkv, S, D, seed=seed + 2, dtype=dtype)


def attend(**kw):
    """hw.attention on fresh q, k, v (shape keywords go to qkv, the rest to attention)."""
    shape = {k: kw.pop(k) for k in ("B", "H", "T", "S", "D", "Hkv", "dtype") if k in kw}
    return lambda: hw.attention(*qkv(**shape), **kw)


def core_agrees(backend="auto", shape=None, **kw) -> Agrees:
    """attention(...) against reference_attention(...) on the same float64 inputs."""
    shape = shape or {}

    def fn():
        q, k, v = qkv(**shape)
        return hw.attention(q, k, v, backend=backend, **kw), reference_attention(q, k, v, **kw)

    return Agrees(fn)


def mha(**kw) -> hw.MultiHeadAttention:
    torch.manual_seed(0)
    kw = {"qkv_bias": True} | kw
    return hw.MultiHeadAttention(8, 8, 16, 0.0, kw.pop("num_heads", 2), **kw).double().eval()


def _reference_of(m: hw.MultiHeadAttention, x: torch.Tensor, attention_mask=None) -> torch.Tensor:
    return reference_mha(
        x, m.W_query.weight, m.W_key.weight, m.W_value.weight, m.W_query.bias, m.W_key.bias, m.W_value.bias,
        m.out_proj.weight, m.out_proj.bias, m.num_heads, m.num_kv_heads, causal=m.causal, window=m.window, attention_mask=attention_mask,
    )


def mha_agrees(x_shape=(2, 5, 8), attention_mask=None, **kw) -> Agrees:
    """MultiHeadAttention in float64 against reference_mha from its own weights."""

    def fn():
        m = mha(**kw)
        x = rnd(*x_shape, seed=3)
        with torch.no_grad():
            got = m(x, attention_mask=attention_mask)
        return got, _reference_of(m, x, None if attention_mask is None else attention_mask.bool())

    return Agrees(fn)


def gpt2_attn(**kw) -> hw.GPT2MultiHeadAttention:
    return hw.GPT2MultiHeadAttention(hw.GPT2Config(n_embd=8, n_head=2, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0), **kw)


def cache(**kw) -> hw.KVCache:
    return hw.KVCache(1, 2, 8, 4, **kw)


def _paged_with(seq_id: int) -> hw.PagedKVCache:
    paged = hw.PagedKVCache(4, 2, 1, 4)
    paged.add(seq_id)
    return paged


def bound_cache_misuse():
    a, b = mha(), mha()
    c = hw.KVCache(1, 2, 16, 4, dtype=F64)
    with torch.no_grad():
        a(rnd(1, 2, 8), cache=c)
        b(rnd(1, 2, 8), cache=c)


def cache_decode_agrees(window=None) -> Agrees:
    """Prefill + steps through a cache = the full causal forward (float64 reference)."""

    def fn():
        m = mha(window=window)
        x = rnd(1, 7, 8, seed=4)
        c = hw.KVCache(1, 2, 16, 4, dtype=F64) if window is None else hw.KVCache.sliding(1, 2, window, 4, dtype=F64)
        with torch.no_grad():
            got = torch.cat([m(x[:, :3], cache=c)] + [m(x[:, i : i + 1], cache=c) for i in range(3, 7)], dim=1)
        return got, _reference_of(m, x)

    return Agrees(fn)




def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(hw.GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2)).eval()


def tiny_bert(vocab_size=7) -> BertModel:
    torch.manual_seed(0)
    return BertModel(BertConfig(vocab_size=vocab_size, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)).eval()


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4, "cat": 5, "sat": 6}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def tiny_encoder() -> SentenceEncoder:
    return SentenceEncoder(tiny_bert(), tiny_tokenizer(), max_seq_length=8)


def ids(*shape, dtype=torch.long, high=11):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(0)).to(dtype)


_DIRS = tempfile.TemporaryDirectory(prefix="headwise-misuse-")  # every model directory below, removed at exit


def write_dir(config_changes: dict, files: dict[str, bytes | str]):
    """A fresh GPT-2 model directory (a tiny config.json with ``config_changes``, plus ``files``)."""
    import json
    from pathlib import Path

    d = Path(tempfile.mkdtemp(dir=_DIRS.name))
    config = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2}
    config.update(config_changes)
    (d / "config.json").write_text(json.dumps(config))
    for name, data in files.items():
        (d / name).write_bytes(data) if isinstance(data, bytes) else (d / name).write_text(data)
    return d


def saved_state(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def gpt2_state() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_gpt2().state_dict().items()}


def fully_padded_row_agrees(backend: str) -> Agrees:
    def fn():
        q, k, v = qkv(B=2, T=3)
        real = torch.tensor([[1, 1, 1], [0, 0, 0]])  # row 1: no real key at all
        got = hw.attention(q, k, v, attention_mask=real, backend=backend)
        return got, reference_attention(q, k, v, attention_mask=real.bool())

    return Agrees(fn)


def int_and_bool_masks_agree() -> Agrees:
    """An int 0/1 mask and the same mask as bools: each against the float64 reference."""

    def fn():
        q, k, v = qkv(B=2, T=4)
        ints = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
        got = torch.stack([hw.attention(q, k, v, attention_mask=m, causal=True) for m in (ints, ints.bool())])
        return got, reference_attention(q, k, v, attention_mask=ints.bool(), causal=True).expand_as(got)

    return Agrees(fn)


def poisoned_padding_agrees(backend: str, poison: float) -> Agrees:
    def fn():
        q, k, v = qkv(B=1, T=4)
        real = torch.tensor([[0, 1, 1, 1]]).bool()
        k2, v2 = k.clone(), v.clone()
        k2[:, :, 0], v2[:, :, 0] = poison, poison
        return hw.attention(q, k2, v2, attention_mask=real, causal=True, backend=backend), reference_attention(q, k, v, attention_mask=real, causal=True)

    return Agrees(fn)


def non_contiguous_agrees() -> Agrees:
    def fn():
        base = rnd(1, 3, 2, 4, seed=7)  # (B, T, H, D) as a model would hold it before transposing
        q = k = v = base.transpose(1, 2)  # (B, H, T, D), not contiguous
        return hw.attention(q, k, v, causal=True), reference_attention(q, k, v, causal=True)

    return Agrees(fn)


def large_logits_agree(backend: str) -> Agrees:
    def fn():
        q, k, v = qkv(T=5)
        q = q * 300.0  # scores in the thousands: a softmax without the max shift overflows
        return hw.attention(q, k, v, causal=True, backend=backend), reference_attention(q, k, v, causal=True)

    return Agrees(fn)


def half_precision_agrees(dtype: torch.dtype) -> Agrees:
    def fn():
        q, k, v = qkv(T=6, D=8)
        got = hw.attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True, backend="math")
        return got.double(), reference_attention(q.to(dtype), k.to(dtype), v.to(dtype), causal=True)

    return Agrees(fn, atol=3e-2 if dtype == torch.bfloat16 else 4e-3)


def weights_agree(**kw) -> Agrees:
    def fn():
        q, k, _ = qkv(T=4, S=6)
        from reference import reference_weights

        return hw.attention_weights(q, k, **kw), reference_weights(q, k, **kw)

    return Agrees(fn)


def empty_queries_agree() -> Agrees:
    def fn():
        q, k, v = qkv(T=1, S=3)
        q = q[:, :, :0]  # T = 0
        return hw.attention(q, k, v), torch.zeros(1, 2, 0, 4, dtype=F64)

    return Agrees(fn, atol=0.0)


def no_keys_agree(backend: str) -> Agrees:
    def fn():
        q, k, v = qkv(T=2, S=1)
        return hw.attention(q, k[:, :, :0], v[:, :, :0], backend=backend), torch.zeros(1, 2, 2, 4, dtype=F64)

    return Agrees(fn, atol=0.0)


def causal_more_queries_than_keys_agrees(backend: str) -> Agrees:
    def fn():
        q, k, v = qkv(T=4, S=2)  # bottom-right: the first two queries see nothing
        return hw.attention(q, k, v, causal=True, backend=backend), reference_attention(q, k, v, causal=True)

    return Agrees(fn)


def mask_row_all_false_agrees(backend: str) -> Agrees:
    def fn():
        q, k, v = qkv(T=3)
        mask = torch.ones(3, 3, dtype=torch.bool)
        mask[1] = False
        return hw.attention(q, k, v, mask=mask, backend=backend), reference_attention(q, k, v, mask=mask)

    return Agrees(fn)


def additive_mask_agrees(backend: str) -> Agrees:
    def fn():
        q, k, v = qkv(T=3)
        mask = torch.tensor([[0.0, -math.inf, 0.5], [-1.0, 0.0, -math.inf], [-math.inf, -math.inf, -math.inf]], dtype=F64)
        return hw.attention(q, k, v, mask=mask, backend=backend), reference_attention(q, k, v, mask=mask)

    return Agrees(fn)


def reference_greedy(m: GPT2LMHeadModel, x: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding with the float64 reference's logits: x (B, T) -> (B, T + steps)."""
    for _ in range(steps):
        logits = reference_gpt2_logits(m.state_dict(), x, m.config.n_head, m.config.layer_norm_epsilon)  # (B, T, vocab)
        x = torch.cat([x, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


def generate_tiny_temperature_agrees() -> Agrees:
    """temperature=1e-300 is greedy: the float64 reference's argmax, token for token."""

    def fn():
        m, x = tiny_gpt2(), ids(2, 3)
        return m.generate(x, max_new_tokens=3, temperature=1e-300).double(), reference_greedy(m, x, 3).double()

    return Agrees(fn, atol=0.0)


def left_padding_logits_agree() -> Agrees:
    """Left-padded rows give the float64 reference's logits of the unpadded ids."""

    def fn():
        m = tiny_gpt2()
        x = ids(1, 4)
        padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), x], dim=1)
        mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
        with torch.no_grad():
            got = m(padded, attention_mask=mask)[:, 2:].double()
        return got, reference_gpt2_logits(m.state_dict(), x, m.config.n_head, m.config.layer_norm_epsilon)

    return Agrees(fn, atol=1e-5)


def training_through_cache_agrees() -> Agrees:
    """The input gradient through a cache (prefill 2, step 1, then 2) = the float64 reference's full-forward gradient."""

    def fn():
        m = mha().train()
        x = rnd(1, 5, 8, seed=9)
        c = hw.KVCache(1, 2, 16, 4, dtype=F64)
        xa = x.clone().requires_grad_(True)
        torch.cat([m(xa[:, :2], cache=c), m(xa[:, 2:3], cache=c), m(xa[:, 3:], cache=c)], 1).square().sum().backward()
        xb = x.clone().requires_grad_(True)
        _reference_of(m, xb).square().sum().backward()
        return xa.grad, xb.grad

    return Agrees(fn)


def load_book_state_agrees() -> Agrees:
    def fn():
        a, b = mha(), hw.MultiHeadAttention(8, 8, 16, 0.0, 2, qkv_bias=True).double()
        load_checked(b, a.state_dict())  # with the book's mask entry
        x = rnd(1, 4, 8)
        with torch.no_grad():
            return b(x), _reference_of(a, x)

    return Agrees(fn)


def padded_mha_agrees(causal: bool) -> Agrees:
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]])
    return mha_agrees(attention_mask=mask, causal=causal)


CASES: list[tuple[str, Callable[[], object], Raises | Agrees]] = [
    # ------------------------------------------------------------------ the core: arguments that are not what they should be
    ("core q is a list", lambda: hw.attention([[1.0]], *qkv()[1:]), Raises(TypeError, r"q must be a torch.Tensor of shape \(B, H, T, D\), got list")),
    ("core k is None", lambda: hw.attention(qkv()[0], None, qkv()[2]), Raises(TypeError, r"k must be a torch.Tensor of shape \(B, Hkv, S, D\), got NoneType")),
    ("core q is 3-D", lambda: hw.attention(rnd(2, 3, 4), *qkv()[1:]), Raises(ValueError, r"q must have shape \(B, H, T, D\) \(4 dims\), got shape \(2, 3, 4\)")),
    ("core v is 5-D", lambda: hw.attention(*qkv()[:2], rnd(1, 2, 3, 4, 1)), Raises(ValueError, r"v must have shape \(B, Hkv, S, Dv\) \(4 dims\)")),
    ("core integer q", lambda: hw.attention(torch.ones(1, 2, 3, 4, dtype=torch.long), *qkv()[1:]), Raises(TypeError, r"q must be a floating-point tensor, got dtype torch.int64")),
    ("core mixed dtypes", lambda: hw.attention(qkv()[0].float(), *qkv()[1:]), Raises(TypeError, r"q, k and v must share one dtype, got torch.float32, torch.float64, torch.float64")),
    ("core batch mismatch", lambda: hw.attention(rnd(2, 2, 3, 4), *qkv()[1:]), Raises(ValueError, r"k must have shape \(B=2, Hkv, S, D=4\) to match q")),
    ("core head size mismatch", lambda: hw.attention(rnd(1, 2, 3, 5), *qkv()[1:]), Raises(ValueError, r"k must have shape \(B=1, Hkv, S, D=5\)")),
    ("core v tokens differ from k", lambda: hw.attention(*qkv()[:2], rnd(1, 2, 4, 4)), Raises(ValueError, r"v must have shape \(B, Hkv, S, Dv\) = \(1, 2, 3\)")),
    ("core H not a multiple of Hkv", attend(H=3, Hkv=2), Raises(ValueError, r"q's heads H=3 must be a multiple of k/v's heads Hkv=2")),
    ("core head size 0", attend(D=0), Raises(ValueError, r"q and k must have a head size D >= 1")),
    ("core q on meta", lambda: hw.attention(qkv()[0].to(META), *qkv()[1:]), Raises(ValueError, r"q, k and v must be on one device, got q on meta, k on cpu, v on cpu")),
    ("weights mixed dtypes", lambda: hw.attention_weights(qkv()[0].float(), qkv()[1]), Raises(TypeError, r"q and k must share one dtype, got torch.float32, torch.float64$")),
    ("weights q on meta", lambda: hw.attention_weights(qkv()[0].to(META), qkv()[1]), Raises(ValueError, r"q and k must be on one device, got q on meta, k on cpu$")),
    ("core scale 0", attend(scale=0.0), Raises(ValueError, r"scale must be a positive finite number or None \(1/sqrt\(D\)\), got 0.0")),
    ("core scale negative", attend(scale=-1.0), Raises(ValueError, r"scale must be a positive finite number or None")),
    ("core scale inf", attend(scale=math.inf), Raises(ValueError, r"scale must be a positive finite number or None .*got inf")),
    ("core scale past float32", attend(scale=1e39, dtype=torch.float32), Raises(ValueError, r"scale must be finite in float32, the dtype the scores are computed in \(at most 3.403e\+38\), got 1e\+39")),
    ("core scale 0 in float32", attend(scale=1e-50, dtype=torch.float32),  # positive, but 0 * -inf at a masked key would be NaN
     Raises(ValueError, r"scale must be nonzero in float32, the dtype the scores are computed in \(at least 1.401e-45\), got 1e-50")),
    ("core scale nan", attend(scale=math.nan), Raises(ValueError, r"scale must be a positive finite number or None .*got nan")),
    ("core scale bool", attend(scale=True), Raises(TypeError, r"scale must be a positive finite number or None .*got True")),
    ("core scale str", attend(scale="0.5"), Raises(TypeError, r"scale must be a positive finite number or None .*got '0.5'")),
    ("core dropout_p over 1", attend(dropout_p=1.5), Raises(ValueError, r"dropout_p must be a number in \[0, 1\], got 1.5")),
    ("core dropout_p negative", attend(dropout_p=-0.1), Raises(ValueError, r"dropout_p must be a number in \[0, 1\], got -0.1")),
    ("core dropout_p nan", attend(dropout_p=math.nan), Raises(ValueError, r"dropout_p must be a number in \[0, 1\], got nan")),
    ("core dropout_p str", attend(dropout_p="0"), Raises(TypeError, r"dropout_p must be a number in \[0, 1\], got '0'")),
    ("core window 0", attend(causal=True, window=0), Raises(ValueError, r"window must be a positive int or None, got 0")),
    ("core window float", attend(causal=True, window=2.0), Raises(TypeError, r"window must be a positive int or None, got 2.0")),
    ("core window bool", attend(causal=True, window=True), Raises(TypeError, r"window must be a positive int or None, got True")),
    ("core window without causal", attend(window=2), Raises(ValueError, r"window \(sliding-window attention\) needs causal=True, got causal=False")),
    ("core backend unknown", attend(backend="flash"), Raises(ValueError, r"backend must be one of \['auto', 'math', 'sdpa'\], got 'flash'")),
    ("core backend list", attend(backend=[]), Raises(TypeError, r"backend must be one of \['auto', 'math', 'sdpa'\] \(a str\), got list \[\]")),
    ("core backend None", attend(backend=None), Raises(TypeError, r"backend must be one of .* \(a str\), got NoneType None")),
    ("core mask is a list", attend(mask=[[True]]), Raises(TypeError, r"mask must be a torch.Tensor \(bool or float\), got list")),
    ("core mask wrong shape", attend(mask=torch.ones(2, 2, dtype=torch.bool)), Raises(ValueError, r"mask must broadcast to \(B, H, T, S\) = \(1, 2, 3, 3\), got shape \(2, 2\)")),
    ("core mask of ints", attend(mask=torch.ones(3, 3, dtype=torch.long)), Raises(TypeError, r"mask must be bool \(True = may attend\) or an additive float mask, got dtype torch.int64")),
    ("core additive mask with NaN", attend(mask=torch.tensor([0.0, math.nan, 0.0])), Raises(ValueError, r"mask \(additive float\) must hold finite numbers or -inf")),
    ("core additive mask with +inf", attend(mask=torch.tensor([0.0, math.inf, 0.0])), Raises(ValueError, r"got NaN or \+inf")),
    ("core mask on meta", attend(mask=torch.ones(3, 3, dtype=torch.bool, device=META)), Raises(ValueError, r"mask is on meta but q, k and v are on cpu")),
    ("core attention_mask float", attend(attention_mask=torch.ones(1, 3)), Raises(TypeError, r"attention_mask must be a bool or 0/1 int tensor \(1/True = real token\), got dtype torch.float32")),
    ("core attention_mask value 2", attend(attention_mask=torch.tensor([[1, 2, 1]])), Raises(ValueError, r"attention_mask must hold only 0 \(padding\) and 1 \(real token\), got values \[1, 2\]")),
    ("core attention_mask negative", attend(attention_mask=torch.tensor([[1, -1, 1]])), Raises(ValueError, r"got values \[-1, 1\]")),
    ("core attention_mask wrong shape", attend(attention_mask=torch.ones(1, 4, dtype=torch.bool)), Raises(ValueError, r"attention_mask must have shape \(B, S\) = \(1, 3\), got \(1, 4\)")),
    ("core attention_mask is a list", attend(attention_mask=[[1, 1, 1]]), Raises(TypeError, r"attention_mask must be a bool or 0/1 int tensor of shape \(B, S\) \(1/True = real token\), got list")),
    ("core attention_mask on meta", attend(attention_mask=torch.ones(1, 3, dtype=torch.bool, device=META)), Raises(ValueError, r"attention_mask is on meta but k and v are on cpu")),
    ("core cache is a dict", attend(cache={}), Raises(TypeError, r"cache must be a headwise.KVCache, a PagedKVCache.batch\(...\) or None, got dict")),
    ("core cache with another window", lambda: hw.attention(*qkv(dtype=torch.float32), causal=True, window=2, cache=hw.KVCache.sliding(1, 2, 3, 4)),
     Raises(ValueError, r"a sliding cache of window=3 needs attention with window=3, got window=2")),
    ("weights k is a list", lambda: hw.attention_weights(qkv()[0], [1.0]), Raises(TypeError, r"k must be a torch.Tensor")),
    ("weights attention_mask value 3", lambda: hw.attention_weights(*qkv()[:2], attention_mask=torch.tensor([[3, 1, 1]])), Raises(ValueError, r"got values \[1, 3\]")),
    # ------------------------------------------------------------------ the core: edge inputs that must give the right answer
    ("edge one token, math", core_agrees("math", {"T": 1}, causal=True), None),
    ("edge one token, sdpa", core_agrees("sdpa", {"T": 1}, causal=True), None),
    ("edge decode step T=1 of S=5, sdpa", core_agrees("sdpa", {"T": 1, "S": 5}, causal=True), None),
    ("edge T > S causal, math", causal_more_queries_than_keys_agrees("math"), None),
    ("edge T > S causal, sdpa", causal_more_queries_than_keys_agrees("sdpa"), None),
    ("edge window 1, math", core_agrees("math", {"T": 4}, causal=True, window=1), None),
    ("edge window 1, sdpa", core_agrees("sdpa", {"T": 4}, causal=True, window=1), None),
    ("edge window longer than the keys", core_agrees("auto", {"T": 4}, causal=True, window=100), None),
    ("edge fully padded row, math", fully_padded_row_agrees("math"), None),
    ("edge fully padded row, sdpa", fully_padded_row_agrees("sdpa"), None),
    ("edge int 0/1 mask = bool mask", int_and_bool_masks_agree(), None),
    ("edge mask row all False, math", mask_row_all_false_agrees("math"), None),
    ("edge mask row all False, sdpa", mask_row_all_false_agrees("sdpa"), None),
    ("edge additive mask with a -inf row, math", additive_mask_agrees("math"), None),
    ("edge additive mask with a -inf row, sdpa", additive_mask_agrees("sdpa"), None),
    ("edge (S,) bool mask broadcasts", core_agrees("sdpa", {"T": 3}, mask=torch.tensor([True, False, True])), None),
    ("edge GQA, math", core_agrees("math", {"H": 4, "Hkv": 2, "T": 3}, causal=True), None),
    ("edge GQA, sdpa", core_agrees("sdpa", {"H": 4, "Hkv": 1, "T": 3}, causal=True), None),
    ("edge explicit scale", core_agrees("math", {"T": 3}, scale=0.01), None),
    ("edge NaN in a padded key, math", poisoned_padding_agrees("math", math.nan), None),
    ("edge Inf in a padded key, sdpa", poisoned_padding_agrees("sdpa", math.inf), None),
    ("edge -Inf in a padded key, math", poisoned_padding_agrees("math", -math.inf), None),
    ("edge non-contiguous q/k/v", non_contiguous_agrees(), None),
    ("edge huge logits, math", large_logits_agree("math"), None),
    ("edge huge logits, sdpa", large_logits_agree("sdpa"), None),
    ("edge float16, math", half_precision_agrees(torch.float16), None),
    ("edge bfloat16, math", half_precision_agrees(torch.bfloat16), None),
    ("edge no queries (T=0)", empty_queries_agree(), None),
    ("edge no keys (S=0), math", no_keys_agree("math"), None),
    ("edge no keys (S=0), sdpa", no_keys_agree("sdpa"), None),
    ("edge weights causal T < S", weights_agree(causal=True), None),
    ("edge weights padded", weights_agree(attention_mask=torch.tensor([[0, 1, 1, 0, 1, 1]]).bool()), None),
    # ------------------------------------------------------------------ the modules: construction
    ("mha d_in 0", lambda: hw.MultiHeadAttention(0, 4, 8, 0.0, 2), Raises(ValueError, r"d_in must be a positive int, got 0")),
    ("mha d_in str", lambda: hw.MultiHeadAttention("3", 4, 8, 0.0, 2), Raises(TypeError, r"d_in must be a positive int, got '3'")),
    ("mha d_out not divisible", lambda: hw.MultiHeadAttention(4, 6, 8, 0.0, 4), Raises(ValueError, r"d_out \(6\) must be divisible by num_heads \(4\)")),
    ("mha num_heads 0", lambda: hw.MultiHeadAttention(4, 4, 8, 0.0, 0), Raises(ValueError, r"num_heads must be a positive int, got 0")),
    ("mha num_kv_heads not dividing", lambda: hw.MultiHeadAttention(8, 8, 8, 0.0, 4, num_kv_heads=3), Raises(ValueError, r"num_heads \(4\) must be divisible by num_kv_heads \(3\)")),
    ("mha context_length 0", lambda: hw.MultiHeadAttention(4, 4, 0, 0.0, 2), Raises(ValueError, r"context_length must be a positive int, got 0")),
    ("mha dropout over 1", lambda: hw.MultiHeadAttention(4, 4, 8, 1.01, 2), Raises(ValueError, r"dropout must be a number in \[0, 1\], got 1.01")),
    ("mha window 0", lambda: hw.MultiHeadAttention(4, 4, 8, 0.0, 2, window=0), Raises(ValueError, r"window must be a positive int or None, got 0")),
    ("mha window bidirectional", lambda: hw.MultiHeadAttention(4, 4, 8, 0.0, 2, causal=False, window=2), Raises(ValueError, r"window \(sliding-window attention\) needs causal=True")),
    ("mha backend list", lambda: hw.MultiHeadAttention(4, 4, 8, 0.0, 2, backend=["sdpa"]), Raises(TypeError, r"backend must be one of .* \(a str\), got list")),
    ("wrapper num_heads 0", lambda: hw.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=0), Raises(ValueError, r"num_heads must be a positive int, got 0")),
    ("causal head d_out -1", lambda: hw.CausalAttention(3, -1, 6, 0.0), Raises(ValueError, r"d_out must be a positive int, got -1")),
    ("gpt2 attention given a dict", lambda: hw.GPT2MultiHeadAttention({"n_embd": 8}), Raises(TypeError, r"config must be a GPT2Config, got dict")),
    # ------------------------------------------------------------------ the modules: forward
    ("mha x is a list", lambda: mha()([[0.0] * 8]), Raises(TypeError, r"x must be a torch.Tensor of shape \(batch, tokens, 8\), got list")),
    ("mha x is 2-D", lambda: mha()(rnd(5, 8)), Raises(ValueError, r"x must have shape \(batch, tokens, d_in=8\), got \(5, 8\)")),
    ("mha x wrong width", lambda: mha()(rnd(1, 5, 7)), Raises(ValueError, r"x must have shape \(batch, tokens, d_in=8\), got \(1, 5, 7\)")),
    ("mha x of ints", lambda: mha()(torch.ones(1, 2, 8, dtype=torch.long)), Raises(TypeError, r"x must be a floating-point tensor, got dtype torch.int64")),
    ("mha float32 x, float64 module", lambda: mha()(rnd(1, 2, 8, dtype=torch.float32)), Raises(TypeError, r"x has dtype torch.float32 but MultiHeadAttention's parameters are torch.float64: convert one")),
    ("wrapper float64 x, float32 module", lambda: hw.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2)(rnd(1, 2, 3)),  # not its heads' name
     Raises(TypeError, r"x has dtype torch.float64 but MultiHeadAttentionWrapper's parameters are torch.float32: convert one")),
    ("wrapper x on meta", lambda: hw.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2)(rnd(1, 2, 3, dtype=torch.float32).to(META)),
     Raises(ValueError, r"x is on meta but MultiHeadAttentionWrapper's parameters are on cpu")),
    ("mha x on meta", lambda: mha()(rnd(1, 2, 8).to(META)), Raises(ValueError, r"x is on meta but MultiHeadAttention's parameters are on cpu")),
    ("gpt2 attention x on meta", lambda: gpt2_attn()(rnd(1, 2, 8, dtype=torch.float32).to(META)), Raises(ValueError, r"hidden_states is on meta but GPT2MultiHeadAttention's parameters are on cpu")),
    ("mha too many tokens", lambda: mha()(rnd(1, 17, 8)), Raises(ValueError, r"got 17 tokens, more than context_length=16")),
    ("mha attention_mask wrong shape", lambda: mha()(rnd(2, 3, 8), attention_mask=torch.ones(2, 4, dtype=torch.bool)), Raises(ValueError, r"attention_mask must have shape \(batch, tokens\) = \(2, 3\), got \(2, 4\)")),
    ("mha attention_mask of floats", lambda: mha()(rnd(2, 3, 8), attention_mask=torch.ones(2, 3)), Raises(TypeError, r"attention_mask must be a bool or 0/1 int tensor")),
    ("mha torch-style mask (True = padding) as floats", lambda: mha()(rnd(2, 3, 8), attention_mask=torch.zeros(2, 3, dtype=torch.float16)), Raises(TypeError, r"got dtype torch.float16")),
    ("mha attention_mask on meta", lambda: mha()(rnd(2, 3, 8), attention_mask=torch.ones(2, 3, dtype=torch.bool, device=META)), Raises(ValueError, r"attention_mask is on meta but x is on cpu")),
    ("mha cache of another head size", lambda: mha()(rnd(1, 2, 8), cache=hw.KVCache(1, 2, 8, 3, dtype=F64)), Raises(ValueError, r"cache holds \(B=1, Hkv=2, \*, D=3\); k has shape \(1, 2, 2, 4\)")),
    ("mha cache of another dtype", lambda: mha()(rnd(1, 2, 8), cache=hw.KVCache(1, 2, 8, 4)), Raises(TypeError, r"the cache is torch.float32, but the keys and values are torch.float64")),
    ("mha cache too small", lambda: mha()(rnd(1, 5, 8), cache=hw.KVCache(1, 2, 4, 4, dtype=F64)), Raises(ValueError, r"cache is full: it holds 0 of max_len=4 tokens and cannot take 5 more")),
    ("mha sliding cache, no window", lambda: mha()(rnd(1, 2, 8), cache=hw.KVCache.sliding(1, 2, 3, 4, dtype=F64)), Raises(ValueError, r"a sliding cache of window=3 needs attention with window=3, got window=None")),
    ("mha cache shared by two layers", bound_cache_misuse, Raises(ValueError, r"this KVCache belongs to MultiHeadAttention at 0x[0-9a-f]+, not to MultiHeadAttention at 0x")),
    ("mha padded causal = reference", padded_mha_agrees(True), None),
    ("mha padded bidirectional = reference", padded_mha_agrees(False), None),
    ("mha one token = reference", mha_agrees(x_shape=(1, 1, 8)), None),
    ("mha context_length tokens = reference", mha_agrees(x_shape=(1, 16, 8)), None),
    ("mha GQA = reference", mha_agrees(num_heads=4, num_kv_heads=2), None),
    ("mha single head = reference", mha_agrees(num_heads=1), None),
    ("mha window = reference", mha_agrees(window=2), None),
    ("mha cached decode = reference", cache_decode_agrees(), None),
    ("mha sliding cached decode = reference", cache_decode_agrees(window=2), None),
    ("mha training through a cache = full forward", training_through_cache_agrees(), None),
    # ------------------------------------------------------------------ the cache
    ("cache batch 0", lambda: hw.KVCache(0, 2, 8, 4), Raises(ValueError, r"batch_size must be a positive int, got 0")),
    ("cache head_dim float", lambda: hw.KVCache(1, 2, 8, 4.0), Raises(TypeError, r"head_dim must be a positive int, got 4.0")),
    ("cache max_len -1", lambda: hw.KVCache(1, 2, -1, 4), Raises(ValueError, r"max_len must be a positive int, got -1")),
    ("cache sliding window 0", lambda: hw.KVCache.sliding(1, 2, 0, 4), Raises(ValueError, r"window must be a positive int, got 0")),
    ("cache crop past its length", lambda: cache().crop(1), Raises(ValueError, r"length must be an int in \[0, len\(cache\)=0\], got 1")),
    ("cache crop -1", lambda: cache().crop(-1), Raises(ValueError, r"length must be an int in \[0, len\(cache\)=0\], got -1")),
    ("paged fork onto itself", lambda: _paged_with(0).fork(0, 0), Raises(ValueError, r"new_id 0 is already in the cache")),
    ("paged fork to a str id", lambda: _paged_with(0).fork(0, "1"), Raises(TypeError, r"new_id must be an int, got str '1'")),  # (named seq_id)
    ("paged check_room counts None", lambda: _paged_with(0).check_room([0], None), Raises(TypeError, r"counts must be a list of ints, got NoneType")),
    ("cache crop a bool", lambda: cache().crop(True), Raises(TypeError, r"length must be an int in \[0, len\(cache\)=0\], got True")),
    ("cache crop a ring", lambda: hw.KVCache.sliding(1, 2, 3, 4).crop(0), Raises(ValueError, r"a sliding cache \(window=3\) cannot be cropped")),
    ("cache update with a list", lambda: cache().update([], torch.zeros(1, 2, 1, 4)), Raises(TypeError, r"k must be a torch.Tensor of shape \(B=1, Hkv=2, T, D=4\), got list")),
    ("cache update with None values", lambda: cache().update(torch.zeros(1, 2, 1, 4), None), Raises(TypeError, r"v must be a torch.Tensor .* got NoneType")),
    ("cache update, k and v lengths differ", lambda: cache().update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 1, 4)), Raises(ValueError, r"k and v must hold the same tokens, got T=2 keys and T=1 values")),
    ("cache update, mask of floats", lambda: cache().update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), torch.ones(1, 2)), Raises(TypeError, r"attention_mask must be a bool or 0/1 int tensor")),
    ("cache update, k on meta", lambda: cache().update(torch.zeros(1, 2, 1, 4, device=META), torch.zeros(1, 2, 1, 4, device=META)), Raises(ValueError, r"k is on meta but the cache is on cpu")),
    ("causal_mask window 0", lambda: hw.causal_mask(3, 3, window=0), Raises(ValueError, r"window must be a positive int, got 0")),
    ("causal_mask t negative", lambda: hw.causal_mask(-1, 3), Raises(ValueError, r"t must be an int >= 0, got -1")),
    # ------------------------------------------------------------------ configs
    ("gpt2 config epsilon -1", lambda: hw.GPT2Config(layer_norm_epsilon=-1.0), Raises(ValueError, r"layer_norm_epsilon must be a number in \(0, inf\), got -1.0")),
    ("gpt2 config epsilon NaN", lambda: hw.GPT2Config(layer_norm_epsilon=math.nan), Raises(ValueError, r"layer_norm_epsilon must be a number in \(0, inf\), got nan")),
    ("gpt2 config n_embd float", lambda: hw.GPT2Config(n_embd=768.0), Raises(TypeError, r"n_embd must be a positive int, got 768.0")),
    ("gpt2 config n_head not dividing", lambda: hw.GPT2Config(n_head=7), Raises(ValueError, r"n_embd \(768\) must be divisible by n_head \(7\)")),
    ("gpt2 config n_kv_head 0", lambda: hw.GPT2Config(n_kv_head=0), Raises(ValueError, r"n_kv_head must be a positive int, got 0")),
    ("gpt2 config resid_pdrop 2", lambda: hw.GPT2Config(resid_pdrop=2), Raises(ValueError, r"resid_pdrop must be a number in \[0, 1\], got 2")),
    ("gpt2 config n_positions None", lambda: hw.GPT2Config(n_positions=None), Raises(TypeError, r"n_positions must be a positive int, got None")),
    ("gpt2 config unknown preset", lambda: hw.GPT2Config.from_preset("gpt2-small"), Raises(ValueError, r"unknown preset 'gpt2-small'; valid: \['gpt2', 'gpt2-large', 'gpt2-medium', 'gpt2-xl'\]")),
    ("gpt2 config from a list", lambda: hw.GPT2Config.from_dict([]), Raises(TypeError, r"d must be a dict \(a parsed config.json\), got list")),
    ("bert config eps 0", lambda: BertConfig(layer_norm_eps=0), Raises(ValueError, r"layer_norm_eps must be a number in \(0, inf\), got 0")),
    ("bert config hidden_act unhashable", lambda: BertConfig(hidden_act={"gelu": 1}), Raises(ValueError, r"hidden_act must be one of \['gelu', 'gelu_new', 'gelu_pytorch_tanh'\], got \{'gelu': 1\}")),
    ("bert config heads not dividing", lambda: BertConfig(num_attention_heads=5), Raises(ValueError, r"hidden_size \(768\) must be divisible by num_attention_heads \(5\)")),
    # ------------------------------------------------------------------ conversions and loading into modules
    ("wrapper_to_mha given an mha", lambda: hw.wrapper_to_mha(mha()), Raises(TypeError, r"wrapper_to_mha converts a MultiHeadAttentionWrapper: wrapper must be one, got MultiHeadAttention")),
    ("gpt2_to_mha given an mha", lambda: hw.gpt2_to_mha(mha()), Raises(TypeError, r"gpt2_to_mha converts a GPT2MultiHeadAttention: attn must be one, got MultiHeadAttention")),
    ("mha_to_gpt2 given a gpt2", lambda: hw.mha_to_gpt2(gpt2_attn()), Raises(TypeError, r"mha_to_gpt2 converts a MultiHeadAttention: mha must be one, got GPT2MultiHeadAttention")),
    ("mha_to_gpt2 softcap", lambda: hw.mha_to_gpt2(mha(softcap=50.0)), Raises(ValueError, r"GPT-2's layout has no softcap: mha_to_gpt2 would drop it")),
    ("hf attention, two layers' keys", lambda: hw.gpt2_attention_from_hf(gpt2_attn(), {f"h.{i}.attn.{k}": v.T if v.ndim == 2 else v for i in (0, 1) for k, v in gpt2_attn().state_dict().items()}),
     Raises(ValueError, r"duplicate: h.0.attn.c_attn.weight and h.1.attn.c_attn.weight both give c_attn.weight")),
    ("hf attention, missing key", lambda: hw.gpt2_attention_from_hf(gpt2_attn(), {"c_attn.weight": torch.zeros(8, 24)}), Raises(ValueError, r"missing: c_attn.bias")),
    ("load a list", lambda: load_checked(mha(), list(mha().state_dict().values())),
     Raises(TypeError, r"state must be a mapping of names to tensors \(a state dict\), got list")),
    ("load int32 weights", lambda: load_checked(mha(), {k: v.int() if k == "W_key.weight" else v for k, v in mha().state_dict().items()}),
     Raises(ValueError, r"wrong dtype: W_key.weight: expected a floating-point tensor, got torch.int32")),
    ("load a non-tensor value", lambda: load_checked(mha(), {k: (v.tolist() if k == "W_key.bias" else v) for k, v in mha().state_dict().items()}),
     Raises(ValueError, r"wrong dtype: W_key.bias: expected a tensor, got list")),
    ("load the book's mask of another size", lambda: load_checked(mha(), {**mha().state_dict(), "mask": torch.zeros(4, 4)}), Raises(ValueError, r"wrong shape: mask: expected \(16, 16\), got \(4, 4\)")),
    ("remap an unexpected key", lambda: remap({"a": torch.zeros(1), "b": torch.zeros(1)}, {"a": (1,)}), Raises(ValueError, r"unexpected: b")),
    ("load the book's state dict = reference", load_book_state_agrees(), None),
    # ------------------------------------------------------------------ models: inputs
    ("gpt2 ids of floats", lambda: tiny_gpt2()(torch.zeros(1, 3)), Raises(TypeError, r"input_ids must hold integer token ids, got dtype torch.float32")),
    ("gpt2 ids uint8", lambda: tiny_gpt2()(ids(1, 3, dtype=torch.uint8)), Raises(TypeError, r"input_ids must hold int64 or int32 token ids \(embeddings take no other\), got dtype torch.uint8")),
    ("gpt2 ids empty batch", lambda: tiny_gpt2()(ids(0, 3)), Raises(ValueError, r"input_ids must have shape \(batch, tokens\) with at least one row and one token, got \(0, 3\)")),
    ("gpt2 ids no tokens", lambda: tiny_gpt2()(ids(2, 0)), Raises(ValueError, r"got \(2, 0\)")),
    ("gpt2 ids 1-D", lambda: tiny_gpt2()(ids(3)), Raises(ValueError, r"input_ids must have shape \(batch, tokens\)")),
    ("gpt2 id past the vocabulary", lambda: tiny_gpt2()(torch.tensor([[0, 11]])), Raises(ValueError, r"input_ids must hold ids in \[0, vocab_size=11\), got ids from 0 to 11")),
    ("gpt2 negative id", lambda: tiny_gpt2()(torch.tensor([[-1, 2]])), Raises(ValueError, r"got ids from -1 to 2")),
    ("gpt2 positions on meta", lambda: tiny_gpt2()(ids(1, 3), positions=torch.zeros(1, 3, dtype=torch.long, device=META)),  # gave CPU logits
     Raises(ValueError, r"positions is on meta but the model's weights are on cpu")),
    ("gpt2 positions of uint8", lambda: tiny_gpt2()(ids(1, 3), positions=torch.zeros(1, 3, dtype=torch.uint8)),
     Raises(TypeError, r"positions must hold int64 or int32 positions")),
    ("gpt2 too many tokens", lambda: tiny_gpt2()(ids(1, 9)), Raises(ValueError, r"input_ids has 9 tokens, more than n_positions=8")),
    ("gpt2 ids on meta", lambda: tiny_gpt2()(ids(1, 3).to(META)), Raises(ValueError, r"input_ids is on meta but the model's embeddings are on cpu")),
    ("gpt2 mask of floats", lambda: tiny_gpt2()(ids(1, 3), attention_mask=torch.ones(1, 3)), Raises(TypeError, r"attention_mask must be a bool or 0/1 int tensor")),
    ("gpt2 mask wrong shape", lambda: tiny_gpt2()(ids(1, 3), attention_mask=torch.ones(1, 2, dtype=torch.long)), Raises(ValueError, r"attention_mask must have shape \(batch, tokens\) of input_ids = \(1, 3\), got \(1, 2\)")),
    ("gpt2 left padding = unpadded", left_padding_logits_agree(), None),
    ("generate max_new_tokens 0", lambda: tiny_gpt2().generate(ids(1, 2), max_new_tokens=0), Raises(ValueError, r"max_new_tokens must be a positive int, got 0")),
    ("generate max_new_tokens bool", lambda: tiny_gpt2().generate(ids(1, 2), max_new_tokens=True), Raises(TypeError, r"max_new_tokens must be a positive int, got True")),
    ("generate temperature -1", lambda: tiny_gpt2().generate(ids(1, 2), max_new_tokens=1, temperature=-1), Raises(ValueError, r"temperature \(0 = greedy\) must be a number in \[0, inf\), got -1")),
    ("generate temperature inf", lambda: tiny_gpt2().generate(ids(1, 2), max_new_tokens=1, temperature=math.inf), Raises(ValueError, r"temperature \(0 = greedy\) must be a number in \[0, inf\), got inf")),
    ("generate temperature nan", lambda: tiny_gpt2().generate(ids(1, 2), max_new_tokens=1, temperature=math.nan), Raises(ValueError, r"got nan")),
    ("generate top_k 0", lambda: tiny_gpt2().generate(ids(1, 2), max_new_tokens=1, temperature=1.0, top_k=0), Raises(ValueError, r"top_k \(or None\) must be a positive int, got 0")),
    ("generate eos past the vocabulary", lambda: tiny_gpt2().generate(ids(1, 2), max_new_tokens=1, eos_token_id=11), Raises(ValueError, r"eos_token_id \(or None\) must be an int in \[0, 10\], got 11")),
    ("generate past n_positions", lambda: tiny_gpt2().generate(ids(1, 4), max_new_tokens=6), Raises(ValueError, r"prompt \(4 tokens\) \+ max_new_tokens \(6\) exceeds n_positions=8 by 1")),
    ("generate right-padded prompt", lambda: tiny_gpt2().generate(ids(2, 3), max_new_tokens=1, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]])),
     Raises(ValueError, r"attention_mask marks it as padding in rows \[1\]: pad prompts on the left")),
    ("generate tiny temperature = greedy", generate_tiny_temperature_agrees(), None),
    ("bert token_type_ids past type_vocab_size", lambda: tiny_bert()(ids(1, 3, high=7), token_type_ids=torch.full((1, 3), 2)), Raises(ValueError, r"token_type_ids must hold ids in \[0, type_vocab_size=2\)")),
    ("bert token_type_ids a list", lambda: tiny_bert()(ids(1, 3, high=7), token_type_ids=[[0, 0, 0]]),
     Raises(TypeError, r"token_type_ids must be an integer tensor of shape \(1, 3\) or None, got list")),
    ("book mask not a tensor, strict=False", lambda: mha().load_state_dict({"mask": "x"}, strict=False), Raises(RuntimeError, r"mask must be a tensor of shape \(16, 16\), got str")),
    ("bert token_type_ids wrong shape", lambda: tiny_bert()(ids(1, 3, high=7), token_type_ids=torch.zeros(1, 2, dtype=torch.long)), Raises(ValueError, r"token_type_ids must have the shape of input_ids, \(1, 3\), got \(1, 2\)")),
    ("bert given a GPT2Config", lambda: BertModel(hw.GPT2Config()), Raises(TypeError, r"config must be a BertConfig, got GPT2Config")),
    ("encoder one str", lambda: tiny_encoder().encode("a cat"), Raises(TypeError, r"sentences must be a list of str, got str \(wrap one sentence in a list\)")),
    ("encoder an int among the sentences", lambda: tiny_encoder().encode(["a cat", "sat", 3]), Raises(TypeError, r"sentences must be a list of str, got sentences\[2\] = 3 of type int")),
    ("encoder no sentences", lambda: tiny_encoder().encode([]), Raises(ValueError, r"sentences must hold at least one sentence, got an empty list")),
    ("encoder batch_size 0", lambda: tiny_encoder().encode(["a"], batch_size=0), Raises(ValueError, r"batch_size must be a positive int, got 0")),
    ("encoder tokenizer larger than the model", lambda: SentenceEncoder(tiny_bert(vocab_size=5), tiny_tokenizer()), Raises(ValueError, r"the tokenizer's ids go up to 6, but the model's vocab_size is 5")),
    ("head_roles given a BertModel", lambda: head_roles(tiny_bert(), ["a cat"]), Raises(TypeError, r"encoder must be a SentenceEncoder \(a BertModel with its tokenizer\), got BertModel")),
    # ------------------------------------------------------------------ models: files
    ("load from an int path", lambda: GPT2LMHeadModel.from_pretrained(3), Raises(TypeError, r"path must be a str or os.PathLike naming a HuggingFace model directory, got int")),
    ("load a missing directory", lambda: GPT2LMHeadModel.from_pretrained("/nonexistent/headwise"), Raises(FileNotFoundError, r"/nonexistent/headwise: no such directory")),
    ("load without weights", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {})), Raises(FileNotFoundError, r"no weights found \(expected model.safetensors, model.safetensors.index.json or pytorch_model.bin\)")),
    ("load garbage .bin", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"pytorch_model.bin": b"hello world"})),
     Raises(ValueError, r"pytorch_model.bin: cannot read it as a PyTorch checkpoint, the file is truncated or corrupt")),
    ("load one byte .bin", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"pytorch_model.bin": b"\x80"})), Raises(ValueError, r"truncated or corrupt")),
    ("load a training checkpoint", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"pytorch_model.bin": saved_state({"state_dict": gpt2_state()})})),
     Raises(ValueError, r"got a dict whose entry 'state_dict' is a dict \(a training checkpoint\?\)")),
    ("load a list of tensors", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"pytorch_model.bin": saved_state([torch.zeros(1)])})),
     Raises(ValueError, r"expected a dict of tensors \(a state dict\), got list")),
    ("load a state dict with a str value", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"pytorch_model.bin": saved_state({**gpt2_state(), "note": "hi"})})),
     Raises(ValueError, r"expected a dict of tensors \(a state dict\), got entry 'note' of type str")),
    ("load int32 weights from a file", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"pytorch_model.bin": saved_state({k: v.int() for k, v in gpt2_state().items()})})),
     Raises(ValueError, r"wrong dtype: transformer.wte.weight: expected a floating-point tensor, got torch.int32")),
    ("load a config with epsilon -1", lambda: GPT2LMHeadModel.from_pretrained(write_dir({"layer_norm_epsilon": -1}, {"pytorch_model.bin": saved_state(gpt2_state())})),
     Raises(ValueError, r"config.json: invalid GPT-2 config: layer_norm_epsilon must be a number in \(0, inf\), got -1")),
    ("load a config of another model", lambda: GPT2LMHeadModel.from_pretrained(write_dir({"model_type": "llama"}, {})), Raises(ValueError, r"config.json: describes model_type 'llama', expected 'gpt2'")),
    ("load a config bigger than the file", lambda: GPT2LMHeadModel.from_pretrained(write_dir({"n_embd": 4096, "n_layer": 64, "n_head": 32}, {"pytorch_model.bin": saved_state(gpt2_state())})),
     Raises(ValueError, r"wrong shape: transformer.wte.weight: expected \(11, 4096\), got \(11, 8\)")),
    ("load bad JSON", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"config.json": "{"})), Raises(ValueError, r"config.json: not valid JSON")),
    ("load a Conv1D weight in nn.Linear's layout", lambda: GPT2LMHeadModel.from_pretrained(write_dir({}, {"pytorch_model.bin": saved_state(
        {k: v.t() if k.endswith(("c_fc.weight", "c_proj.weight")) else v for k, v in gpt2_state().items()})})),  # HF's layout but c_attn's
     Raises(ValueError, r"wrong shape: transformer.h.0.attn.c_attn.weight: expected \(8, 24\), got \(24, 8\) \(stored transposed: \(in, out\)\)")),
]


@pytest.mark.parametrize(("call", "expect"), [(c, e) for _, c, e in CASES], ids=[name for name, _, _ in CASES])
def test_misuse(call, expect):
    if expect is None:  # the call builds an Agrees
        call, expect = None, call
    if isinstance(expect, Raises):
        with pytest.raises(expect.error, match=expect.match):
            call()
        return
    got, want = expect.fn()
    assert got.shape == want.shape
    assert torch.isfinite(got).all(), "a non-finite result where the reference is finite"
    torch.testing.assert_close(got.double(), want.double(), atol=expect.atol, rtol=expect.atol)


def test_the_catalogue_is_large_and_named_once():
    names = [name for name, _, _ in CASES]
    assert len(names) == len(set(names))
    assert len(CASES) >= 100
    agrees = sum(isinstance(c, Agrees) for _, c, _ in CASES)
    assert agrees >= 30 and len(CASES) - agrees >= 100  # both kinds well represented
