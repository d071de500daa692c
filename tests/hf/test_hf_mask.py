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


def test_a_padded_mask_is_read_as_it_is():
    padding = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)  # (B, S): row 1 left-padded
    built = headwise.hf.mask(**CAUSAL, attention_mask=padding)  # (B, 1, T, S)
    assert adapter._stands_for(built) is None and not built[1, 0, :, 0].any()


def _band_terms(T: int, S: int, window: int | None, padded: bool = False) -> dict:
    """A prompt's mask: T queries at the last T of S positions, causal (and a sliding window), one row padded."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    function = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    padding = torch.ones(2, S, dtype=torch.bool)
    padding[1, :3] = not padded
    return dict(batch_size=2, q_length=T, kv_length=S, q_offset=S - T, mask_function=function, attention_mask=padding,
                allow_is_causal_skip=False)


@pytest.mark.parametrize(("T", "S", "window", "padded", "meaning"), [
    (9, 9, 4, False, "window 4"), (5, 12, 4, False, "window 4"), (5, 12, None, False, "bottom-right causal"),
    (9, 9, 4, True, None), (5, 12, None, True, None), (1, 12, 4, False, None),
], ids=["a sliding prompt", "a sliding chunk after cached keys", "a chunk after cached keys", "a sliding prompt, padded",
        "a chunk, padded", "one query"])  # fmt: skip
def test_a_prompts_causal_band_runs_as_headwises_causal_and_window(T, S, window, padded, meaning, monkeypatch):
    """A mask that is, in every row, causal over the last T of S positions (with a sliding window or not) runs as
    ``causal=True, window=W`` without being read again, so the prompt kernel or the window's blocks take it; any other
    mask (padding, one query) is read as the mask it is. The outputs agree with the mask's either way."""
    built = headwise.hf.mask(**_band_terms(T, S, window, padded))  # (B, 1, T, S)
    assert adapter._stands_for(built) == meaning
    calls = []
    monkeypatch.setattr(adapter, "attention", lambda q, k, v, **kw: calls.append(kw) or headwise.attention(q, k, v, **kw))
    g = torch.Generator().manual_seed(T + S)
    q, k, v = torch.randn(2, 4, T, 8, generator=g), torch.randn(2, 2, S, 8, generator=g), torch.randn(2, 2, S, 8, generator=g)
    out, _ = headwise.hf.attend(_Says(True), q, k, v, built)  # (B, T, H, D)
    if meaning is None:
        assert calls[0]["mask"] is built and calls[0]["window"] is None
    else:
        assert calls[0]["mask"] is None and calls[0]["causal"] and calls[0]["window"] == window
    real = built.any(-1)[:, 0]  # (B, T): queries that see a key
    want = headwise.attention(q, k, v, mask=built).transpose(1, 2)  # (B, T, H, D): the mask read
    torch.testing.assert_close(out[real], want[real], rtol=1e-6, atol=1e-6)
