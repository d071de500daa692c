"""``headwise explain --rope``: the rotation step, read off LlamaAttention on the book's tokens."""

from __future__ import annotations

import math

import torch

from headwise.cli import main
from headwise.explain_rope import explain_rope


def test_each_pair_turns_by_its_position_in_radians():
    _, steps = explain_rope()
    before = steps[0].tensors["queries.transpose"].double()  # (1, H, 6, 2): one pair per head
    after = steps[2].tensors["queries.rotated"].double()
    for p in range(6):
        c, s = math.cos(p), math.sin(p)  # head_dim 2: frequency theta^0 = 1, angle p radians
        rot = torch.tensor([[c, s], [-s, c]], dtype=torch.float64)  # row vector (a, b) -> (a c - b s, a s + b c)
        torch.testing.assert_close(after[..., p, :], before[..., p, :] @ rot, atol=1e-6, rtol=0)
    torch.testing.assert_close(steps[1].tensors["angles"][:, 0], torch.arange(6.0))
    weights = steps[3].tensors["weights"]
    assert weights.shape == (1, 2, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 6))
    assert (weights.triu(1) == 0).all()  # causal


def test_cli_prints_the_steps(capsys):
    main(["explain", "--rope", "--head-dim", "4"])
    out = capsys.readouterr().out
    assert "head_dim=4" in out
    for n in (1, 2, 3, 4):
        assert f"## Step {n}:" in out
    assert "-- queries.rotated: shape (1, 2, 6, 4)" in out


def test_explain_ropes_arguments_are_checked_by_their_own_names():
    """Not by the config fields they fill (num_attention_heads, rope_theta); the seed as explain's."""
    import pytest

    for kwargs, error, match in [
        ({"num_heads": 0}, ValueError, r"num_heads must be a positive int, got 0"),
        ({"head_dim": 1.5}, TypeError, r"head_dim must be a positive int, got 1\.5"),
        ({"head_dim": 3}, ValueError, r"head_dim must be even \(RoPE turns dimensions in pairs\), got 3"),  # (not a config field's name)
        ({"theta": -1.0}, ValueError, r"theta must be a number in \(1, inf\), got -1\.0"),
        ({"seed": -1}, ValueError, r"seed must be an int in \[0, 18446744073709551615\], got -1"),
        ({"num_heads": 4096, "head_dim": 4096}, ValueError, r"these sizes make one of 100,663,296 numbers .*take fewer num_heads"),
        ({"num_heads": 466034, "head_dim": 2}, ValueError, r"these sizes make one of 16,777,224 numbers"),  # the (H, 6, 6) weights
    ]:
        with pytest.raises(error, match=match):
            explain_rope(**kwargs)
