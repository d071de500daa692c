"""Class objects as Python that a grading process can run, in pieces that keep where they were written.

A class that lives in an importable module, unchanged since the module made it, is imported
from it. Any other class (written in a notebook cell or in the script being run) is written
as it is now (``live.write_class``: its statement, then every method set on it since), with
what it uses from the notebook: the modules it names (``torch``, ``nn``, ``math``), the
notebook's other classes and functions it calls (written the same way; a function with its decorators, so an
``@functools.lru_cache`` helper is cached again), a ``functools.partial`` of one with plain arguments, and plain constants.
A class that cannot be written down raises ``SourceError`` naming it and why; so does one
whose importable base was changed after its module was imported (the grading process would
import the module as its file is).

Each piece keeps the file (or notebook cell) and the line it starts at, so the grading process
can run it at the same line numbers and an error names the learner's own cell and line.

Example:
    >>> from headwise.teaching import CausalAttention
    >>> print(module_source([CausalAttention]))
    from headwise.teaching import CausalAttention
    <BLANKLINE>
"""

from __future__ import annotations

import builtins
import functools
import inspect
import re
import sys
from pathlib import Path
from types import FunctionType, ModuleType

from .live import Piece, SourceError, decorated, function_piece, literal, write_class

__all__ = ["Piece", "SourceError", "carried", "definition", "explain_name_error", "module_source", "origin"]

LIBRARIES = ("builtins", "torch")  # their classes are taken as their files say: changes to them are not looked for


def module_source(classes: list[type]) -> str:
    """One module defining (or importing) every class in ``classes`` under its own name.

    Raises:
        SourceError: a class cannot be written down; two classes share a name.
    """
    return "\n\n".join(p.text for p in carried(classes)[0])


