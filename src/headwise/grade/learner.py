"""The learner's side: load their file, find their classes, build them with the book's weights.

Weights go in by name and shape, never by creation order: the book's ``W_query``,
``W_key``, ``W_value``, ``out_proj`` (and the wrapper's ``heads.N.*``), under common other
names too (``q_proj``, ``c_proj``...), a fused ``qkv`` layer as the three stacked, and a bare
``nn.Parameter`` of shape (d_in, d_out) as the book's first ``x @ W_query`` version.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor, nn

from . import notebook
from .reference import BOOK_CLASSES, Config

ALIASES = {
    "W_query": ("w_query", "query", "q_proj", "w_q", "wq", "q"),
    "W_key": ("w_key", "key", "k_proj", "w_k", "wk", "k"),
    "W_value": ("w_value", "value", "v_proj", "w_v", "wv", "v"),
    "out_proj": ("out_proj", "o_proj", "c_proj", "proj", "out", "wo", "w_o"),
}
FUSED = ("qkv", "w_qkv", "wqkv", "c_attn", "qkv_proj", "in_proj")


class SetupError(Exception):
    """The learner's class cannot be graded as it is (a weight we cannot place, a bad signature)."""


def load(target: str, root: str | None = None) -> ModuleType:
    """Import a ``.py`` file or run a ``.ipynb`` notebook's code cells (the file's folder goes on sys.path,
    for its own imports), or import a module path, looked up from ``root`` (default: the current directory)."""
    path = Path(target)
    if path.suffix == ".ipynb":
        sys.path.insert(0, str(path.resolve().parent))
        try:
            cells = notebook.read(path)
        except notebook.NotebookError as e:
            raise SetupError(str(e)) from None
        module = ModuleType("learner")
        module.__file__ = str(path)
        sys.modules["learner"] = module
        notebook.run(cells, vars(module), str(path.resolve()))
        return module
    if path.suffix == ".py" or path.exists():
        sys.path.insert(0, str(path.resolve().parent))
        spec = importlib.util.spec_from_file_location("learner", path)
        if spec is None or spec.loader is None:
            raise SetupError(f"cannot load {target} as Python")
        module = importlib.util.module_from_spec(spec)
        sys.modules["learner"] = module
        spec.loader.exec_module(module)
        return module
    sys.path.insert(0, root or str(Path.cwd()))
    return importlib.import_module(target)


def find_classes(module: ModuleType, names: list[str] | None) -> list[tuple[str, type]]:
    """The classes named ``names`` in ``module``, or by default those named like the book's and defined there."""
    defined = {n: c for n, c in vars(module).items() if inspect.isclass(c) and c.__module__ == module.__name__}
    where = getattr(module, "__file__", module.__name__)
    if names:
        missing = [n for n in names if not (inspect.isclass(getattr(module, n, None)) and issubclass(getattr(module, n), nn.Module))]
        if missing:
            raise SetupError(f"{where} has no nn.Module class named {', '.join(missing)} (classes defined there: {', '.join(defined) or 'none'})")
        return [(n, getattr(module, n)) for n in names]
    found = [(n, c) for n, c in defined.items() if n in BOOK_CLASSES and issubclass(c, nn.Module)]
    plain = [n for n, c in defined.items() if n in BOOK_CLASSES and not issubclass(c, nn.Module)]
    if not found and plain:
        raise SetupError(f"{where} defines {', '.join(plain)}, but not as a torch.nn.Module: the book's classes start "
                         f"class {plain[0]}(nn.Module) (and call super().__init__() first)")
    if not found:
        raise SetupError(
            f"{where} defines no class named {', '.join(BOOK_CLASSES)} (classes defined there: {', '.join(defined) or 'none'}); "
            "name yours like the book's or pass --class NAME"
        )
    return found


def kind_of(name: str, cls: type) -> str:
    """The book class to grade against: by name, else by signature (``num_heads``) and a ``heads`` list."""
    if name in BOOK_CLASSES:
        return name
    if "num_heads" not in inspect.signature(cls.__init__).parameters and len(positional(cls)) < 6:  # (d_in, d_out, context_length, dropout[, qkv_bias])
        return "CausalAttention"
    try:
        probe = cls(3, 2, 6, 0.0, 2)
    except Exception:
        return "MultiHeadAttention"
    return "MultiHeadAttentionWrapper" if isinstance(getattr(probe, "heads", None), nn.ModuleList) else "MultiHeadAttention"


def positional(cls: type) -> list[inspect.Parameter]:
    """The positional parameters of ``cls.__init__`` after self."""
    params = inspect.signature(cls.__init__).parameters.values()
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]


