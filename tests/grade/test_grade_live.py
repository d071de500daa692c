"""A class is graded as the learner has it now: its methods' own code, wherever each was written.

A class remade with ``exec()`` (no text to read back), a method replaced in a later cell, a
method added after the class statement (d2l's ``add_to_class``), a method deleted: each is
graded as the object is, or refused with the reason, never graded as an older text of its name.
"""

from __future__ import annotations

import ast
import math
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


def test_a_class_made_in_a_function_is_graded_unless_its_methods_read_the_functions_names(notebook):
    """The class statement is written down alone: ``super()`` works there again, a name of the function around it
    would be missing (graded as a NameError before: a right class failed)."""
    head = ("class CausalAttention(nn.Module):\n"
            "    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):\n"
            "        super().__init__()\n"
            "        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)\n"
            "        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)\n"
            "        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)\n"
            "        self.dropout = nn.Dropout(dropout)\n\n"
            "    def forward(self, x):\n"
            "        T = x.shape[1]\n"
            "        q, k, v = self.W_query(x), self.W_key(x), self.W_value(x)\n"
            "        s = (q @ k.transpose(1, 2)).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -torch.inf)\n"
            "        return self.dropout(torch.softmax(s / k.shape[-1] ** {power}, dim=-1)) @ v\n\n"
            "return CausalAttention\n")
    ns = notebook("import torch\nfrom torch import nn\n\nPOWER = 0.5\n\n"
                  "def build():\n" + textwrap.indent(head.format(power="POWER"), "    ") + "\n\n"
                  "def build_with(power):\n" + textwrap.indent(head.format(power="power"), "    "))
    report = grade(ns["build"]())
    assert report.exit_code == 0 and [r.passed for r in report.results] == [True], report.to_text()
    report = grade(ns["build_with"](0.5))
    assert report.exit_code == 2 and not report.results, report.to_text()
    assert report.problem == ("cannot grade CausalAttention: CausalAttention.forward reads power from the function or class it was made "
                              "in, which cannot be carried into the grading process: define the class at the top of the file or notebook")


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
    since, writing the text would grade another class (it read today's S), so each is written as the value it holds."""
    notebook("from torch import nn\nS = 2.0\nK = 3\nKEEP = 7\nCFG = {'d': 4}\n")
    ns = notebook("class A(nn.Module):\n    scale = S\n    half = scale / 2 + KEEP\n    d = CFG['d']\n\n"
                  "    def forward(self, x, σ=S, k=-K, *, t=(S, KEEP), u=(\n            CFG['d'])):\n"
                  "        return x * σ * self.scale + self.half + k + sum(t) + u + self.d\n\n"
                  "def helper(x, k=K):\n    return x * k\n\n"
                  "class B(nn.Module):\n    def forward(self, x):\n        return helper(x) + KEEP\n")
    notebook("S = 5.0\nK = 10\nCFG['d'] = 8\n")
    source = module_source([ns["A"], ns["B"]])
    assert "scale = 2.0" in source and "σ=2.0, k=-3, *, t=(2.0, 7), u=(\n            4)):" in source and "def helper(x, k=3):" in source, source
    assert "S = " not in source and "K = " not in source and "CFG" not in source and "KEEP = 7" in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    for name in ("A", "B"):
        assert namespace[name]().forward(3) == ns[name]().forward(3)  # A: 3 * 2 * 2 + 8 - 3 + 9 + 4 + 4
    assert vars(namespace["A"])["half"] == vars(ns["A"])["half"] == 8.0


@pytest.mark.parametrize("later", [
    "A.scale = 0.5\nA.b = 9\nA.c = 0.25\nA.zero = -0.0\n",  # set since: its text (computed, one of two targets, 0.0) no longer says
    "",  # scale *= 2: a name the body binds twice is set to what the class holds after the statement, not pinned in it
])
def test_a_class_attribute_computed_in_the_statement_is_written_as_the_class_holds_it(notebook, later):
    notebook("import math\nfrom torch import nn\nS = 2.0\n")
    ns = notebook("class A(nn.Module):\n    scale = S * 2\n    scale *= 2\n    a = b = S\n    c = math.sqrt(S)\n    zero = 0.0\n\n"
                  "    class Inner:\n        s = S\n\n        def get(self, t=S):\n            return self.s + t\n\n"
                  "    def forward(self, x, s=scale):\n        return x * self.scale + self.a + self.b + self.c + s + self.Inner().get()\n")
    notebook(later + "S = 16.0\n")
    source = module_source([ns["A"]])
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"]().forward(4) == ns["A"]().forward(4), source
    assert {k: vars(namespace["A"])[k] for k in "abc"} | {"scale": namespace["A"].scale} == {k: vars(ns["A"])[k] for k in ("a", "b", "c", "scale")}
    assert math.copysign(1.0, namespace["A"].zero) == math.copysign(1.0, ns["A"].zero)


def test_a_later_method_reading_a_class_attribute_set_before_it_and_a_dataclass_field_set_since(notebook):
    """Changes after the statement are written in the class's order, not the order they were made: a default read
    from the class is written as its value, whatever is written before it; a field's default (the decorator's) and the
    class attribute set since are two values, both kept."""
    notebook("import dataclasses\nD = 4\n")
    ns = notebook("class A:\n    def f(self, x):\n        return x\n\n    k = 1.0\n\n"
                  "@dataclasses.dataclass\nclass Cfg:\n    d: int = D\n    e: int = dataclasses.field(default=D, repr=False)\n\n"
                  "    def twice(self):\n        return 2 * self.d + self.e\n")
    notebook("A.k = 2.0\n")
    notebook("def g(self, x, s=A.k):\n    return s\n\nA.f = g\nCfg.d = 9\nD = 5\n")
    source = module_source([ns["A"], ns["Cfg"]])
    assert "dataclasses.field(default=4, repr=False)" in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"]().f(0) == ns["A"]().f(0) == 2.0, source
    assert (namespace["Cfg"].d, namespace["Cfg"]().twice(), repr(namespace["Cfg"]())) == (9, 12, "Cfg(d=4)")


@pytest.mark.parametrize(("cell", "later", "why"), [
    ("ACT = nn.GELU\n", "ACT = nn.ReLU\n", r"A.forward's default for act holds a type that its text ACT no longer gives"),
    ("@dataclasses.dataclass\nclass Cfg:\n    d: int = 4\n", "@dataclasses.dataclass\nclass Cfg:\n    d: int = 8\n",
     r"A.forward's default for act holds a Cfg made when it was defined, and Cfg is another class now"),
    ("M = Mode.A\n", "M = Mode.B\n", r"A.forward's default for act holds a Mode that its text M no longer gives"),
])
def test_a_default_holding_an_object_its_text_no_longer_gives_is_refused(notebook, cell, later, why):
    """``act=ACT`` holds the class ACT meant when the ``def`` ran, ``cfg=Cfg()`` an instance of the Cfg of then, an
    IntEnum member has no text of its own: none can be written, so the class is refused with the reason."""
    notebook("import dataclasses\nimport enum\nfrom torch import nn\n\nclass Mode(enum.IntEnum):\n    A = 1\n    B = 2\n\n" + cell)
    default = "Cfg()" if "Cfg" in cell else cell.split(" = ")[0]
    ns = notebook(f"class A(nn.Module):\n    def forward(self, x, act={default}):\n        return act\n")
    assert f"act={default}" in module_source([ns["A"]])  # the text still gives it: written as it is
    notebook(later)
    with pytest.raises(SourceError, match=f"^cannot grade A: {why}"):
        module_source([ns["A"]])


def test_names_a_class_body_binds_and_bound_methods_are_read_where_python_reads_them(notebook):
    """A default reads the class body's names before the globals (``ACT`` in the body, another ``ACT`` outside), a
    classmethod read from its class is a new bound method each time (the same one), and ``alias = forward`` names the
    statement's own function: none is refused."""
    notebook("import numpy as np\nfrom torch import nn\nACT = nn.ReLU\nSCALE = np.sqrt(64.0)\nS = 4\n\n"
             "class Maker:\n    @classmethod\n    def create(cls):\n        return 7\n")
    ns = notebook("class A(nn.Module):\n    ACT = nn.GELU\n    mk = Maker.create\n    r = S % 3\n\n"
                  "    def forward(self, x, act=ACT, m=Maker.create, q=S // 2):\n        return act, m(), x * SCALE, q\n\n    alias = forward\n")
    notebook("def forward(self, x):\n    return x\n\nA.forward = forward\nS = 1j\n")
    source = module_source([ns["A"]])
    assert "SCALE = 8.0" in source, source
    namespace: dict = {}
    exec(compile(source, "classes.py", "exec"), namespace)
    assert namespace["A"]().alias(2) == (ns["A"]().alias(2)[0], 7, 16.0, 2) and namespace["A"].r == 1


def test_a_name_that_would_mean_the_graded_class_and_an_older_one_is_refused(notebook):
    """Sub (no method of its own) was built on Base, then Base's cell ran again: grading both would write the older
    Base after the graded one under its name, and grade the older one. Graded alone, each is written as it is."""
    notebook("class Base:\n    def f(self):\n        return 'old'\n\nclass Sub(Base):\n    k = 1\n")
    ns = notebook("class Base:\n    def f(self):\n        return 'new'\n")
    with pytest.raises(SourceError, match=r"^cannot grade Sub: Base would mean two classes: the one graded, and an older one this class"):
        module_source([ns["Base"], ns["Sub"]])
    for name, said in (("Base", "new"), ("Sub", "old")):
        namespace: dict = {}
        exec(compile(module_source([ns[name]]), "classes.py", "exec"), namespace)
        assert namespace[name]().f() == said