def carried(classes: list[type]) -> tuple[list[Piece], dict[str, str]]:
    """``classes`` as pieces of Python in the order they run, and the notebook's names they read that
    could not be written down (a tensor, an instance...), each with its type's name.

    Raises:
        SourceError: ``cannot grade NAME: why``.
    """
    names = [c.__name__ for c in classes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SourceError(f"two classes are named {', '.join(twice)}: grade them one at a time, or rename one")
    builder = _Builder()
    for cls in classes:
        try:
            builder.add(cls.__name__, cls)
        except SourceError as e:
            raise SourceError(f"cannot grade {cls.__name__}: {e}") from None
    return builder.pieces(), builder.left_behind


def definition(obj: type | FunctionType) -> str:
    """The text of a class as it is now, or of a function's ``def``, from the code it holds.

    Raises:
        SourceError: some part of it was made where no text is kept (``exec``, ``type()``, a console).
    """
    pieces = write_class(obj).pieces if isinstance(obj, type) else [function_piece(obj)]
    return "\n".join(p.text for p in pieces)


def origin(filename: str | None) -> str:
    """How an error names the place a piece was written: ``Cell In[5]`` in IPython, else the file's name."""
    if filename is None:
        return "written by the grader"
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    name = getattr(getattr(shell, "compile", None), "format_code_name", lambda _: None)(filename)
    return " ".join(name) if name else Path(filename).name


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
        self.definitions: list[Piece] = []
        self.seen: set[int] = set()
        self.defined: dict[str, object] = {}  # each class's and function's name -> the one written under it
        self.left_behind: dict[str, str] = {}

    def pieces(self) -> list[Piece]:
        head = "\n".join([*dict.fromkeys(self.imports), *self.constants])
        return ([Piece(head + "\n", None, 1)] if head else []) + self.definitions

    def add(self, name: str, obj: object, needed: bool = False) -> None:
        """Make ``name`` mean ``obj`` in the module (noted in ``left_behind`` when it cannot be written down); ``needed``:
        by a definition written after it (a class built on it, a function calling it)."""
        if isinstance(obj, ModuleType):
            self.imports.append(f"import {obj.__name__}" if name == obj.__name__ else f"import {obj.__name__} as {name}")
        elif isinstance(obj, (type, FunctionType)):
            if isinstance(obj, type):
                _unchanged_bases(obj)
            where = _importable(obj)
            if where is not None:
                self.imports.append(f"from {where} import {obj.__qualname__}" + ("" if name == obj.__qualname__ else f" as {name}"))
            elif id(obj) not in self.seen:
                if needed and self.defined.get(obj.__name__, obj) is not obj:  # it would take the name from the one written
                    raise SourceError(f"{obj.__name__} would mean two {'classes' if isinstance(obj, type) else 'functions'}: the one "
                                      f"graded, and an older one this class uses or is built on (its cell not run again after "
                                      f"{obj.__name__}'s): run its cell again")
                self.seen.add(id(obj))
                self._define(write_class(obj).pieces if isinstance(obj, type) else [function_piece(obj)])
                self.defined[obj.__name__] = obj
            if where is None and name != obj.__name__:
                self.definitions.append(Piece(f"{name} = {obj.__name__}\n", None, 1))
        elif (where := _imported_as(obj)) is not None:  # a C function imported by name: from torch import softmax
            self.imports.append(f"from {where} import {obj.__name__}" + ("" if name == obj.__name__ else f" as {name}"))
        elif (fn := _decorated(obj)) is not None:  # @functools.lru_cache above a def: the def written with it
            if id(obj) not in self.seen:
                self.seen.add(id(obj))
                self._define([function_piece(fn)])
            if name != fn.__name__:
                self.definitions.append(Piece(f"{name} = {fn.__name__}\n", None, 1))
        elif isinstance(obj, functools.partial) and (text := self._partial(obj)) is not None:
            self.definitions.append(Piece(f"{name} = {text}\n", None, 1))
        elif literal(obj) is not None:
            self.constants.append(f"{name} = {literal(obj)}")
        else:
            self.left_behind[name] = type(obj).__name__

    def _partial(self, obj: functools.partial) -> str | None:
        """``functools.partial(f, ...)`` as text, with ``f`` made to mean what it means (None: its function or an
        argument cannot be written down)."""
        args = [literal(a) for a in obj.args] + [literal(v) for v in obj.keywords.values()]
        name = getattr(obj.func, "__name__", None)
        if any(a is None for a in args) or not isinstance(name, str) or not name.isidentifier():
            return None
        self.add(name, obj.func)
        if name in self.left_behind:
            return None
        self.add("functools", functools)
        given = [*args[: len(obj.args)], *(f"{k}={v}" for k, v in zip(obj.keywords, args[len(obj.args) :], strict=True))]
        return f"functools.partial({', '.join([name, *given])})"

    def _define(self, pieces: list[Piece]) -> None:
        """Each piece after what it uses."""
        for piece in pieces:
            for used, value in piece.uses.items():
                if not (hasattr(builtins, used) and getattr(builtins, used) is value):
                    self.add(used, value, needed=True)
            self.definitions.append(piece)


def _imported_as(obj: object) -> str | None:
    """The module a callable that is neither a class nor a Python function (``torch.softmax``, ``math.sqrt``, a numpy
    ufunc) can be imported from by its ``__name__``, or None."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__name__", None)
    if not callable(obj) or not isinstance(module, str) or not isinstance(name, str) or module in ("__main__", "builtins"):
        return None
    return module if getattr(sys.modules.get(module), name, None) is obj else None


def _decorated(obj: object) -> FunctionType | None:
    """The function whose ``def`` made ``obj`` through its decorators (``@functools.lru_cache``, a decorator using
    ``functools.wraps``), or None: no ``__wrapped__`` leads to a Python function, or its ``def`` has no decorator (a
    wrapper made by a call, ``f = lru_cache(g)``, which writing the ``def`` would not make)."""
    try:
        fn = inspect.unwrap(obj) if hasattr(obj, "__wrapped__") else None
    except ValueError:  # a cycle of __wrapped__
        return None
    if not isinstance(fn, FunctionType) or fn is obj or "<" in fn.__qualname__ or "." in fn.__qualname__:
        return None
    return fn if decorated(fn) else None


def _importable(obj: type | FunctionType) -> str | None:
    """The module ``obj`` can be imported from by its name, unchanged, or None (``__main__``, nested, changed since)."""
    module = getattr(obj, "__module__", None)
    if module in (None, "__main__", "builtins") or "." in obj.__qualname__ or "<" in obj.__qualname__:
        return None
    if getattr(sys.modules.get(module), obj.__qualname__, None) is not obj:
        return None
    return None if isinstance(obj, type) and _changes(obj) else module


def _unchanged_bases(cls: type) -> None:
    """Refuse a class whose importable base was changed since its module made it: importing gives the module's."""
    for base in cls.__mro__[1:]:
        changes = _changes(base) if _importable_name(base) else []
        if changes:
            raise SourceError(f"its base {base.__module__}.{base.__qualname__} was changed after its module was imported "
                              f"({', '.join(changes)}), and the grading process imports the module as its file is: "
                              "make the change in the file, or in a class of your own")


def _importable_name(cls: type) -> bool:
    return cls.__module__ not in (None, "__main__") and getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


def _changes(cls: type) -> list[str]:
    """What was set on or deleted from an importable class after its statement ran (nothing for libraries' classes)."""
    if cls.__module__.split(".")[0] in LIBRARIES:
        return []
    try:
        written = write_class(cls)
    except SourceError:  # parts of it have no text: its module is the best copy there is
        return []
    return written.changes if written.from_statement else []
