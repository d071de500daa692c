"""The fuzz of ``headwise.attention`` (``tests/fuzz_core.py``), in a child process: a crash fails this test, not the run."""

from __future__ import annotations

from pathlib import Path

import pytest
from isolated import run_isolated

TESTS = Path(__file__).resolve().parent

#: Random calls per run; HYPOTHESIS_PROFILE=thorough in the environment does not reach the child: raise it here.
EXAMPLES = 150


@pytest.mark.slow
def test_random_calls_match_the_reference_and_never_crash():
    code = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
import fuzz_core
fuzz_core.run({EXAMPLES})
print(json.dumps("ok"))
"""
    assert run_isolated(code) == "ok"
