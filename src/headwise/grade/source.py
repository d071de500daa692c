"""Class objects as one Python file that a grading process can import.

A class that lives in an importable module is imported from it. A class written in a notebook
cell (or in the script being run, ``__main__``) is read back from the cell's text, which
IPython keeps in ``linecache`` under the file name its methods' code carries; with it come
what the class uses from the notebook: the modules it names (``torch``, ``nn``, ``math``), the
notebook's other classes and functions it calls (read back the same way), and plain constants.

Example:
    >>> from headwise.teaching import CausalAttention
    >>> print(module_source([CausalAttention]))
    from headwise.teaching import CausalAttention
    <BLANKLINE>
"""

from __future__ import annotations

import ast
import builtins
import inspect
import linecache
import math
import re
import sys
import textwrap
from types import FunctionType, ModuleType

_CONSTANTS = (bool, int, float, complex, str, bytes, type(None))


class SourceError(Exception):
    """The source of a class (or of something it uses) cannot be read back."""


def module_source(classes: list[type]) -> str:
    """One module defining (or importing) every class in ``classes`` under its own name.

    Raises:
        SourceError: a class's source cannot be found; two classes share a name.
    """
    return carried(classes)[0]


def carried(classes: list[type]) -> tuple[str, dict[str, str]]:
    """``module_source``'s text, and the notebook's names the classes read that it could not write down
    (a tensor, an instance...), each with its type's name."""
    names = [c.__name__ for c in classes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SourceError(f"two classes are named {', '.join(twice)}: grade them one at a time, or rename one")
    builder = _Builder()
    for cls in classes:
        builder.add(cls.__name__, cls)
    return builder.text(), builder.left_behind


def explain_name_error(error: str | None, left_behind: dict[str, str]) -> str | None:
    """``error`` with a reason added when it is a NameError for a name left behind in the notebook."""
    match = re.search(r"NameError: name '(\w+)' is not defined", error or "")
    if match is None or match.group(1) not in left_behind:
        return error
    name = match.group(1)
    return (f"{error} ({name} is a {left_behind[name]} in the notebook, which cannot be carried into the grading process: "
            "create it inside the class, e.g. in __init__)")


class _Builder:
    def __init__(self) -> None:
        self.imports: list[str] = []
        self.constants: list[str] = []
        self.definitions: list[str] = []
        self.seen: set[int] = set()
        self.left_behind: dict[str, str] = {}

    def text(self) -> str:
        parts = ["\n".join(dict.fromkeys(self.imports)), "\n".join(self.constants), *self.definitions]
        return "\n\n\n".join(p for p in parts if p) + "\n"

    def add(self, name: str, obj: object) -> None:
        """Make ``name`` mean ``obj`` in the module (noted in ``left_behind`` when it cannot be written down)."""
        if isinstance(obj, ModuleType):
            self.imports.append(f"import {obj.__name__}" if name == obj.__name__ else f"import {obj.__name__} as {name}")
        elif isinstance(obj, (type, FunctionType)):
            where = _importable(obj)
            if where is not None:
                self.imports.append(f"from {where} import {obj.__qualname__}" + ("" if name == obj.__qualname__ else f" as {name}"))
            elif id(obj) not in self.seen:
                self.seen.add(id(obj))
                self._define(obj)
            if where is None and name != obj.__name__:
                self.definitions.append(f"{name} = {obj.__name__}")
        elif _literal(obj) is not None:
            self.constants.append(f"{name} = {_literal(obj)}")
        else:
            self.left_behind[name] = type(obj).__name__

    def _define(self, obj: type | FunctionType) -> None:
        source = definition(obj)
        scope = _globals(obj)
        for base in getattr(obj, "__bases__", ()):  # class A(A): the earlier A, which the name no longer reaches
            if base.__name__ == obj.__name__:
                self.add(base.__name__, base)
        for used in _free_names(source):
            if used in scope and used != obj.__name__ and not hasattr(builtins, used):
                self.add(used, scope[used])
        self.definitions.append(source)


def definition(obj: type | FunctionType) -> str:
    """The source text of a class or function (dedented), from its file or notebook cell.

    Raises:
        SourceError: it was made where no text is kept (``exec``, ``type()``, a console).
    """
    kind = "class" if isinstance(obj, type) else "function"
    found = _from_code(obj)
    if found is None:
        try:
            found = textwrap.dedent(inspect.getsource(obj))
        except (OSError, TypeError):
            found = _from_cells(obj) if isinstance(obj, type) else None
    if found is None:
        raise SourceError(
            f"cannot find the source of the {kind} {obj.__qualname__}: it was not written in a file or a notebook cell that "
            "Python can read back (made with exec() or type(), or typed into a console?); put it in a .py file and grade that file"
        )
    return found


def _from_code(obj: type | FunctionType) -> str | None:
    """Find the definition through the file name and line its (methods') code carries, in linecache."""
    codes = [obj.__code__] if isinstance(obj, FunctionType) else _method_codes(obj)
    for code in codes:
        lines = linecache.getlines(code.co_filename)
        if not lines:
            continue
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:  # code compiled from a text that is not Python as a whole (a README's block)
            continue
        node = _node_at(tree, obj.__name__, code.co_firstlineno, isinstance(obj, type))
        if node is not None:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            return textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
    return None


def _method_codes(cls: type) -> list:
    codes = []
    for value in vars(cls).values():
        fn = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value.fget if isinstance(value, property) else value
        code = getattr(fn, "__code__", None)
        if code is not None and getattr(fn, "__qualname__", "").startswith(cls.__qualname__ + "."):
            codes.append(code)
    return codes


def _node_at(tree: ast.AST, name: str, line: int, is_class: bool) -> ast.ClassDef | ast.FunctionDef | None:
    """The innermost definition named ``name`` whose lines hold ``line`` (a method's first line, or its own)."""
    kinds = (ast.ClassDef,) if is_class else (ast.FunctionDef, ast.AsyncFunctionDef)
    best = None
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= line <= node.end_lineno and (best is None or node.lineno >= best.lineno):
                best = node
    return best


def _from_cells(cls: type) -> str | None:
    """A class with no method of its own: the last notebook cell in linecache that defines a class of its name."""
    for filename in reversed(list(linecache.cache)):
        if "ipykernel_" not in filename and not filename.startswith("<ipython-input"):
            continue
        lines = linecache.getlines(filename)
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:
            continue
        nodes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__]
        if nodes:
            first = min([nodes[-1].lineno, *(d.lineno for d in nodes[-1].decorator_list)])
            return "".join(lines[first - 1 : nodes[-1].end_lineno])
    return None


