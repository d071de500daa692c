"""A class is graded as the learner has it now: its methods' own code, wherever each was written.

A class remade with ``exec()`` (no text to read back), a method replaced in a later cell, a
method added after the class statement (d2l's ``add_to_class``), a method deleted: each is
graded as the object is, or refused with the reason, never graded as an older text of its name.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
from llms_from_scratch import ch03 as book

from headwise.grade import grade
from headwise.grade import hints as H
from headwise.grade.source import SourceError, carried, module_source

LEARNERS = Path(__file__).parent / "learners"
BOOK = (LEARNERS / "book.py").read_text()
ADD_TO_CLASS = "def add_to_class(Class):\n    def wrapper(obj):\n        setattr(Class, obj.__name__, obj)\n    return wrapper\n"


def method(stem: str, name: str, cls: str = "MultiHeadAttention") -> str:
    """The text of ``cls.name`` in ``learners/<stem>.py``, dedented to the top level."""
    source = (LEARNERS / f"{stem}.py").read_text()
    (node,) = [n for c in ast.parse(source).body if isinstance(c, ast.ClassDef) and c.name == cls for n in c.body
               if isinstance(n, ast.FunctionDef) and n.name == name]
    return textwrap.dedent("".join(source.splitlines(True)[node.lineno - 1 : node.end_lineno]))


def test_a_class_remade_with_exec_is_refused_not_graded_as_an_earlier_cells_class_of_its_name(notebook):
    ns = notebook(BOOK)
    exec((LEARNERS / "no_scaling.py").read_text(), ns)  # a wrong MultiHeadAttention, from a string: no text to read back
    report = grade(ns["MultiHeadAttention"])
    assert report.exit_code == 2, report.to_text()
    assert report.problem.startswith("cannot grade MultiHeadAttention: its method __init__ has no source Python can read back")


@pytest.mark.slow
def test_a_method_replaced_in_a_later_cell_is_the_one_graded(notebook):
    ns = notebook(BOOK)
    notebook(method("no_scaling", "forward").replace("def forward(", "def unscaled(") + "\n\nMultiHeadAttention.forward = unscaled\n")
    (r,) = grade(ns["MultiHeadAttention"]).results
    assert (r.passed, r.step, r.hint) == (False, "weights", H.NO_SCALE)


@pytest.mark.slow
def test_methods_added_after_the_class_statement_are_graded(notebook):
    init = method("book", "__init__")
    notebook("import torch\nfrom torch import nn\n\n" + ADD_TO_CLASS)
    ns = notebook("class MultiHeadAttention(nn.Module):\n" + textwrap.indent(init, "    "))
    notebook("@add_to_class(MultiHeadAttention)\n" + method("book", "forward"))
    report = grade(ns["MultiHeadAttention"])
    assert report.exit_code == 0, report.to_text()


# ----------------------------------------------------------------------------- written down, in this process


def test_a_deleted_method_is_deleted_again_and_a_static_method_set_later_stays_static(notebook):
    ns = notebook("from torch import nn\n\nclass A(nn.Module):\n    def forward(self, x):\n        return x\n\n    def extra(self):\n        return 1\n")
    notebook("def double(x):\n    return 2 * x\n\ndel A.extra\nA.double = staticmethod(double)\n")
    source = module_source([ns["A"]])
    assert source.endswith("def double(x):\n    return 2 * x\n\n\nA.double = staticmethod(double)\n\n\ndel A.extra\n")
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"].double(3) == 6 and not hasattr(namespace["A"], "extra")


@pytest.mark.parametrize(("cell", "why"), [
    ("A.forward = lambda self, x: x\n", r"A.forward is a lambda, which cannot be written down: write it with def"),
    ("def make():\n    k = 2\n    def forward(self, x):\n        return k * x\n    return forward\n\nA.forward = make()\n",
     r"A.forward reads k from the function or class it was made in, which cannot be carried"),
    ("exec('def forward(self, x):\\n    return x')\nA.forward = forward\n", r"its method forward has no source Python can read back"),
    ("A.size = torch.ones(2)\n", r"A.size \(a Tensor\) was set outside the class statement and cannot be written down"),
])
def test_what_cannot_be_written_down_is_refused_with_the_reason(notebook, cell, why):
    ns = notebook("import torch\nfrom torch import nn\n\nclass A(nn.Module):\n    def forward(self, x):\n        return -x\n")
    notebook(cell)
    with pytest.raises(SourceError, match="^cannot grade A: " + why):
        module_source([ns["A"]])


def test_methods_from_two_class_statements_of_one_name_are_refused(notebook):
    first = notebook("from torch import nn\n\nclass A(nn.Module):\n    def forward(self, x):\n        return x\n")["A"]
    second = notebook("class A(nn.Module):\n    def __init__(self):\n        super().__init__()\n")["A"]
    second.forward = first.forward
    with pytest.raises(SourceError, match=r"^cannot grade A: its methods come from 2 different class statements named A \(1000.py line 3, 1001.py line 1\)"):
        module_source([second])


def test_a_changed_class_from_a_module_is_written_as_it_is_and_a_subclass_of_one_is_refused(notebook, monkeypatch):
    ns = notebook(method("no_scaling", "forward").replace("def forward(", "def unscaled("))
    monkeypatch.setattr(book.MultiHeadAttention, "forward", ns["unscaled"])
    source = module_source([book.MultiHeadAttention])
    assert "from llms_from_scratch" not in source and source.endswith("MultiHeadAttention.forward = unscaled\n")
    ns = notebook("from llms_from_scratch import ch03 as book\n\nclass Mine(book.MultiHeadAttention):\n    pass\n")
    with pytest.raises(SourceError, match=r"^cannot grade Mine: its base llms_from_scratch.ch03.MultiHeadAttention was changed after its "
                                          r"module was imported \(forward\), and the grading process imports the module as its file is"):
        module_source([ns["Mine"]])
    monkeypatch.undo()
    assert module_source([book.MultiHeadAttention]) == "from llms_from_scratch.ch03 import MultiHeadAttention\n"


def test_a_notebook_global_named_like_a_parameter_is_not_carried(notebook):
    """A global ``cls`` (a loop over the classes) beside a classmethod's ``cls``: what the method reads is its
    parameter, so ``cls = ...`` is not written (it named a class not yet defined there: a NameError)."""
    ns = notebook("from torch import nn\n\nclass A(nn.Module):\n    @classmethod\n    def of(cls, n):\n        return cls()\n\n"
                  "    def forward(self, x, scale: float = 2.0):\n        return [x * scale for _ in range(1)][0]\n")
    notebook("for cls in (A,):\n    pass\nscale = 3\nx = 4\n")
    source = module_source([ns["A"]])
    assert "cls = " not in source and "scale = " not in source and "x = " not in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"].of(1).forward(5) == 10


def test_a_class_with_no_method_of_its_own_names_why_an_attribute_cannot_be_written(notebook):
    """No method: no class statement to read back, so a value with no text (a set) is refused with that reason, not
    as one set outside the statement."""
    ns = notebook("from torch import nn\n\nclass Names:\n    ALL = {'W_query', 'W_key'}\n\n"
                  "class A(nn.Module):\n    def forward(self, x):\n        return x if Names.ALL else -x\n")
    with pytest.raises(SourceError, match=r"^cannot grade A: Names.ALL \(a set\) cannot be written down: Names has no method of its own"):
        module_source([ns["A"]])


@pytest.mark.parametrize("body", [
    "    def forward(self, x):\n        global CALLS\n        CALLS += 1\n        return x * DIM\n",  # declared global: read
    "    def forward(self, x):\n        def inner(s):\n            DIM = -1\n            return s * DIM\n        return inner(x) * DIM\n",
    "    names = [h for h in ('W_query', 'W_key')]\n\n    def forward(self, x):\n        return x * DIM\n",  # h: the comprehension's
])
def test_free_names_follow_pythons_scopes(notebook, body):
    """Globals a method reads are carried, a nested function's or a comprehension's own names are not (a notebook
    global of that name may be one that cannot be written down: here a lambda)."""
    notebook("CALLS = 0\nDIM = 2\nh = lambda t: t\ninner = lambda t: t\n")
    ns = notebook("from torch import nn\n\nclass A(nn.Module):\n" + body)
    namespace: dict = {}
    exec(compile(module_source([ns["A"]]), "classes.py", "exec"), namespace)
    assert namespace["A"]().forward(3) in (6, -6)


def test_a_subclass_whose_base_was_defined_again_since_is_refused_not_graded_on_the_new_one(notebook):
    """A wrong MultiHeadAttention, MHA2 built on it, then MultiHeadAttention fixed in a later cell: MHA2 still runs the
    wrong one, so writing its statement over today's name would grade another class (it passed)."""
    notebook((LEARNERS / "no_scaling.py").read_text().split("\n\ninputs = ")[0])
    ns = notebook("class MHA2(MultiHeadAttention):\n    def forward(self, x):\n        return super().forward(x)\n")
    notebook(BOOK)
    with pytest.raises(SourceError, match=r"^cannot grade MHA2: MHA2's base MultiHeadAttention is not the class that name means now"):
        module_source([ns["MHA2"]])


