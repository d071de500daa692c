"""The package's layering (ARCHITECTURE.md): each file imports only from the layers below it.

Read from the source with ``ast`` (nothing is imported), so a new upward import fails here
before it makes a cycle or couples the core to a feature.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "headwise"

#: Lowest first. A module may import from its own layer's modules and from any layer below.
LAYERS: list[set[str]] = [
    {"_checks", "_optional", "_html", "_text", "_argtypes", "machine", "native", "observe", "linear", "quantize", "loadable"},  # no headwise imports, the machine facts, the C++ library, or the checkers (quantize: linear's bound)
    {"masks", "cache", "rope", "config", "scores"},  # data structures and small functions
    {"backends"},  # the runners behind attention(): math, sdpa, packed documents
    {"arguments", "functional"},  # the core: attention()'s arguments checked, then its one path (the cache, the plan)
    {"layer"},  # the one attention path
    {"teaching", "fused"},  # the book's classes, GPT-2's layout
    {"convert", "explain", "models", "hf"},  # conversions and loading, explaining, whole models, the transformers adapter
    {"explain_rope", "viz", "grade", "bench", "parallel"},  # features built on models
    {"demo", "cli", "__init__", "__main__"},  # entry points
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}
#: The same rule one level down, inside a package: its modules, lowest first.
INSIDE: dict[str, list[set[str]]] = {
    "linear": [{"weight_cache", "panels"}, {"onednn"}, {"rule"}, {"projection"}, {"custom_ops"}, {"__init__"}],
}


def _top(path: Path) -> str:
    """The first component under src/headwise of a file: ``models/gpt2.py`` -> ``models``."""
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _imports(path: Path, source: str | None = None) -> set[str]:
    """The headwise top-level modules a file imports, every spelling: ``from .x import``, ``from . import x``,
    ``from .. import x`` (resolved against the file's package), ``from headwise.x import``, ``from headwise
    import x``, ``import headwise.x``. ``import headwise`` alone reaches no module (the package is loaded before
    any of its files; the grader imports it for its path)."""
    package = path.relative_to(SRC).parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8") if source is None else source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)]
            targets = [*base, *node.module.split(".")] if node.module else [*base]
            if targets:
                found.add(targets[0])
            else:  # "from . import x" at the top: x is the module
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "headwise":
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("headwise."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "headwise" and len(parts) > 1:
                    found.add(parts[1])
    return found


FILES = sorted(p for p in SRC.rglob("*.py"))


def test_every_top_level_module_has_a_layer():
    tops = {_top(p) for p in FILES}
    assert tops - LEVEL.keys() == set(), "add the new module to LAYERS (and to ARCHITECTURE.md)"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path):
    me = _top(path)
    upward = {name for name in _imports(path) - {me} if LEVEL.get(name, -1) > LEVEL[me]}
    assert upward == set(), f"{path.relative_to(SRC)} (layer {LEVEL[me]}) imports {upward} from above"


@pytest.mark.parametrize("package", INSIDE)
def test_imports_inside_a_package_point_down(package):
    level = {name: i for i, layer in enumerate(INSIDE[package]) for name in layer}
    files = sorted((SRC / package).glob("*.py"))
    assert {f.stem for f in files} == set(level), f"add the new module of {package}/ to INSIDE"
    for path in files:
        siblings = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                siblings.update([node.module.split(".")[0]] if node.module else [alias.name for alias in node.names])
        upward = {name for name in siblings - {path.stem} if level[name] > level[path.stem]}
        assert upward == set(), f"{package}/{path.name} imports {upward} from above"


def test_the_cache_does_not_reach_into_the_core():
    for path in (SRC / "cache").rglob("*.py"):
        assert "functional" not in _imports(path), path.name


@pytest.mark.parametrize(
    ("where", "source"),
    [
        ("masks.py", "import headwise.cli"),
        ("masks.py", "import headwise.cli as c"),
        ("masks.py", "from headwise import cli"),
        ("masks.py", "from headwise.cli import main"),
        ("masks.py", "from . import cli"),
        ("masks.py", "from .cli import main"),
        ("masks.py", "def f():\n    from . import cli"),
        ("models/llama.py", "from .. import cli"),
        ("models/llama.py", "from ..cli import main"),
        ("models/llama.py", "import headwise.cli.x"),
    ],
)
def test_every_spelling_of_an_upward_import_is_seen(where, source):
    """The reader catches an upward import however it is written (masks is layer 1, models 5, cli 7)."""
    path = SRC / where
    imported = _imports(path, source)
    assert "cli" in imported
    assert {name for name in imported if LEVEL.get(name, -1) > LEVEL[_top(path)]}
