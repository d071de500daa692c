"""headwise.masks against masks built entry by entry in the reference."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from reference import allowed_matrix

from headwise.masks import causal_mask, padding_mask, position_mask


@given(t=st.integers(1, 9), s=st.integers(1, 9), window=st.none() | st.integers(1, 10))
def test_causal_mask_matches_entry_by_entry_rule(t, s, window):
    got = causal_mask(t, s, window=window)
    assert got.dtype == torch.bool and got.shape == (t, s)
    assert torch.equal(got, allowed_matrix(t, s, causal=True, window=window))


def test_causal_mask_docstring_example():
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_causal_mask_square_is_lower_triangular():
    assert torch.equal(causal_mask(5, 5), torch.ones(5, 5, dtype=torch.bool).tril())


@given(
    q_pos=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    k_pos=st.lists(st.integers(0, 20), min_size=1, max_size=6),
    window=st.none() | st.integers(1, 8),
)
def test_position_mask_from_arbitrary_positions(q_pos, k_pos, window):
    got = position_mask(torch.tensor(q_pos), torch.tensor(k_pos), window=window)
    for i, p in enumerate(q_pos):
        for j, kp in enumerate(k_pos):
            assert bool(got[i, j]) == (kp <= p and (window is None or kp > p - window))


def test_padding_mask_broadcasts_over_heads_and_queries():
    kpm = torch.tensor([[True, True, False], [False, True, True]])
    got = padding_mask(kpm)
    assert got.shape == (2, 1, 1, 3)
    assert torch.equal(got.expand(2, 4, 5, 3)[1, 3, 4], kpm[1])


def test_causal_mask_refuses_what_is_not_a_window_or_a_count():
    with pytest.raises(ValueError, match=r"window must be a positive int, got 0"):
        causal_mask(3, 3, window=0)  # an all-False mask before
    with pytest.raises(TypeError, match=r"window must be a positive int, got 1.5"):
        causal_mask(3, 3, window=1.5)
    with pytest.raises(ValueError, match=r"s must be an int >= 0, got -1"):
        causal_mask(1, -1)
    with pytest.raises(TypeError, match=r"t must be an int >= 0, got 2.0"):
        causal_mask(2.0, 3)


def test_the_helpers_name_what_they_were_given_wrong():
    """Each raised from deep in torch (a bool subtracted, an index past a 1-D tensor, a meta tensor's repeat count)."""
    from headwise.masks import document_mask, documents_from_cu_seqlens

    pos, ids = torch.arange(4), torch.zeros(1, 3, dtype=torch.long)
    for call, error, message in [
        (lambda: position_mask(pos, pos, window=True), TypeError, r"window must be a positive int, got True"),
        (lambda: position_mask([0, 1], pos), TypeError, r"q_pos must be an integer tensor of shape \(T,\), got list"),
        (lambda: position_mask(pos, pos.float()), TypeError, r"k_pos must be an integer tensor of shape \(S,\), got dtype torch.float32"),
        (lambda: padding_mask(torch.ones(4, dtype=torch.bool)), ValueError, r"attention_mask must be a \(B, S\) tensor, True = real token, got shape \(4,\)"),
        (lambda: document_mask(ids[0], ids), ValueError, r"q_documents must have shape \(B, T\), got \(3,\)"),
        (lambda: document_mask(ids.float(), ids), TypeError, r"q_documents must be an integer tensor of shape \(B, T\), got dtype torch.float32"),
        (lambda: document_mask(ids, ids.expand(2, 3)), ValueError, r"q_documents and k_documents must have one row per batch, got \(1, 3\) and \(2, 3\)"),
        (lambda: documents_from_cu_seqlens(torch.tensor([0, 3, 5], device="meta")), ValueError, r"cu_seqlens must hold values the ids are counted by"),
    ]:
        with pytest.raises(error, match=message):
            call()
    assert document_mask(ids, ids).shape == (1, 1, 3, 3) and position_mask(pos, pos, window=2).sum() == 7