def test_c_functions_imported_by_name_are_imported_again(notebook):
    """``from torch import softmax``, ``from math import sqrt``: C functions, neither classes nor Python functions, are
    written as the same imports (they were left behind: a NameError in the grading process)."""
    notebook("import torch\nfrom torch import nn, softmax\nfrom math import sqrt as root\n")
    ns = notebook("class A(nn.Module):\n    def forward(self, x):\n        return softmax(x, dim=-1) * root(4.0)\n")
    source = module_source([ns["A"]])
    assert "from torch import softmax" in source and "from math import sqrt as root" in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert float(namespace["A"]().forward(__import__("torch").zeros(2)).sum()) == 2.0


def test_a_config_dict_or_list_in_the_notebook_is_carried(notebook):
    """The book's chapter 4 keeps its sizes in a dict (GPT_CONFIG_124M): a class reading such a dict or list global is
    written with it (it was left behind: a NameError in the grading process); one holding an object still is not."""
    notebook("from torch import nn\nCFG = {'scale': 2, 'axes': [1, (2, 3)], 'inf': float('-inf')}\nSIZES = [4, 8]\n")
    ns = notebook("class A(nn.Module):\n    def forward(self, x):\n        return x * CFG['scale'] + SIZES[0]\n")
    source = module_source([ns["A"]])
    assert "CFG = {'scale': 2, 'axes': [1, (2, 3)], 'inf': float('-inf')}" in source and "SIZES = [4, 8]" in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"]().forward(3) == 10


