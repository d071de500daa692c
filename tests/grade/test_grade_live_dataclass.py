"""A dataclass graded live is written as a dataclass: its decorator with the parameters that made it, its fields.

What the decorator generated (``__init__``, ``__repr__``, ``__dataclass_fields__``...) is left for
the decorator to make again in the grading process. A config with no method of its own is
written from its fields; a field whose default has no text is refused, naming the field.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from headwise.grade import grade
from headwise.grade import hints as H
from headwise.grade.live import write_class
from headwise.grade.reference import Config
from headwise.grade.source import SourceError, module_source

LEARNERS = Path(__file__).parent / "learners"
IMPORTS = "from typing import ClassVar\n\nimport torch\nimport torch.nn as nn\nfrom dataclasses import KW_ONLY, InitVar, dataclass, field\n\n"
CFG = """@dataclass(frozen=True)
class AttentionConfig:
    d_in: int
    d_out: int
    context_length: int
    dropout: float = 0.0
    num_heads: int = 2
    qkv_bias: bool = False
"""


def with_config(stem: str) -> str:
    """``learners/<stem>.py``'s MultiHeadAttention, keeping its sizes in an AttentionConfig it builds."""
    source = (LEARNERS / f"{stem}.py").read_text()
    cls = source[source.index("class MultiHeadAttention(") :].split("\n\ninputs = ")[0]
    keep = "        cfg = AttentionConfig(d_in, d_out, context_length, dropout, num_heads, qkv_bias)\n        self.cfg = cfg\n"
    return cls.replace("        super().__init__()\n", "        super().__init__()\n" + keep, 1)


