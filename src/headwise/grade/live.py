"""A class as Python text, the way the learner has it now, found through the code it holds.

Every method is located by the file and line its code object carries (``co_filename``,
``co_firstlineno``), never by the class's name: the class statement is the one whose body
defined the methods the class still holds, and each method set on the class after that
statement ran (``C.forward = f`` in a later cell, d2l's ``add_to_class``) is written after it
as the function it now is; a method deleted since is deleted again. A class with no method
of its own is written from its bases. A dataclass is written as one: what its decorator made
(``__init__``, ``__repr__``, ``__dataclass_fields__``...) is left for the decorator to make
again, and one with no method of its own (a config) is written from its fields. What a
statement computed once, when it ran (a default ``s=SCALE``, a class attribute ``scale = SCALE``
or ``d = CFG["d"]``), is written as the plain value it holds, whatever its text would give
today; an object held so is checked against its text. Whatever cannot be written down this way (a method made with ``exec()``, a lambda, a closure) raises
``SourceError`` saying why.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import functools
import inspect
import linecache
import math
import textwrap
from collections import ChainMap, Counter
from dataclasses import dataclass, field
from types import FunctionType, MemberDescriptorType, MethodType, ModuleType

#: Attributes Python (or its ``abc`` module) puts into every class's namespace.
MADE_BY_PYTHON = frozenset({"__module__", "__qualname__", "__doc__", "__dict__", "__weakref__", "__annotations__", "__orig_bases__",
                            "__parameters__", "__abstractmethods__", "_abc_impl", "__firstlineno__", "__static_attributes__"})
#: Attributes the ``dataclass`` decorator may set on the class it makes (it sets them again on the class written down).
MADE_BY_DATACLASS = frozenset({"__dataclass_params__", "__dataclass_fields__", "__init__", "__repr__", "__eq__", "__hash__", "__lt__",
                               "__le__", "__gt__", "__ge__", "__setattr__", "__delattr__", "__match_args__", "__replace__", "__slots__",
                               "__getstate__", "__setstate__"})
#: The ``dataclass`` decorator's parameters kept in ``__dataclass_params__``, with their defaults.
DATACLASS_PARAMS = {"init": True, "repr": True, "eq": True, "order": False, "unsafe_hash": False, "frozen": False}
NO_TEXT = ("has no source Python can read back (made with exec() or type(), or typed into a console?): "
           "put it in a .py file or a notebook cell and grade that")


_CONSTANTS = (bool, int, float, complex, str, bytes, type(None))


class SourceError(Exception):
    """The source of a class (or of something it uses) cannot be written down."""


def literal(value: object, depth: int = 0) -> str | None:
    """Python text for a plain constant (a number, a string, None; a tuple, list or dict of them, as a notebook's config
    dict), else None (also past 16 levels of nesting: a list that holds itself)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"  # float('inf'), float('-inf'), float('nan')
    if isinstance(value, (tuple, list, dict)) and depth < 16:
        pairs = value.items() if isinstance(value, dict) else ((None, v) for v in value)
        items = [(None if k is None else literal(k, depth + 1), literal(v, depth + 1)) for k, v in pairs]
        if any(v is None or (k is None and isinstance(value, dict)) for k, v in items):
            return None
        if isinstance(value, dict):
            return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
        inner = ", ".join(v for _, v in items)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(items) == 1 else ''})"
    if type(value) in _CONSTANTS:
        return repr(value)
    if isinstance(value, (int, float)) and type(value).__module__ == "numpy":  # np.float64(8.0): a float's text
        return literal(float(value) if isinstance(value, float) else int(value))
    return None  # a subclass (an IntEnum member) has no text of its own


@dataclass(frozen=True)
class Piece:
    """One definition: its text, where it was written (``filename``, ``line``: its first line there),
    and the names it reads with what they mean where it was written."""

    text: str
    filename: str | None
    line: int
    uses: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Written:
    """A class as pieces: its statement (or a header made from its bases), then each change made since."""

    pieces: list[Piece]
    changes: list[str]  # the attributes set or deleted after the class statement ran
    from_statement: bool  # False: no method of its own tells which statement made it (written from its bases)