def test_a_cached_helper_and_a_partial_are_carried(notebook):
    """A notebook function under ``@functools.lru_cache`` (or any decorator that keeps ``__wrapped__``) is written with
    its decorator, and a ``functools.partial`` of a notebook or library function with plain arguments as that call
    (both were left behind: a NameError in the grading process); a wrapper made by a call is still left behind."""
    notebook("import functools\nimport math\nfrom torch import nn\n")
    notebook("@functools.lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n"
             "def power(x, p):\n    return x ** p\n\nsquare = functools.partial(power, p=2)\nroot = functools.partial(math.pow, 4.0)\n"
             "cached = functools.lru_cache(power)\n")
    ns = notebook("class A(nn.Module):\n    def forward(self, x):\n        return fib(x) + square(x) + root(0.5)\n\n"
                  "class B(nn.Module):\n    def forward(self, x):\n        return cached(x, 2)\n")
    source = module_source([ns["A"]])
    assert "@functools.lru_cache(maxsize=None)\ndef fib(n):" in source and "square = functools.partial(power, p=2)" in source, source
    assert "root = functools.partial(pow, 4.0)" in source and "from math import pow" in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"]().forward(10) == 55 + 100 + 2.0
    assert namespace["fib"].cache_info().currsize > 0  # the cache decorator is there again
    assert carried([ns["B"]])[1] == {"cached": "_lru_cache_wrapper"}


def test_what_a_statement_computed_is_written_as_it_holds_it_after_a_global_changed(notebook):
    """``def forward(self, x, σ=S)`` and ``scale = S`` computed S once, when their statement ran: with S set again
    since, writing the text would grade another class (it read today's S), so each is written as the value it holds;
    one whose text still gives its value is written as it was, with the global it reads."""
    notebook("from torch import nn\nS = 2.0\nK = 3\nKEEP = 7\n")
    ns = notebook("class A(nn.Module):\n    scale = S\n    half = scale / 2 + KEEP\n    kept = KEEP\n\n"
                  "    def forward(self, x, σ=S, k=-K, *, t=(S, KEEP), u=KEEP):\n        return x * σ * self.scale + self.half + k + sum(t) + u\n\n"
                  "def helper(x, k=K):\n    return x * k\n\n"
                  "class B(nn.Module):\n    def forward(self, x):\n        return helper(x)\n")
    notebook("S = 5.0\nK = 10\n")
    source = module_source([ns["A"], ns["B"]])
    assert "scale = 2.0" in source and "σ=2.0, k=-3, *, t=(2.0, 7), u=KEEP" in source and "def helper(x, k=3):" in source, source
    assert "kept = KEEP" in source and "KEEP = 7" in source and "S = " not in source and "K = " not in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    for name in ("A", "B"):
        assert namespace[name]().forward(3) == ns[name]().forward(3)  # A: 3 * 2 * 2 + 8 - 3 + 9 + 7
    assert vars(namespace["A"])["half"] == vars(ns["A"])["half"] == 8.0


def test_a_class_attribute_computed_in_the_statement_and_set_again_since_is_written_as_it_is(notebook):
    notebook("from torch import nn\nS = 2.0\n")
    ns = notebook("class A(nn.Module):\n    scale = S * 2\n\n    def forward(self, x):\n        return x * self.scale\n")
    notebook("A.scale = 0.5\n")
    source = module_source([ns["A"]])
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"]().forward(4) == ns["A"]().forward(4) == 2.0, source


def test_a_default_holding_an_object_whose_name_means_another_now_is_refused(notebook):
    """``act=ACT`` holds the class ACT meant when the ``def`` ran; with no text of its own it cannot be written, so the
    class is refused with the reason (it was graded with today's ACT)."""
    notebook("from torch import nn\nACT = nn.GELU\n")
    ns = notebook("class A(nn.Module):\n    def forward(self, x, act=ACT):\n        return act()(x)\n")
    assert "act=ACT" in module_source([ns["A"]])  # ACT still means it: written with its text
    notebook("ACT = nn.ReLU\n")
    with pytest.raises(SourceError, match=r"A.forward's default for act holds the type that ACT meant when it was defined, and "
                                          r"ACT means another now \(set again since\): run the cell that defines it again"):
        module_source([ns["A"]])
