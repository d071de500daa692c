"""Doctests of src/ run with the suite; their examples may use ``torch`` without importing it."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace["torch"] = torch
