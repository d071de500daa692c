"""Matching a learner's tensors to the book's steps: equivalent layouts count, wrong numbers do not."""

from __future__ import annotations

import math

import torch

from headwise.grade.match import first_divergence, layouts, produced, same
from headwise.grade.record import Recorder

torch.manual_seed(0)
Q = torch.randn(2, 5, 6, dtype=torch.float64)  # (B, T, C), 3 heads of 2
HEADS = Q.view(2, 5, 3, 2).transpose(1, 2)  # (B, H, T, D)


def test_the_same_numbers_in_an_equivalent_layout_count():
    assert produced([HEADS.transpose(1, 2).float()], HEADS)  # einsum's (B, T, H, D)
    assert produced([HEADS.reshape(6, 5, 2).float()], HEADS)  # (B*H, T, D)
    assert produced([Q.float()], Q.view(2, 5, 3, 2))  # a view never taken


def test_a_view_without_the_transpose_does_not():
    wrong = Q.view(2, 3, 5, 2)  # (B, H, T, D) read straight from (B, T, C)
    assert not any(same(v, HEADS) for v in layouts(wrong, HEADS.shape))


def test_scores_match_at_any_positive_scale_and_a_finite_minus_infinity():
    scores = HEADS @ torch.randn_like(HEADS).transpose(-2, -1)  # (B, H, T, T): queries @ keys^T
    future = torch.ones(5, 5, dtype=torch.bool).triu(1)
    masked = scores.masked_fill(future, -math.inf)
    assert same((scores / math.sqrt(2)).float(), scores, scale_free=True)
    assert same((scores / 2).masked_fill(future, -1e9), masked, scale_free=True)
    assert not same(-scores, scores, scale_free=True)
    assert not same(scores.transpose(-2, -1).masked_fill(future, -math.inf), masked, scale_free=True)
    assert not same(scores / 2, scores)  # only where asked


def test_the_first_divergence_skips_steps_a_later_one_of_their_chain_stands_for():
    steps = {"queries": Q, "queries.view": Q.view(2, 5, 3, 2) + 1, "queries.transpose": HEADS, "scores": HEADS @ HEADS.transpose(-2, -1)}
    assert first_divergence([HEADS.float()], steps) == "scores"  # queries.view (made different here) is excused by its transpose
    assert first_divergence([Q.float()], steps) == "queries.view"
    assert first_divergence([], steps) == "queries"


def test_the_recorder_sees_every_op_and_what_sdpa_hides():
    q = k = v = torch.randn(1, 2, 4, 3)
    with Recorder() as rec:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.mul_(2.0)
    weights = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(3)).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -math.inf), dim=-1)
    assert produced(rec.tensors, weights.double())
    assert produced(rec.tensors, (out / 2).double()) and produced(rec.tensors, out.double())  # copies, taken before the in-place op
