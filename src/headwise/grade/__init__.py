"""Grade a learner's own attention classes against the book's, step by step, by their numbers.

``grade("my_attention.py")`` loads the file in a separate process with a time limit, finds
the classes named like the book's (``CausalAttention``, ``MultiHeadAttentionWrapper``,
``MultiHeadAttention``), builds each with the book's positional signature and weights, runs
the book's batch and a few random configurations in eval mode, and records every tensor the
learner's forward computes; then, built with dropout, it must give the book's output in eval mode and
another in train mode (dropout in training only). A class passes when its output matches the book's class; else
the report names the first step of the book's forward it never produced, what was expected
and what came closest, and a hint when its numbers match a known mistake's; code that raised
or ran too long is shown at its line.

``grade("my_notebook.ipynb")`` runs the notebook's code cells in order in that process (its
JSON read with the standard library) and grades the classes they leave defined.

``grade(MyMultiHeadAttention)`` (or a list of classes) does the same for classes defined in a
notebook cell or a module: each is written down as it is now, from the code its methods hold
(a method replaced or added in a later cell included), and graded in the same separate
process; a class that cannot be written down (made with ``exec()``) is not graded, and the
report says why. In a notebook the ``Report`` shows itself as a table.

Example:
    >>> from headwise.teaching import CausalAttention
    >>> grade(CausalAttention).exit_code
    0
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from torch import nn

from .report import Report, Result

__all__ = ["Report", "Result", "grade"]

FILES = (".py", ".ipynb")


def grade(path_or_class: str | Path | type | list[type], classes: list[str] | None = None, timeout: float = 30.0) -> Report:
    """Grade a learner's file (``.py`` or ``.ipynb``), module path, class or list of classes, in a separate process.

    Args:
        path_or_class: a ``.py`` file, a ``.ipynb`` notebook, a module path, a class or a list of
            classes. Classes written in a notebook cell (or in the running script) are written down
            as they are now, with the modules, functions, classes and constants of the notebook they use.
        classes: for a file or module: names of the classes to grade (default: those named
            like the book's); a name that is not a book name is graded as the book class its
            signature fits. Not used with class objects.
        timeout: seconds the file's import (a notebook's cells), and each class, may take before they are stopped.

    Returns:
        A ``Report``: one ``Result`` per class; ``exit_code`` 0 all passed, 1 one failed,
        2 nothing graded (``problem`` says why, e.g. "cannot grade NAME: ..." for a class that
        cannot be written down).
    """
    if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if classes is not None and (isinstance(classes, str) or not all(isinstance(c, str) for c in classes)):
        raise TypeError(f"classes must be a list of class names (str), got {classes!r}")
    if classes is not None:
        classes = list(dict.fromkeys(classes))  # a name given twice is graded once
    if isinstance(path_or_class, type) or (isinstance(path_or_class, (list, tuple)) and path_or_class):
        objects = [path_or_class] if isinstance(path_or_class, type) else list(path_or_class)
        if not all(isinstance(c, type) for c in objects):
            raise TypeError(f"a list to grade must hold classes, got {[type(c).__name__ for c in objects]}")
        if not all(issubclass(c, nn.Module) and c is not nn.Module for c in objects):
            bad = [c.__name__ for c in objects if not issubclass(c, nn.Module) or c is nn.Module]
            raise TypeError(f"grade takes your attention classes, subclasses of torch.nn.Module (class MultiHeadAttention(nn.Module): ...), "
                            f"got {', '.join(bad)}")
        if classes is not None:
            raise TypeError("classes names classes in a file or module; with class objects, pass the classes themselves")
        return _grade_classes(objects, timeout)
    if not isinstance(path_or_class, (str, Path)):
        empty = " (an empty one: nothing to grade)" if isinstance(path_or_class, (list, tuple)) else ""
        raise TypeError(f"path_or_class must be a file path, a module path, a class or a list of classes, got {type(path_or_class).__name__}{empty}")
    target = str(path_or_class)
    if not target.strip():
        raise ValueError(f"path_or_class must name a file (.py or .ipynb), a folder or a module, got {target!r}")
    if target.endswith(FILES) and not Path(target).is_file():
        return Report(target, problem=f"no such file: {target}")
    from .runner import grade_file

    return grade_file(target, classes, timeout)


def _grade_classes(objects: list[type], timeout: float) -> Report:
    """Write the classes as a notebook, one cell per definition at its own line numbers, and grade that."""
    from . import notebook
    from .runner import grade_file
    from .source import SourceError, carried, explain_name_error, origin

    names = [c.__name__ for c in objects]
    label = f"<class {names[0]}>" if len(names) == 1 else f"<classes {', '.join(names)}>"
    try:
        pieces, left_behind = carried(objects)
    except SourceError as e:
        return Report(label, problem=str(e))
    cells = [notebook.Cell(origin(p.filename), "\n" * (p.line - 1) + p.text) for p in pieces]
    with tempfile.TemporaryDirectory(prefix="headwise-classes-") as folder:
        path = Path(folder, "classes.ipynb")
        notebook.write(cells, path)
        report = grade_file(str(path), names, timeout, label=label)
    report.problem = explain_name_error(report.problem, left_behind)
    for r in report.results:
        r.error = explain_name_error(r.error, left_behind)
    return report