def write_class(cls: type) -> Written:
    """``cls`` as it is now. Raises ``SourceError`` when some part of it has no text to write."""
    statement = _statement(cls)
    bound = _bound(statement[1]) if statement else {}
    piece, written = _statement_piece(cls, *statement) if statement else (None, {})
    pieces = [piece or (_dataclass_header(cls) if _is_dataclass(cls) else _header(cls))]
    if statement and _is_dataclass(cls) and not statement[1].decorator_list:  # C = dataclass(C) after the statement
        pieces.append(Piece(f"{cls.__name__} = {_decorator(cls)}({cls.__name__})\n", None, 1, {"dataclasses": dataclasses}))
    changes = []
    for name, value in vars(cls).items():
        if name in MADE_BY_PYTHON or (name not in bound and _made_by_dataclass(cls, name, value)):
            continue
        functions = _functions(value)
        if functions is not None:
            if statement and name in bound and all(_in_statement(f, statement) for f in functions):
                _no_closure(f"{cls.__name__}.{name}", functions, "define the class at the top of the file or notebook", ("__class__",))
                continue
            pieces += _method(cls, name, value, functions)
        elif literal(value) is not None:
            if name in bound and _same(written.get(name, bound[name]), value):  # a computed one not pinned: set after it
                continue
            pieces.append(Piece(f"{cls.__name__}.{name} = {literal(value)}\n", None, 1))
        elif not statement:
            raise SourceError(f"{cls.__name__}.{name} (a {type(value).__name__}) cannot be written down: {cls.__name__} has no method "
                              "of its own, so the text of its class statement cannot be found; give it a number, string, bool, None or "
                              "tuple of them, set it in __init__, or give the class a method")
        elif name not in bound:
            raise SourceError(f"{cls.__name__}.{name} (a {type(value).__name__}) was set outside the class statement and cannot be written down: "
                              "set it inside the class, e.g. in __init__")
        else:
            continue  # made by the statement's own code: written with it
        changes.append(name)
    for name in bound:
        if name not in vars(cls) and not _removed_by_dataclass(cls, name):
            pieces.append(Piece(f"del {cls.__name__}.{name}\n", None, 1))
            changes.append(name)
    return Written(pieces, changes, statement is not None)


def function_piece(fn: FunctionType, decorated: bool = True) -> Piece:
    """A function's ``def`` (with its decorators when ``decorated``) from the file and line its code carries."""
    found = _def_node(inspect.unwrap(fn) if decorated else fn)
    if found is None:
        raise SourceError(f"the function {fn.__qualname__} {NO_TEXT}")
    filename, lines, _, node = found
    first = _first(node) if decorated else node.lineno
    text = _pinned(lines, first, node.end_lineno, _default_pins(inspect.unwrap(fn), node, fn.__qualname__))
    return Piece(textwrap.dedent("".join(text)), filename, first, _uses(text, fn))


# ----------------------------------------------------------------------------- the class statement


def _statement(cls: type) -> tuple[str, ast.ClassDef, list[str]] | None:
    """The class statement (file, node, its file's lines) whose body defined the methods ``cls`` holds, or None."""
    found: dict[tuple[str, int], tuple[str, ast.ClassDef, list[str]]] = {}
    for value in vars(cls).values():
        for fn in _functions(value) or ():
            place = _def_node(inspect.unwrap(fn))
            if place is None:
                continue
            filename, lines, tree, node = place
            owner = next((c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == cls.__name__ and node in c.body), None)
            if owner is not None:
                found[(filename, owner.lineno)] = (filename, owner, lines)
    if len(found) > 1:
        where = ", ".join(f"{_short(f)} line {n}" for f, n in sorted(found))
        raise SourceError(f"its methods come from {len(found)} different class statements named {cls.__name__} ({where}): "
                          "run the cell that defines the class again, or grade a .py file")
    return next(iter(found.values()), None)


