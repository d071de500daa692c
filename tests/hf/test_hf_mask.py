"""``headwise.hf.mask`` never answers None, and ``attend`` reads a skippable mask by what it stands for.

transformers' ``sdpa_mask`` answers None both for a causal mask it skips and for a bidirectional
one with nothing padded; a layer's ``is_causal`` cannot tell them apart (Splinter's layers have
none; PaliGemma's say False under the causal mask it builds). The tests give ``attend`` each
skippable mask with a layer that says the opposite, against ``headwise.attention`` told the truth.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, sdpa_mask

import headwise
import headwise.hf
from headwise.hf import adapter

CAUSAL = dict(batch_size=2, q_length=4, kv_length=4, mask_function=causal_mask_function, allow_is_causal_skip=True)
FULL = dict(batch_size=2, q_length=4, kv_length=4, mask_function=bidirectional_mask_function, allow_is_causal_skip=False,
            allow_is_bidirectional_skip=True)  # fmt: skip


class _Says(nn.Module):
    """An attention layer that says ``is_causal`` (or nothing, for None)."""

    def __init__(self, is_causal: bool | None):
        super().__init__()
        if is_causal is not None:
            self.is_causal = is_causal


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))  # (B, H, T, D) each


@pytest.mark.parametrize("terms", [CAUSAL, FULL], ids=["causal", "bidirectional"])
def test_a_mask_transformers_would_skip_is_built_all_the_same(terms):
    assert sdpa_mask(**terms) is None  # what transformers' own builder answers
    got = headwise.hf.mask(**terms)  # (B, 1, T, S)
    want = sdpa_mask(**{**terms, "allow_is_causal_skip": False, "allow_is_bidirectional_skip": False})  # (B, 1, T, S)
    assert got.dtype == torch.bool and torch.equal(got, want)


@pytest.mark.parametrize(("terms", "causal"), [(CAUSAL, True), (FULL, False)], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("says", [True, False, None], ids=["says causal", "says not causal", "says nothing"])
def test_attend_follows_the_mask_not_what_the_layer_says(terms, causal, says):
    q, k, v = _qkv()
    out, _ = headwise.hf.attend(_Says(says), q, k, v, headwise.hf.mask(**terms))  # (B, T, H, D)
    want = headwise.attention(q, k, v, causal=causal).transpose(1, 2)  # (B, T, H, D)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize(("terms", "causal"), [(CAUSAL, True), (FULL, False)], ids=["causal", "bidirectional"])
def test_a_skippable_mask_runs_without_being_read_and_a_copy_of_it_is_read(terms, causal, monkeypatch):
    calls = []

    def spy(q, k, v, **kwargs):
        calls.append(kwargs)
        return headwise.attention(q, k, v, **kwargs)

    monkeypatch.setattr(adapter, "attention", spy)
    q, k, v = _qkv()
    built = headwise.hf.mask(**terms)  # (B, 1, T, S)
    first, _ = headwise.hf.attend(_Says(None), q, k, v, built)
    second, _ = headwise.hf.attend(_Says(None), q, k, v, built.clone())
    assert calls[0]["mask"] is None and calls[0]["causal"] is causal  # headwise's own causal / full path
    assert calls[1]["mask"] is not None and calls[1]["causal"] is False  # a copy: read as the mask it is
    torch.testing.assert_close(first, second)


def _band_terms(T: int, S: int, window: int | None, pad: str = "", causal: bool = True) -> dict:
    """A mask's terms: T queries at the last T of S positions, causal (a sliding window or not) or bidirectional; row 1
    padded ("left": its first 3 keys; "right": its last 2), or its last keys a static cache's empty slots ("slots")."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    function = bidirectional_mask_function if not causal else causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    padding = torch.ones(2, S, dtype=torch.bool)
    if pad == "left":
        padding[1, :3] = False
    elif pad == "right":
        padding[1, -2:] = False
    elif pad == "slots":
        padding[:, -2:] = False
    return dict(batch_size=2, q_length=T, kv_length=S, q_offset=S - T, mask_function=function, attention_mask=padding,
                allow_is_causal_skip=False)