def defined(cell: str) -> dict:
    """The namespace after running ``cell`` (of classes with no method: no text to keep) with its annotations evaluated,
    as a notebook evaluates them."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(IMPORTS + cell, "<cell>", "exec", dont_inherit=True), namespace)
    return namespace


def as_written(cls: type) -> type:
    """``cls`` written down and run again, as the grading process runs it."""
    namespace: dict = {}
    exec(compile(module_source([cls]), "classes.py", "exec", dont_inherit=True), namespace)
    return namespace[cls.__name__]


def made_with(cls: type) -> tuple:
    """What the decorator was given, read back from the class it made (each annotation as its text)."""
    fields = [(f.name, f.type if isinstance(f.type, str) else inspect.formatannotation(f.type), f.default,
               getattr(f.default_factory, "__name__", f.default_factory), f.init, f.repr, f.hash, f.compare, dict(f.metadata), f.kw_only)
              for f in dataclasses.fields(cls)]
    return repr(cls.__dataclass_params__), "__match_args__" in vars(cls), vars(cls).get("__slots__"), fields


# ----------------------------------------------------------------------------- graded


@pytest.mark.slow
@pytest.mark.parametrize(("stem", "passed", "step", "hint"), [("book", True, None, None), ("mask_missing", False, "masked_scores", H.NO_MASK)])
def test_a_class_using_a_dataclass_config_is_graded_by_its_numbers(notebook, stem, passed, step, hint):
    ns = notebook(IMPORTS + CFG)
    notebook(with_config(stem))
    (r,) = grade(ns["MultiHeadAttention"]).results
    assert (r.passed, r.step, r.hint) == (passed, step, hint)


@pytest.mark.slow
def test_an_attention_module_that_is_itself_a_dataclass_is_graded(notebook):
    # eq=False keeps nn.Module hashable; the book's signature is the fields' order; __post_init__ does __init__'s work
    init = (
        "@dataclass(eq=False)\nclass MultiHeadAttention(nn.Module):\n    d_in: int\n    d_out: int\n    context_length: int\n"
        "    dropout: float\n    num_heads: int\n    qkv_bias: bool = False\n\n    def __post_init__(self):\n        super().__init__()\n"
        "        self.head_dim = self.d_out // self.num_heads\n"
        "        self.W_query = nn.Linear(self.d_in, self.d_out, bias=self.qkv_bias)\n"
        "        self.W_key = nn.Linear(self.d_in, self.d_out, bias=self.qkv_bias)\n"
        "        self.W_value = nn.Linear(self.d_in, self.d_out, bias=self.qkv_bias)\n"
        "        self.out_proj = nn.Linear(self.d_out, self.d_out)\n        self.drop = nn.Dropout(self.dropout)\n"
        "        self.register_buffer('mask', torch.triu(torch.ones(self.context_length, self.context_length), diagonal=1))\n\n"
    )
    book = (LEARNERS / "book.py").read_text().split("\n\ninputs = ")[0]
    forward = book[book.index("    def forward", book.index("class MultiHeadAttention(")) :].replace("self.dropout(", "self.drop(")
    ns = notebook(IMPORTS + init + forward)
    report = grade(ns["MultiHeadAttention"])
    assert report.exit_code == 0, report.to_text()


# ----------------------------------------------------------------------------- written down, in this process


@pytest.mark.parametrize("cell", [
    CFG,
    "@dataclass(order=True, frozen=True, match_args=False, slots=True, weakref_slot=True)\nclass AttentionConfig:\n    d_in: int\n"
    "    tags: list[int] = field(default_factory=list, repr=False, compare=False, metadata={'unit': 'token'})\n"
    "    dtype: torch.dtype = field(default=None, hash=True)\n    _: KW_ONLY\n    scale: float = float('inf')\n    shape: tuple = (1, 2)\n",
    "@dataclass\nclass Sizes:\n    d_in: int = 3\n\n@dataclass(eq=True, repr=False, unsafe_hash=True)\nclass AttentionConfig(Sizes):\n"
    "    sizes: Sizes = field(default_factory=Sizes)\n    name: 'str' = 'mha'\n",
    "@dataclass(init=False, eq=False)\nclass AttentionConfig:\n    pass\n",
])
def test_a_config_with_no_method_is_written_with_its_decorators_parameters_and_its_fields(cell):
    cls = defined(cell)["AttentionConfig"]
    assert made_with(as_written(cls)) == made_with(cls)


def test_a_class_variable_of_a_config_stays_a_class_attribute_not_a_field():
    cls = defined("@dataclass\nclass AttentionConfig:\n    d_in: int = 3\n    scale: ClassVar[float] = 0.5\n")["AttentionConfig"]
    written = as_written(cls)
    assert (made_with(written), written.scale) == (made_with(cls), 0.5)


def test_a_dataclass_statement_is_written_as_it_is_without_what_the_decorator_made(notebook):
    ns = notebook(IMPORTS + "@dataclass\nclass AttentionConfig:\n    d_in: int = 3\n    tags: list = field(default_factory=list)\n\n"
                            "    def twice(self):\n        return 2 * self.d_in\n")
    notebook("AttentionConfig.d_in = 5\n")
    source = module_source([ns["AttentionConfig"]])
    assert source.endswith("        return 2 * self.d_in\n\n\nAttentionConfig.d_in = 5\n"), source  # no del of tags, no __init__
    written = as_written(ns["AttentionConfig"])
    assert (written().twice(), written().tags, written.d_in) == (6, [], 5)


def test_a_dataclass_made_from_a_module_is_unchanged_since():
    assert (write_class(Config).changes, write_class(Config).from_statement) == ([], True)


@pytest.mark.parametrize(("cell", "why"), [
    ("    dtype: torch.dtype = torch.float32\n", r"AttentionConfig.dtype has a default \(a dtype\) that cannot be written down"),
    ("    sizes: list = field(default_factory=lambda: [3, 2])\n", r"AttentionConfig.sizes has a default_factory \(a function\) that cannot be written down"),
    ("    seed: InitVar[int] = 123\n", r"AttentionConfig.seed is an InitVar of a dataclass with no method of its own"),
])
def test_a_field_that_cannot_be_written_down_is_refused_by_name(cell, why):
    ns = defined("@dataclass\nclass AttentionConfig:\n    d_in: int = 3\n" + cell)
    with pytest.raises(SourceError, match="^cannot grade AttentionConfig: " + why):
        module_source([ns["AttentionConfig"]])