def build(cls: type, kind: str, config: Config, state: dict[str, Tensor], dropout: float = 0.0) -> nn.Module:
    """``cls(*book's positional args)`` in eval mode, holding the reference's weights."""
    module = cls(*config.args(kind, dropout))
    if not isinstance(module, nn.Module):
        raise SetupError(f"{cls.__name__}(...) gave a {type(module).__name__}, not an nn.Module")
    copy_weights(module, state)
    return module.eval()


def copy_weights(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Set each of the learner's parameters from the book's one of the same name and shape; one no book weight is and
    that trains nothing (``requires_grad=False``: a mask kept as a Parameter) is left as the class made it."""
    with torch.no_grad():
        for name, p in module.named_parameters(remove_duplicate=False):
            if (source := _source(name, tuple(p.shape), state)) is not None:
                p.copy_(source.to(p.dtype))
            elif p.requires_grad:
                raise SetupError(
                    f"cannot tell which of the book's weights parameter {name} (shape {tuple(p.shape)}) is: name the layers "
                    "like the book (W_query, W_key, W_value, out_proj; a fused one qkv); a tensor that is not a weight (a "
                    "mask) is a buffer: self.register_buffer(...)"
                )


def _layers(state: dict[str, Tensor]) -> str:
    """The book module's layers, e.g. ``heads.0.W_query, heads.0.W_key, ...``."""
    return ", ".join(dict.fromkeys(key.rsplit(".", 1)[0] for key in state))


def _source(name: str, shape: tuple, state: dict[str, Tensor]) -> Tensor | None:
    """The book's weight that the learner's parameter ``name`` is (transposed for a bare (d_in, d_out) one), or None
    where no name of the book's says; a SetupError where one does and it does not fit."""
    *path, leaf = name.split(".")
    if leaf not in ("weight", "bias"):  # a bare Parameter: the book's x @ W, (d_in, d_out)
        path, leaf = [*path, leaf], "T"
    owner, layer = ".".join(path[:-1]), path[-1] if path else ""
    prefix = owner + "." if owner else ""
    for canon, aliases in ALIASES.items():
        if layer == canon or layer.lower() in aliases:
            want = state.get(f"{prefix}{canon}.{'weight' if leaf == 'T' else leaf}")
            if want is not None:
                want = want.T if leaf == "T" else want
                if tuple(want.shape) == shape:
                    return want
                raise SetupError(f"parameter {name} has shape {shape}; the book's {prefix}{canon} has {tuple(want.shape)}")
            if leaf == "bias" and f"{prefix}{canon}.weight" in state:  # the layer is the book's, its bias is not there
                raise SetupError(
                    f"parameter {name} is a bias the book's {prefix}{canon} does not have here (qkv_bias=False): "
                    "build the layer with nn.Linear(d_in, d_out, bias=qkv_bias)"
                )
            if not any(key.startswith(f"{prefix}{canon}.") for key in state):
                raise SetupError(f"parameter {name}: the book's class has no {prefix}{canon} layer; it holds {_layers(state)}")
    if layer.lower() in FUSED and leaf != "T":
        parts = [state.get(f"{prefix}{c}.{leaf}") for c in ("W_query", "W_key", "W_value")]
        if all(p is not None for p in parts) and tuple(torch.cat(parts).shape) == shape:
            return torch.cat(parts)  # (3 * d_out, d_in): queries, keys, values stacked
    return None


@dataclass(frozen=True)
class Raised:
    """Where the learner's code raised (or was stopped) and what: ``line`` ``crash.py:31`` or
    ``mine.ipynb, cell 4, line 2`` (None when no frame of theirs is on the stack), ``code`` its text."""

    line: str | None
    code: str | None
    error: str

    def __str__(self) -> str:
        return f"{self.line}: {self.code}  {self.error}" if self.line else self.error


def where(exc: BaseException, file: str | None) -> Raised:
    """The deepest frame of the learner's own code (``file``, or a notebook cell) in ``exc``'s traceback, and the exception."""
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SystemExit):
        what = f"SystemExit({exc.code!r}): the code called sys.exit(), which would end the program"
    if isinstance(exc, SyntaxError) and exc.filename:
        return Raised(place(exc.filename, exc.lineno or 0), (exc.text or "").strip(), f"{type(exc).__name__}: {exc.msg}")
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_theirs(f.filename, file)]
    if frames:
        f = frames[-1]
        return Raised(place(f.filename, f.lineno or 0), (f.line or "").strip(), what)
    return Raised(None, None, what)


def is_theirs(filename: str, file: str | None) -> bool:
    """True for a notebook cell the grader ran, or for ``file``."""
    return filename in notebook.CELLS or (file is not None and Path(filename).resolve() == Path(file).resolve())


def place(filename: str, lineno: int) -> str:
    """``crash.py:31``, or ``mine.ipynb, cell 4, line 2`` for a notebook cell."""
    cell = notebook.CELLS.get(filename)
    return f"{cell}, line {lineno}" if cell else f"{Path(filename).name}:{lineno}"