def _statement_piece(cls: type, filename: str, node: ast.ClassDef, lines: list[str]) -> tuple[Piece, dict[str, object]]:
    """The class statement's text (its pins written in: ``_statement_pins``) and the names it binds to pinned values."""
    first = _first(node)
    scope = next((inspect.unwrap(f).__globals__ for v in vars(cls).values() for f in _functions(v) or ()), {})
    pins, written = _statement_pins(cls, filename, node, scope)
    text = _pinned(lines, first, node.end_lineno, pins)
    for base in cls.__bases__:  # the statement ran with them: the name may mean another class by now
        if base.__name__ != cls.__name__ and isinstance(scope.get(base.__name__), type) and scope[base.__name__] is not base:
            raise SourceError(f"{cls.__name__}'s base {base.__name__} is not the class that name means now ({base.__name__} was "
                              f"defined again after {cls.__name__}): run {cls.__name__}'s cell again, so that it is built on it")
    uses = {n: scope[n] for n in _free_names(text) if n in scope and n != cls.__name__}
    return Piece(textwrap.dedent("".join(text)), filename, first, uses | _same_name_bases(cls)), written


def _header(cls: type) -> Piece:
    """``class C(Base, ...): pass`` for a class with no method of its own."""
    bases = [b for b in cls.__bases__ if b is not object]
    names = ", ".join(b.__name__ for b in bases)
    return Piece(f"class {cls.__name__}{f'({names})' if names else ''}:\n    pass\n", None, 1, {b.__name__: b for b in bases})


def _same_name_bases(cls: type) -> dict[str, object]:
    """``class A(A)``: the earlier A, which the name no longer reaches."""
    return {b.__name__: b for b in cls.__bases__ if b.__name__ == cls.__name__}


def _bound(node: ast.ClassDef) -> dict[str, object]:
    """The names the statement's body binds, each with its literal value (``_COMPUTED`` when it is not one)."""
    bound: dict[str, object] = {}
    for stmt in node.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound[stmt.name] = _COMPUTED
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    bound[t.id] = _COMPUTED if isinstance(stmt, ast.AugAssign) else _literal_node(stmt.value)
    return bound


_COMPUTED = object()  # bound by code the statement runs: its value is not read from the text


