"""Grade a learner's own attention classes against the book's, step by step, by their numbers.

``grade("my_attention.py")`` loads the file in a separate process with a time limit, finds
the classes named like the book's (``CausalAttention``, ``MultiHeadAttentionWrapper``,
``MultiHeadAttention``), builds each with the book's positional signature and weights, runs
the book's batch and a few random configurations in eval mode, and records every tensor the
learner's forward computes. A class passes when its output matches the book's class; else
the report names the first step of the book's forward it never produced, what was expected
and what came closest, and a hint when its numbers match a known mistake's.

Example:
    >>> from headwise.teaching import CausalAttention
    >>> grade(CausalAttention).exit_code
    0
"""

from __future__ import annotations

from pathlib import Path

from .check import grade_class
from .report import Report, Result

__all__ = ["Report", "Result", "grade"]


def grade(path_or_class: str | Path | type, classes: list[str] | None = None, timeout: float = 30.0) -> Report:
    """Grade a learner's file, module path or class.

    Args:
        path_or_class: a ``.py`` file or a module path (graded in a subprocess, stopped after
            ``timeout`` seconds for the import and for each class), or a class object (graded in this process, no
            time limit: use a file for code that may hang).
        classes: names of the classes to grade (default: those named like the book's); a name
            that is not a book name is graded as the book class its signature fits.
        timeout: seconds the file's import, and each class, may take before they are stopped.

    Returns:
        A ``Report``: one ``Result`` per class; ``exit_code`` 0 all passed, 1 one failed,
        2 nothing graded (``problem`` says why).
    """
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    if classes is not None and (isinstance(classes, str) or not all(isinstance(c, str) for c in classes)):
        raise TypeError(f"classes must be a list of class names (str), got {classes!r}")
    if isinstance(path_or_class, type):
        return Report(f"<class {path_or_class.__qualname__}>", [grade_class(path_or_class)])
    if not isinstance(path_or_class, (str, Path)):
        raise TypeError(f"path_or_class must be a file path, a module path or a class, got {type(path_or_class).__name__}")
    target = str(path_or_class)
    if target.endswith(".py") and not Path(target).is_file():
        return Report(target, problem=f"no such file: {target}")
    from .runner import grade_file

    return grade_file(target, classes, timeout)
