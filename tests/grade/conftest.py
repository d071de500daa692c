"""The learner files are inputs to grade, not test modules: pytest (and its doctest collector) leaves them alone.

``notebook`` runs cells as a Jupyter kernel would: IPython compiles each cell under a file name of
its own (``/tmp/ipykernel_<pid>/<hash>.py``) and keeps the cell's text in ``linecache`` under it;
``notebook(code)`` does the same here, in one namespace named ``__main__`` as a kernel's is.
(tests/test_notebook.py runs a real kernel.)
"""

from __future__ import annotations

import linecache

import pytest

collect_ignore_glob = ["learners/*"]


@pytest.fixture
def notebook():
    """``notebook(code)`` runs one more cell in the same namespace and returns the namespace."""
    namespace: dict = {"__name__": "__main__"}
    names: list[str] = []

    def cell(code: str) -> dict:
        filename = f"/tmp/ipykernel_0/{len(names) + 1000}.py"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        names.append(filename)
        exec(compile(code, filename, "exec"), namespace)
        return namespace

    yield cell
    for filename in names:
        linecache.cache.pop(filename, None)
