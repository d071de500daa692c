"""``_checks.integer``: any integral ``operator.index`` takes, returned as a plain int; a wrong type is a TypeError."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headwise import _checks


@pytest.mark.parametrize("value", [5, np.int64(5), np.int32(5), np.uint8(5), np.array(5)])
def test_integer_takes_numpy_integers_and_returns_an_int(value):
    got = _checks.positive_int("n", value)
    assert got == 5 and type(got) is int


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (2.5, r"n must be a positive int, got 2.5"),
        ("3", r"n must be a positive int, got '3'"),
        (None, r"n must be a positive int, got None"),
        (True, r"n must be a positive int, got True"),
        (np.True_, r"n must be a positive int, got np.True_"),
        (np.float64(3.0), r"n must be a positive int, got np.float64\(3.0\)"),
        (torch.tensor(3), r"n must be a positive int, got a tensor of shape \(\) and dtype torch.int64: pass int\(t\)"),
        (torch.ones(2, dtype=torch.long), r"n must be a positive int, got a tensor of shape \(2,\) and dtype torch.int64$"),
    ],
)
def test_integer_refuses_a_wrong_type_with_a_type_error(value, match):
    with pytest.raises(TypeError, match=match):
        _checks.positive_int("n", value)


@pytest.mark.parametrize(("value", "match"), [(0, r"got 0"), (np.int64(-1), r"got -1"), (2**63, r"below 2\*\*63")])
def test_integer_refuses_a_value_out_of_range_with_a_value_error(value, match):
    with pytest.raises(ValueError, match=r"n must be a positive int.*" + match):
        _checks.positive_int("n", value)


def test_window_keeps_the_kind_of_error_and_returns_an_int():
    assert type(_checks.window(np.int64(4), causal=True)) is int
    with pytest.raises(TypeError, match=r"window must be a positive int or None, got 2.5"):
        _checks.window(2.5, causal=True)
    with pytest.raises(ValueError, match=r"window must be a positive int or None, got 0"):
        _checks.window(0, causal=True)
