"""HeadMaps checks its fields when it is made, and role() its layer and head, by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headwise.models import HeadRoles, attention_mass
from headwise.viz import HeadMaps

TOKENS = ("[CLS]", "a", "b", "[SEP]")
SPECIAL = torch.tensor([[True, False, False, True]])
REAL = torch.ones(1, 4, dtype=torch.bool)


def fields(**changed) -> dict:
    """A HeadMaps's fields, 2 layers x 3 heads on 4 tokens, with ``changed`` in place of some."""
    torch.manual_seed(0)
    weights = torch.randn(2, 3, 4, 4).softmax(-1)  # (L, H, T, T)
    roles = HeadRoles(attention_mass(list(weights[:, None]), SPECIAL, REAL))  # (L, H, 4)
    return {"model": "tiny", "text": "a b", "tokens": TOKENS, "weights": weights, "roles": roles, "causal": False, "cut": 0} | changed


def test_weights_of_any_floating_dtype_are_kept_as_float32_and_tokens_as_a_tuple():
    """What the page and the picture read (heads_figure's numpy() refused bfloat16)."""
    given = fields()
    maps = HeadMaps(**fields(weights=given["weights"].bfloat16(), tokens=list(TOKENS), cut=np.int64(2)))
    assert maps.weights.dtype == torch.float32 and torch.equal(maps.weights, given["weights"].bfloat16().float())
    assert maps.tokens == TOKENS and type(maps.cut) is int and maps.cut == 2


@pytest.mark.parametrize(
    ("changed", "error", "message"),
    [
        ({"model": None}, TypeError, r"model must be a str, got NoneType"),
        ({"text": b"a b"}, TypeError, r"text must be a str, got bytes"),
        ({"weights": np.ones((2, 3, 4, 4))}, TypeError, r"weights must be a floating-point tensor \(L, H, T, T\), got ndarray"),
        ({"weights": torch.ones(2, 3, 4, 4, dtype=torch.long)}, TypeError, r"weights must be a floating-point tensor .* got dtype torch.int64"),
        ({"weights": torch.ones(3, 4, 4)}, ValueError, r"weights must be \(L, H, T, T\) with L, H, T >= 1: .* got shape \(3, 4, 4\)"),
        ({"weights": torch.ones(2, 3, 4, 5)}, ValueError, r"weights must be \(L, H, T, T\) .* got shape \(2, 3, 4, 5\)"),
        ({"weights": torch.ones(0, 3, 4, 4)}, ValueError, r"weights must be \(L, H, T, T\) with L, H, T >= 1: .* got shape \(0, 3, 4, 4\)"),
        ({"tokens": "[CLS] a b [SEP]"}, TypeError, r"tokens must be a tuple of str \(the sentence's T tokens\), got str"),
        ({"tokens": ("[CLS]", 7, "b", "[SEP]")}, TypeError, r"tokens must be a tuple of str, got tokens\[1\] = 7 of type int"),
        ({"tokens": TOKENS[:3]}, ValueError, r"tokens must hold T = 4 entries \(weights are \(2, 3, 4, 4\)\), got 3"),
        ({"roles": torch.zeros(2, 3, 4)}, TypeError, r"roles must be a headwise.models.HeadRoles, got Tensor"),
        ({"roles": HeadRoles([[0.0] * 4])}, TypeError, r"roles.mass must be a tensor \(L, H, 4\), got list"),
        ({"roles": HeadRoles(torch.zeros(2, 4, 4))}, ValueError, r"roles.mass must be \(L, H, 4\) = \(2, 3, 4\), .* got shape \(2, 4, 4\)"),
        ({"roles": HeadRoles(torch.zeros(2, 3))}, ValueError, r"roles.mass must be \(L, H, 4\) = \(2, 3, 4\), .* got shape \(2, 3\)"),
        ({"weights": torch.ones(2, 3, 4, 4).index_fill_(0, torch.tensor([1]), float("nan"))}, ValueError,
         r"weights must hold finite weights, got 48 NaN or infinite values \(the first: nan\)"),
        ({"roles": HeadRoles(torch.zeros(2, 3, 4).index_fill_(2, torch.tensor([3]), float("inf")))}, ValueError,
         r"roles.mass must hold finite weights, got 6 NaN or infinite values \(the first: inf\)"),
        ({"causal": 1}, TypeError, r"causal must be True or False, got int 1"),
        ({"cut": -1}, ValueError, r"cut must be an int >= 0, got -1"),
        ({"cut": 1.0}, TypeError, r"cut must be an int >= 0, got 1.0"),
    ],
    ids=["model", "text", "ndarray", "int-weights", "3-d", "not-square", "no-layers", "tokens-str", "token-int", "short-tokens",
         "roles-tensor", "mass-list", "mass-heads", "mass-2-d", "nan-weights", "inf-mass", "causal-int", "cut-negative", "cut-float"],
)
def test_a_bad_field_is_named(changed, error, message):
    """Each was kept, to fail later in the page or the picture (an IndexError, a numpy error) or draw wrong labels."""
    with pytest.raises(error, match=message):
        HeadMaps(**fields(**changed))


def test_role_refuses_a_layer_or_head_out_of_range_by_name():
    """Negative indexes too: the page and heads_figure count layers and heads from 0 (role(-1, 0) read the last layer)."""
    maps = HeadMaps(**fields())
    assert maps.role(np.int64(1), 2) == maps.role(1, 2)
    for (layer, head), error, message in [
        ((2, 0), ValueError, r"layer must be an int in \[0, 1\], got 2"),
        ((-1, 0), ValueError, r"layer must be an int in \[0, 1\], got -1"),
        ((0, 3), ValueError, r"head must be an int in \[0, 2\], got 3"),
        ((0, -3), ValueError, r"head must be an int in \[0, 2\], got -3"),
        ((True, 0), TypeError, r"layer must be an int in \[0, 1\], got True"),
        ((0, 1.0), TypeError, r"head must be an int in \[0, 2\], got 1.0"),
        ((torch.tensor(0), 0), TypeError, r"layer must be an int in \[0, 1\], got a tensor"),
    ]:
        with pytest.raises(error, match=message):
            maps.role(layer, head)