@pytest.mark.parametrize(("T", "S", "window", "pad", "causal", "meaning"), [
    (9, 9, 4, "", True, (True, 4, False)), (5, 12, 4, "", True, (True, 4, False)), (5, 12, None, "", True, (True, None, False)),
    (9, 9, None, "left", True, (True, None, True)), (9, 9, 4, "left", True, (True, 4, True)), (5, 12, None, "left", True, (True, None, True)),
    (9, 9, None, "right", True, (True, None, True)), (6, 6, None, "left", False, (False, None, True)),
    (8, 12, None, "slots", True, (True, None, True)), (1, 12, None, "left", True, (True, None, True)),
    (1, 12, None, "slots", True, (True, None, True)), (1, 12, 4, "left", True, (True, None, True)), (1, 12, 4, "", True, (True, None, True)),
    (1, 12, None, "", True, (True, None, False)),
], ids=["a sliding prompt", "a sliding chunk after cached keys", "a chunk after cached keys", "a prompt, left-padded",
        "a sliding prompt, left-padded", "a chunk, left-padded", "a prompt, right-padded", "bidirectional, padded",
        "a chunk before a static cache's empty slots", "a decode step, left-padded", "a decode step before empty slots",
        "a sliding decode step, left-padded (the window as the keys it sees)", "a sliding decode step", "a decode step"])  # fmt: skip
def test_a_mask_of_causality_windows_and_padding_runs_as_headwises_terms(T, S, window, pad, causal, meaning, monkeypatch):
    """A mask that is, in every row, causal over the last T of S positions (a sliding window or not) or every key, but
    for keys no query sees (padding, empty slots), runs as ``causal``, ``window`` and a (B, S) ``attention_mask`` without
    being read again, so the prompt and decode kernels (or the window's blocks) take it; its outputs are the mask's. A
    padded key's key and value may be anything (NaN here): no output sees them."""
    built = headwise.hf.mask(**_band_terms(T, S, window, pad, causal))  # (B, 1, T, S)
    stands = adapter._stands_for(built)
    assert (stands.causal, stands.window, stands.real is not None) == meaning
    calls = []
    monkeypatch.setattr(adapter, "attention", lambda q, k, v, **kw: calls.append(kw) or headwise.attention(q, k, v, **kw))
    g = torch.Generator().manual_seed(T + S)
    q, k, v = torch.randn(2, 4, T, 8, generator=g), torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
    padded = ~stands.real[:, None, :, None] if stands.real is not None else torch.zeros(2, 1, S, 1, dtype=torch.bool)  # (B, 1, S, 1)
    out, _ = headwise.hf.attend(_Says(True), q, k.masked_fill(padded, float("nan")), v.masked_fill(padded, float("nan")), built)  # (B, T, H, D)
    assert calls[0]["mask"] is None and calls[0]["causal"] == causal and calls[0]["window"] == meaning[1]
    assert (calls[0]["attention_mask"] is not None) == meaning[2]
    want = headwise.attention(q, k, v, mask=built).transpose(1, 2)  # (B, T, H, D): the mask read
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    assert not out[~built.any(-1)[:, 0]].any()  # queries that see no key: zeros, as the mask's


def test_any_other_mask_is_read_as_it_is(monkeypatch):
    """Packed rows, chunks (Llama 4's), a prefill into a static cache's first slots, a mask whose rows disagree with any
    band, and a copy of a band: each is read as the mask it is."""
    from transformers.masking_utils import chunked_causal_mask_function

    packed = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    packed[..., :3, :3] = packed[..., 3:, 3:] = True
    packed &= torch.ones(8, 8, dtype=torch.bool).tril()  # two documents in one row
    chunks = headwise.hf.mask(batch_size=2, q_length=8, kv_length=8, mask_function=chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)),
                              allow_is_causal_skip=False)  # fmt: skip
    static = headwise.hf.mask(batch_size=2, q_length=5, kv_length=12, mask_function=causal_mask_function, allow_is_causal_skip=False,
                              attention_mask=torch.tensor([[1] * 12, [0] + [1] * 11], dtype=torch.bool))  # fmt: skip
    odd = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    odd[0, 0, 2, 0] = False  # one key left out of one row only
    band = headwise.hf.mask(**_band_terms(9, 9, 4, "left"))
    assert adapter._meaning(packed) is None and adapter._meaning(odd) is None
    for mask in (chunks, static, band.clone()):
        assert adapter._stands_for(mask) is None
    assert adapter._stands_for(band) is not None