def _literal_node(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _COMPUTED


def _same(a: object, b: object) -> bool:
    """The same plain value, as its text says (-0.0 is not 0.0; a NaN is a NaN)."""
    return type(a) is type(b) and literal(a) is not None and literal(a) == literal(b)


def _in_statement(fn: FunctionType, statement: tuple[str, ast.ClassDef, list[str]]) -> bool:
    place = _def_node(inspect.unwrap(fn))
    return place is not None and place[0] == statement[0] and any(n.lineno == place[3].lineno for n in statement[1].body)


# ----------------------------------------------------------------------------- what a statement computed when it ran


class _UnreadError(Exception):
    """An expression whose value cannot be read without running code (a call, a subscript...)."""


_UNREAD = object()  # a name the class body bound with a value that cannot be read


def _value(node: ast.expr, scope: ChainMap) -> object:
    """What a name, or an attribute of a module or class, means now in ``scope``. Raises ``_UnreadError`` for any other
    expression (reading it could run code)."""
    if isinstance(node, ast.Name) and scope.get(node.id, _UNREAD) is not _UNREAD:
        return scope[node.id]
    if isinstance(node, ast.Attribute):
        base = _value(node.value, scope)
        if isinstance(base, (ModuleType, type)) and hasattr(base, node.attr):
            return getattr(base, node.attr)
    raise _UnreadError


def _pin(node: ast.expr, value: object, scope: ChainMap, what: str) -> tuple[ast.expr, str] | None:
    """``(node, text of value)`` for an expression Python computed once, when its statement ran, that now holds
    ``value``: written as that value wherever it has a text (``literal``), whatever the expression would give today
    (a name it reads set again since, a dict it reads changed, the order pieces are written in); None for a constant, or
    for a value with no text that its expression (a name, an attribute) still gives, or whose expression cannot be read
    without running it. Raises ``SourceError`` for a value with no text that its name, attribute or class called no
    longer gives."""
    if isinstance(node, ast.Constant):
        return None
    text = literal(value)
    if text is not None:
        return node, text
    try:
        now = _value(node, scope)
    except _UnreadError:
        _made_by(node, value, scope, what)
        return None
    if now is not value and not (isinstance(value, MethodType) and now == value):  # a class's method: a new bound method each read
        raise SourceError(f"{what} holds a {type(value).__name__} that its text {ast.unparse(node)} no longer gives (set again since "
                          f"it was defined), and a {type(value).__name__} cannot be written as text: run the cell that defines it again")
    return None


def _made_by(node: ast.expr, value: object, scope: ChainMap, what: str) -> None:
    """Raises ``SourceError`` where ``node`` calls a class (``cfg=Config()``) that ``value`` is not an instance of: the
    class was defined again since, and the text would make another."""
    try:
        made = _value(node.func, scope) if isinstance(node, ast.Call) else None
    except _UnreadError:
        return
    if isinstance(made, type) and not isinstance(value, made):
        raise SourceError(f"{what} holds a {type(value).__name__} made when it was defined, and {ast.unparse(node.func)} is another "
                          "class now (defined again since): run the cell that defines it again")


def _default_pins(fn: FunctionType, node: ast.FunctionDef | ast.AsyncFunctionDef, where: str,
                  scope: ChainMap | None = None) -> list[tuple[ast.expr, str]]:
    """The pins of ``fn``'s defaults (its ``def``: ``node``), which Python computed once, when the ``def`` ran (in
    ``scope``: a class body's names, else the function's globals)."""
    args, scope = node.args, scope if scope is not None else ChainMap(fn.__globals__, vars(builtins))
    positional = [*args.posonlyargs, *args.args][len(args.posonlyargs) + len(args.args) - len(args.defaults) :]
    given = fn.__defaults__ or ()
    triples = list(zip(positional, args.defaults, given, strict=True)) if len(given) == len(args.defaults) else []
    kw = fn.__kwdefaults__ or {}
    triples += [(a, d, kw[a.arg]) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None and a.arg in kw]
    return [p for a, d, v in triples if (p := _pin(d, v, scope, f"{where}'s default for {a.arg}")) is not None]


def _statement_pins(cls: type, filename: str, node: ast.ClassDef, scope: dict) -> tuple[list[tuple[ast.expr, str]], dict[str, object]]:
    """The pins of the class statement: its methods' defaults, and each name its body binds once, plainly (``scale =
    SCALE``; a dataclass field's default); and the values those names are written with (a name bound more than once, or
    otherwise, keeps its text: ``write_class`` sets the value it holds after the statement)."""
    pins, written, body = [], {}, {}
    reads = ChainMap(body, scope, vars(builtins))  # the class body's expressions see what it bound before them
    made = {(inspect.unwrap(f).__code__.co_filename, inspect.unwrap(f).__code__.co_firstlineno): inspect.unwrap(f)
            for v in vars(cls).values() for f in _functions(v) or ()}
    bindings = Counter(n for stmt in node.body for n in _scope_names([stmt])[0])
    for stmt in node.body:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        assigned = [t.id for t in targets if isinstance(t, ast.Name)]
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            fn = made.get((filename, _first(stmt)))
            if fn is not None:
                pins += _default_pins(fn, stmt, f"{cls.__name__}.{stmt.name}", reads)
            held = vars(cls).get(stmt.name, _UNREAD)
            body[stmt.name] = held if fn is not None and fn in [inspect.unwrap(f) for f in _functions(held) or ()] else _UNREAD
        elif isinstance(stmt, ast.ClassDef):  # a class in the body: its own body read as this one is (in the globals)
            inner = vars(cls).get(stmt.name)
            if isinstance(inner, type) and inner.__qualname__ == f"{cls.__qualname__}.{stmt.name}":
                pins += _statement_pins(inner, filename, stmt, scope)[0]
            body[stmt.name] = _UNREAD
        elif (stmt.__dict__.get("value") is not None and assigned and len(assigned) == len(targets)
              and all(bindings[n] == 1 for n in assigned) and (value := _held(cls, assigned)) is not _UNREAD):
            where = f"{cls.__name__}.{assigned[0]}"
            expr = _field_default(stmt.value) if _is_field(stmt.value, reads) else stmt.value  # field(default=...): its default
            pin = _pin(expr, value, reads, where)
            if pin is not None:
                pins.append(pin)
                written.update(dict.fromkeys(assigned, value))
            body.update(dict.fromkeys(assigned, value))
        else:
            body.update(dict.fromkeys(_scope_names([stmt])[0], _UNREAD))  # bound another way: not read
    return pins, written


def _is_field(node: ast.expr, scope: ChainMap) -> bool:
    """Whether ``node`` calls ``dataclasses.field`` (its default, if any, is pinned, not the call)."""
    try:
        return isinstance(node, ast.Call) and _value(node.func, scope) is dataclasses.field
    except _UnreadError:
        return False


def _field_default(node: ast.Call) -> ast.expr:
    """``dataclasses.field(default=...)``'s default (a constant stand-in where it has none: nothing pinned)."""
    return next((k.value for k in node.keywords if k.arg == "default"), ast.Constant(None))


def _held(cls: type, targets: list[str]) -> object:
    """The value the class holds for ``a = b = ...`` (a dataclass field: its default), or ``_UNREAD`` where it holds none
    or the targets hold different values (one was set again since: written after the statement)."""
    fields = cls.__dataclass_fields__ if _is_dataclass(cls) else {}
    values = [fields[t].default if t in fields else vars(cls).get(t, _UNREAD) for t in targets]
    value = values[0]
    same = all(v is value for v in values) and value is not dataclasses.MISSING and not isinstance(value, MemberDescriptorType)
    return value if same else _UNREAD


def _pinned(lines: list[str], first: int, last: int, pins: list[tuple[ast.expr, str]]) -> list[str]:
    """Lines ``first`` to ``last`` (from 1) of a file's ``lines``, each pinned expression's text replaced by its value's."""
    text = list(lines[first - 1 : last])
    for node, new in sorted(pins, key=lambda p: (p[0].lineno, p[0].col_offset), reverse=True):
        a, b = node.lineno - first, node.end_lineno - first
        start = len(text[a].encode()[: node.col_offset].decode())  # the tree's columns count UTF-8 bytes
        end = len(text[b].encode()[: node.end_col_offset].decode())
        text[a : b + 1] = [text[a][:start] + new + text[b][end:]]
    return text


# ----------------------------------------------------------------------------- dataclasses


def _is_dataclass(cls: type) -> bool:
    """True for a class the ``dataclass`` decorator made (not one that only inherits a dataclass's fields)."""
    return "__dataclass_fields__" in vars(cls)


def _made_by_dataclass(cls: type, name: str, value: object) -> bool:
    """True for an attribute the decorator set (a generated method, ``__dataclass_fields__``...) or a field's default:
    writing the class as a dataclass makes it again. A method set on the class since is not one."""
    if not _is_dataclass(cls):
        return False
    if name in MADE_BY_DATACLASS:
        functions = _functions(value)
        return functions is None or all(_generated(cls, f) for f in functions)
    field_ = next((f for f in dataclasses.fields(cls) if f.name == name), None)  # a ClassVar is a class attribute like any other
    return field_ is not None and (value is field_.default or isinstance(value, MemberDescriptorType))  # slots=True: a slot


def _generated(cls: type, fn: FunctionType) -> bool:
    """A function the decorator made: from text it ran with exec(), or one of the dataclasses module's own."""
    code = inspect.unwrap(fn).__code__  # __repr__ comes wrapped, to stop at a recursive repr
    return fn.__module__ == "dataclasses" or (code.co_filename == "<string>" and fn.__qualname__.startswith(f"{cls.__qualname__}."))


def _removed_by_dataclass(cls: type, name: str) -> bool:
    """True for a field the statement bound that the decorator took off the class (no default; slots=True)."""
    field_ = cls.__dataclass_fields__.get(name) if _is_dataclass(cls) else None
    return field_ is not None and (field_.default is dataclasses.MISSING or "__slots__" in vars(cls))


def _decorator(cls: type) -> str:
    """``dataclasses.dataclass(frozen=True)``: the decorator with the parameters that made ``cls``."""
    params = {k: getattr(cls.__dataclass_params__, k) for k, default in DATACLASS_PARAMS.items()
              if getattr(cls.__dataclass_params__, k) != default}
    if "__match_args__" not in vars(cls):
        params["match_args"] = False
    if "__slots__" in vars(cls):
        params["slots"] = True
        if "__weakref__" in vars(cls)["__slots__"]:
            params["weakref_slot"] = True
    return "dataclasses.dataclass" + (f"({', '.join(f'{k}={v!r}' for k, v in params.items())})" if params else "")


def _dataclass_header(cls: type) -> Piece:
    """``@dataclasses.dataclass(...)`` then ``class C(Base, ...):`` with each field the class itself declares,
    for a dataclass with no method of its own. Raises ``SourceError`` for a field that cannot be written down."""
    header = _header(cls)
    own = vars(cls).get("__annotations__", {})
    fields = [f for f in dataclasses.fields(cls) if f.name in own]
    init = inspect.signature(cls.__init__).parameters if "__init__" in vars(cls) else {}
    init_vars = [n for n in cls.__dataclass_fields__ if n in own and n in init and n not in {f.name for f in fields}]  # not a ClassVar
    if init_vars:
        raise SourceError(f"{cls.__name__}.{init_vars[0]} is an InitVar of a dataclass with no method of its own, which cannot be "
                          "written down: drop it, or give the class its __post_init__")
    uses = {**header.uses, "dataclasses": dataclasses}
    lines = [_field_line(cls, f, uses) for f in fields] or ["pass"]
    class_line = header.text.splitlines(True)[0]  # class C(Base, ...):
    return Piece(f"@{_decorator(cls)}\n{class_line}" + "".join(f"    {line}\n" for line in lines), None, 1, uses)


def _field_line(cls: type, f: dataclasses.Field, uses: dict[str, object]) -> str:
    """``name: 'annotation' = default`` or ``= dataclasses.field(...)``; the factory it calls goes into ``uses``."""
    where = f"{cls.__name__}.{f.name}"
    args = {}
    if f.default is not dataclasses.MISSING:
        args["default"] = literal(f.default)
        if args["default"] is None:
            raise SourceError(f"{where} has a default (a {type(f.default).__name__}) that cannot be written down: give the field a "
                              "number, string, bool, None or tuple of them, or make it with field(default_factory=...)")
    if f.default_factory is not dataclasses.MISSING:
        args["default_factory"] = _factory(where, f.default_factory, uses)
    for key, default in (("init", True), ("repr", True), ("hash", None), ("compare", True), ("kw_only", False)):
        if getattr(f, key, default) != default:
            args[key] = repr(getattr(f, key))
    if f.metadata:
        items = [(literal(k), literal(v)) for k, v in f.metadata.items()]
        if any(None in item for item in items):
            raise SourceError(f"{where} has metadata that cannot be written down: keep its keys and values numbers, strings, bools, "
                              "None or tuples of them")
        args["metadata"] = "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if list(args) == ["default"]:
        return f"{f.name}: {_annotation(f.type)} = {args['default']}"
    call = ", ".join(f"{k}={v}" for k, v in args.items())
    return f"{f.name}: {_annotation(f.type)}" + (f" = dataclasses.field({call})" if args else "")


def _factory(where: str, factory: object, uses: dict[str, object]) -> str:
    """The name of a field's ``default_factory``: a class or a ``def`` function, written (or imported) under its own name."""
    if not isinstance(factory, (type, FunctionType)) or factory.__name__ == "<lambda>":
        raise SourceError(f"{where} has a default_factory (a {type(factory).__name__}) that cannot be written down: "
                          "use a class or a function written with def")
    if getattr(builtins, factory.__name__, None) is not factory:
        uses[factory.__name__] = factory
    return factory.__name__


def _annotation(annotation: object) -> str:
    """A field's annotation: a builtin class by its name (``int``), anything else as its text in quotes (``'torch.dtype'``),
    which the dataclass takes as it takes any annotation, without the names it reads."""
    if isinstance(annotation, type) and getattr(builtins, annotation.__name__, None) is annotation:
        return annotation.__name__
    return repr(annotation if isinstance(annotation, str) else inspect.formatannotation(annotation))


# ----------------------------------------------------------------------------- methods set later


def _method(cls: type, name: str, value: object, functions: list[FunctionType]) -> list[Piece]:
    """The ``def`` of a method set after the class statement, then ``C.name = ...``."""
    where = f"{cls.__name__}.{name}"
    if isinstance(value, property):
        raise SourceError(f"the property {where} was set outside the class statement and cannot be written down: define it in the class")
    (fn,) = functions
    if fn is not inspect.unwrap(fn):
        raise SourceError(f"{where} is a decorated function set outside the class statement and cannot be written down: define it in the class")
    if fn.__code__.co_name == "<lambda>":
        raise SourceError(f"{where} is a lambda, which cannot be written down: write it with def")
    if _def_node(fn) is None:
        raise SourceError(f"its method {name} {NO_TEXT}")
    piece = function_piece(fn, decorated=False)  # the function itself: a decorator such as add_to_class already ran
    _no_closure(where, functions, "define it in the class, or at the top of the notebook")
    wrap = {staticmethod: "staticmethod", classmethod: "classmethod"}.get(type(value))
    made = f"{wrap}({fn.__code__.co_name})" if wrap else fn.__code__.co_name
    return [piece, Piece(f"{cls.__name__}.{name} = {made}\n", None, 1)]


def _no_closure(where: str, functions: list[FunctionType], fix: str, remade: tuple[str, ...] = ()) -> None:
    """SourceError when a method reads names of the function or class it was made in, but ``remade`` (``super()``'s
    ``__class__``, which a class statement written again makes again)."""
    free = [name for f in functions for name in f.__code__.co_freevars if name not in remade]
    if free:
        raise SourceError(f"{where} reads {', '.join(dict.fromkeys(free))} from the function or class it was made in, "
                          f"which cannot be carried into the grading process: {fix}")


def _functions(value: object) -> list[FunctionType] | None:
    """The Python functions a method attribute holds, or None when it is not a method made of them."""
    inner = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    found = [f for f in (inner.fget, inner.fset, inner.fdel) if f is not None] if isinstance(inner, property) else [inner]
    return found if found and all(isinstance(f, FunctionType) for f in found) else None


# ----------------------------------------------------------------------------- reading the text


def decorated(fn: FunctionType) -> bool:
    """Whether the ``def`` that made ``fn`` (found as ``function_piece`` finds it) has decorators."""
    found = _def_node(fn)
    return found is not None and bool(found[3].decorator_list)


def _def_node(fn: FunctionType) -> tuple[str, list[str], ast.Module, ast.FunctionDef | ast.AsyncFunctionDef] | None:
    """The ``def`` that made ``fn``: at the line its code starts in the file its code names (linecache)."""
    code = fn.__code__
    lines = linecache.getlines(code.co_filename)
    tree = _parse("".join(lines)) if lines else None
    if tree is None:
        return None
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    node = next((n for n in ast.walk(tree) if isinstance(n, kinds) and n.name == code.co_name and _first(n) == code.co_firstlineno), None)
    return None if node is None else (code.co_filename, lines, tree, node)


@functools.lru_cache(maxsize=16)
def _parse(text: str) -> ast.Module | None:
    """A file's tree (shared: never changed), or None for a text that is not Python as a whole (a README's block)."""
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _first(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> int:
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


def _uses(lines: list[str], fn: FunctionType) -> dict[str, object]:
    scope = inspect.unwrap(fn).__globals__
    return {n: scope[n] for n in _free_names(lines) if n in scope and n != fn.__code__.co_name}


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _free_names(lines: list[str]) -> list[str]:
    """Every name the definition reads from outside it, in order of first use, as Python's scopes resolve them: not a
    function's own parameters and locals (a notebook global ``cls`` is not what ``def of(cls)`` reads), not a
    comprehension's targets, not what a class body binds for the class body's own expressions; a name a function
    declares ``global`` is read from outside."""
    found: dict[str, None] = {}

    def visit(node: ast.AST, local: frozenset[str]) -> None:
        if isinstance(node, _FUNCTIONS):
            args = node.args
            params = [*args.posonlyargs, *args.args, *args.kwonlyargs, *(a for a in (args.vararg, args.kwarg) if a is not None)]
            outside = [*getattr(node, "decorator_list", []), *args.defaults, *(d for d in args.kw_defaults if d is not None),
                       *(a.annotation for a in params if a.annotation is not None), *([node.returns] if getattr(node, "returns", None) else [])]
            for child in outside:  # evaluated where the function is defined
                visit(child, local)
            body = node.body if isinstance(node.body, list) else [node.body]
            stores, declared = _scope_names(body)
            found.update(dict.fromkeys(declared))
            for child in body:
                visit(child, (local | {a.arg for a in params} | stores) - declared)
        elif isinstance(node, _COMPREHENSIONS):
            visit(node.generators[0].iter, local)  # evaluated where the comprehension is
            inner = local | {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
            for child in [*(g.iter for g in node.generators[1:]), *(c for g in node.generators for c in g.ifs),
                          *(getattr(node, f) for f in ("elt", "key", "value") if hasattr(node, f))]:
                visit(child, inner)
        elif isinstance(node, ast.ClassDef):
            for child in [*node.decorator_list, *node.bases, *node.keywords]:
                visit(child, local)
            body = local | _scope_names(node.body)[0]  # the class body's own expressions see its names; its methods do not
            for child in node.body:
                visit(child, local if isinstance(child, _FUNCTIONS) else body)
        else:
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                found.setdefault(node.id)
            for child in ast.iter_child_nodes(node):
                visit(child, local)

    visit(ast.parse(textwrap.dedent("".join(lines))), frozenset())
    return list(found)


def _scope_names(body: list[ast.stmt]) -> tuple[frozenset[str], frozenset[str]]:
    """The names one scope's own statements bind (assigned, imported, defined; not inside a nested function, class or
    comprehension), less those it declares ``global`` or ``nonlocal``; and the ones it declares so."""
    stores, declared, stack = set(), set(), list(body)
    while stack:
        n = stack.pop()
        if isinstance(n, (ast.Global, ast.Nonlocal)):
            declared.update(n.names)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stores.add(n.name)  # (its body is its own scope)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            stores.add(n.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            stores.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif not isinstance(n, (ast.Lambda, *_COMPREHENSIONS)):
            stores.update([n.name] if isinstance(n, ast.ExceptHandler) and n.name else [])
            stack.extend(ast.iter_child_nodes(n))
    return frozenset(stores - declared), frozenset(declared)


def _short(filename: str) -> str:
    return filename.rsplit("/", 1)[-1]
