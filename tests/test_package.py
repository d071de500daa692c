"""The package's top level: the learner's tools one attribute away, the larger parts loaded on first use.

Each check runs in a fresh interpreter, since what a test imported before would hide what
``import headwise`` alone loads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_headwise_stays_light():
    loaded = run("""
        import sys
        import headwise
        heavy = ("transformers", "matplotlib", "nbformat", "safetensors", "tokenizers", "headwise.models", "headwise.viz", "headwise.hf", "headwise.bench")
        print(sorted(m for m in heavy if m in sys.modules))
    """)
    assert loaded == "[]"


@pytest.mark.slow
def test_the_learners_tools_are_functions_at_the_top_level():
    out = run("""
        import headwise as hw
        from headwise.teaching import MultiHeadAttention
        report = hw.grade(MultiHeadAttention)
        print(report.exit_code, report.results[0].name, report.results[0].passed)
        module, steps = hw.explain()
        print(type(module).__name__, len(steps), tuple(steps[9].tensors["output"].shape))
        from headwise.viz import heads
        print(hw.heads is heads, hw.heads.__name__)
    """)
    assert out.splitlines() == ["0 MultiHeadAttention True", "MultiHeadAttention 10 (1, 6, 2)", "True heads"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "first",
    ["import headwise.grade", "from headwise.explain import BOOK_TOKENS", "import headwise.viz", "import headwise.explain_rope"],
)
def test_importing_a_module_first_leaves_the_functions_in_place(first):
    """``hw.grade`` / ``hw.explain`` stay the functions whatever imported their modules, in any order;
    the modules keep their names for ``from headwise.grade import ...``."""
    out = run(f"""
        {first}
        import sys
        import headwise as hw
        from headwise.grade import grade, Report
        from headwise.explain import explain, BOOK_TOKENS
        print(hw.grade is grade, hw.explain is explain, type(sys.modules["headwise.grade"]).__name__, Report.__name__, len(BOOK_TOKENS))
    """)
    assert out == "True True module Report 6"


@pytest.mark.slow
def test_submodules_are_attributes_loaded_on_first_use():
    out = run("""
        import sys
        import headwise as hw
        print("headwise.models" in sys.modules, hw.models.GPT2LMHeadModel.__name__, "headwise.models" in sys.modules)
        print(hw.hf.__name__, hw.parallel.__name__, hw.quantize.__name__, hw.rope.__name__, hw.viz.__name__, hw.bench.__name__)
        print(all(name in dir(hw) for name in ("models", "hf", "heads", "grade", "explain")))
        from headwise import demo
        print(demo.__name__)
    """)
    assert out.splitlines() == [
        "False GPT2LMHeadModel True",
        "headwise.hf headwise.parallel headwise.quantize headwise.rope headwise.viz headwise.bench",
        "True",
        "headwise.demo",
    ]


def test_an_unknown_attribute_is_an_attribute_error():
    import headwise as hw

    with pytest.raises(AttributeError, match="module 'headwise' has no attribute 'nonsense'"):
        hw.nonsense  # noqa: B018


def test_every_public_name_is_there():
    import headwise as hw

    assert all(callable(getattr(hw, name)) for name in hw.__all__)
    assert {"grade", "explain", "heads"} <= set(hw.__all__)
