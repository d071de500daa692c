"""Classes written in notebook cells, read back and graded in a separate process.

The ``notebook`` fixture (conftest.py) runs cells as a kernel would.
"""

from __future__ import annotations

import pytest
from torch import nn

from headwise.grade import grade
from headwise.grade.source import SourceError, definition, module_source

HEAD = '''
class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        b, num_tokens, d_in = x.shape
        scores = self.W_query(x) @ self.W_key(x).transpose(1, 2)
        scores = scores.masked_fill(self.mask.bool()[:num_tokens, :num_tokens], NEG)
        return self.dropout(torch.softmax(scale(scores, self.W_key.out_features), dim=-1)) @ self.W_value(x)
'''

WRAPPER = '''
class MyWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList([CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)])

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)
'''


def test_a_class_takes_the_modules_functions_classes_and_constants_of_the_notebook_it_uses(notebook):
    notebook("import math\nimport torch\nfrom torch import nn\n\nNEG = -math.inf\nbatch = torch.ones(2, 6, 3)\n")
    notebook("def scale(scores, d):\n    return scores / math.sqrt(d)\n" + HEAD)
    ns = notebook(WRAPPER + "\nwrapper = MyWrapper(3, 2, 6, 0.0, 2)\nprint(wrapper(batch).shape)\n")
    source = module_source([ns["MyWrapper"]])
    lines = source.splitlines()
    assert {"import torch", "import torch.nn as nn", "import math", "NEG = float('-inf')"} <= set(lines)
    assert "batch" not in source and "print(" not in source  # the cells' other code stays behind
    assert source.index("def scale(") < source.index("class CausalAttention(") < source.index("class MyWrapper(")
    compile(source, "notebook.py", "exec")


@pytest.mark.slow
def test_notebook_classes_are_graded_in_a_separate_process(notebook):
    notebook("import math\nimport torch\nfrom torch import nn\n\nNEG = float('-inf')\n")
    ns = notebook("def scale(scores, d):\n    return scores / d ** 0.5\n" + HEAD + WRAPPER)
    report = grade([ns["CausalAttention"], ns["MyWrapper"]])
    assert report.file == "<classes CausalAttention, MyWrapper>"
    assert [(r.name, r.kind, r.passed) for r in report.results] == [
        ("CausalAttention", "CausalAttention", True), ("MyWrapper", "MultiHeadAttentionWrapper", True)
    ], report.to_text()


def test_the_latest_definition_of_a_redefined_class_is_the_one_read_back(notebook):
    notebook("import torch\nfrom torch import nn\n\nclass CausalAttention(nn.Module):\n    def forward(self, x):\n        return 'first'\n")
    ns = notebook("class CausalAttention(nn.Module):\n    def forward(self, x):\n        return 'second'\n")
    assert "second" in definition(ns["CausalAttention"]) and "first" not in definition(ns["CausalAttention"])


def test_a_class_with_no_method_of_its_own_is_written_from_its_bases(notebook):
    ns = notebook("from torch import nn\n\nclass Empty(nn.Module):\n    pass\n")
    assert definition(ns["Empty"]) == "class Empty(Module):\n    pass\n"
    assert module_source([ns["Empty"]]) == "from torch.nn.modules.module import Module\n\n\nclass Empty(Module):\n    pass\n"


def test_a_class_with_no_method_made_with_exec_is_not_read_from_an_earlier_cell_of_its_name(notebook):
    ns = notebook("import torch\nfrom torch import nn\n" + HEAD)
    exec("class CausalAttention(nn.Module):\n    scale = 2\n", ns)
    assert definition(ns["CausalAttention"]) == "class CausalAttention(Module):\n    pass\n\nCausalAttention.scale = 2\n"


def test_a_class_whose_source_is_nowhere_says_so():
    namespace: dict = {"__name__": "__main__"}
    exec("from torch import nn\nclass MultiHeadAttention(nn.Module):\n    def forward(self, x):\n        return x\n", namespace)
    with pytest.raises(SourceError, match=r"its method forward has no source Python can read back \(made with exec\(\)"):
        definition(namespace["MultiHeadAttention"])
    report = grade(namespace["MultiHeadAttention"])
    assert report.exit_code == 2 and report.problem.startswith("cannot grade MultiHeadAttention: its method forward has no source")
    assert "put it in a .py file or a notebook cell and grade that" in report.to_text()


def test_two_classes_of_one_name_and_bad_lists_are_refused(notebook):
    first = notebook("from torch import nn\n\nclass A(nn.Module):\n    def forward(self, x):\n        return x\n")["A"]
    second = notebook("class A(nn.Module):\n    def forward(self, x):\n        return -x\n")["A"]
    assert grade([first, second]).problem == "two classes are named A: grade them one at a time, or rename one"
    with pytest.raises(TypeError, match=r"a list to grade must hold classes, got \['type', 'str'\]"):
        grade([first, "A"])
    with pytest.raises(TypeError, match=r"classes names classes in a file or module; with class objects, pass the classes themselves"):
        grade(first, classes=["A"])
    for bad, named in [(int, "int"), (dict, "dict"), (nn.Module, "Module"), ([first, int], "int")]:
        with pytest.raises(TypeError, match=rf"grade takes your attention classes, subclasses of torch.nn.Module .*, got {named}$"):
            grade(bad)
    with pytest.raises(TypeError, match=r"got list \(an empty one: nothing to grade\)"):
        grade([])


def test_a_class_that_extends_its_own_earlier_definition_takes_that_one_along(notebook):
    notebook("from torch import nn\n\nclass A(nn.Module):\n    def forward(self, x):\n        return x\n")
    ns = notebook("class A(A):\n    def forward(self, x):\n        return -super().forward(x)\n")
    source = module_source([ns["A"]])
    assert source.index("return x") < source.index("class A(A):")  # the earlier A first, then the one that extends it
    namespace: dict = {}
    exec(compile(source, "notebook.py", "exec"), namespace)
    assert namespace["A"].__bases__[0].__name__ == "A" and namespace["A"]()(1) == -1


@pytest.mark.slow
def test_a_notebook_tensor_the_class_reads_is_named_as_left_behind(notebook):
    ns = notebook("import torch\nfrom torch import nn\n\nFUTURE = torch.ones(6, 6).triu(1).bool()\n\n"
                  "class CausalAttention(nn.Module):\n"
                  "    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):\n"
                  "        super().__init__()\n        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)\n\n"
                  "    def forward(self, x):\n        return self.W_query(x).masked_fill(FUTURE[: x.shape[1], :1], 0.0)\n")
    (r,) = grade(ns["CausalAttention"]).results
    assert (r.step, r.line) == ("error", "1000.py, line 12")  # the cell's own line (IPython would name it Cell In[n])
    assert r.error.endswith("NameError: name 'FUTURE' is not defined (FUTURE is a Tensor in the notebook, which cannot be carried "
                            "into the grading process: create it inside the class, e.g. in __init__)")
