"""Optional dependencies: imported where a feature needs them, with one clear message if missing."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` or raise ModuleNotFoundError naming the extra that installs it.

    Example:
        >>> require("math", "models", "reading checkpoints").sqrt(4.0)
        2.0
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or module.split(".")[0] != e.name.split(".")[0]:
            raise  # a dependency of the module itself is broken: show that error
        raise ModuleNotFoundError(
            f"{feature} needs the package '{module.split('.')[0]}', which is not installed: pip install 'headwise[{extra}]'",
            name=e.name,
        ) from None