def _importable(obj: type | FunctionType) -> str | None:
    """The module ``obj`` can be imported from by its name, or None (``__main__``, nested, not there)."""
    module = getattr(obj, "__module__", None)
    if module in (None, "__main__", "builtins") or "." in obj.__qualname__ or "<" in obj.__qualname__:
        return None
    return module if getattr(sys.modules.get(module), obj.__qualname__, None) is obj else None


def _globals(obj: type | FunctionType) -> dict:
    """The namespace the definition's names are looked up in."""
    if isinstance(obj, FunctionType):
        return obj.__globals__
    for value in vars(obj).values():
        if isinstance(value, FunctionType):
            return value.__globals__
    return vars(sys.modules[obj.__module__]) if obj.__module__ in sys.modules else {}


def _free_names(source: str) -> list[str]:
    """Every name the definition reads, in order of first use."""
    names = [n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return list(dict.fromkeys(names))


def _literal(value: object) -> str | None:
    """Python text for a plain constant (a number, a string, None, a tuple of them), else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"  # float('inf'), float('-inf'), float('nan')
    if isinstance(value, tuple):
        items = [_literal(v) for v in value]
        return None if None in items else "(" + "".join(f"{i}, " for i in items).rstrip(" ") + ")"
    return repr(value) if isinstance(value, _CONSTANTS) else None
