"""``AllOrNothing``: the mixin that makes a module's strict ``load_state_dict`` all-or-nothing.

torch's ``nn.Module.load_state_dict(state, strict=True)`` copies every entry that fits before it raises about the
ones that do not, so a refused state dict leaves the module half loaded. headwise's modules (the book's classes,
the attention layers, the models) check the whole state dict first (``headwise.convert.check_loadable``: every key,
shape and integer-for-float, the book's ``mask`` accepted) and raise ``headwise.convert.StateDictError`` naming every
problem before anything is copied. ``strict=False`` keeps torch's rules, and so does a module any of whose modules
carries a load hook that may turn the incoming entries into others (a sharded model's: ``headwise.parallel``); hooks
that only accept entries the check knows are marked with ``keeps_keys``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

_KEY_KEEPING: set[Callable] = set()


def keeps_keys(hook: Callable) -> Callable:
    """Mark a load_state_dict pre-hook that turns no entry into another (the book's ``mask``: accepted, dropped)."""
    _KEY_KEEPING.add(hook)
    return hook


def _checkable(module: nn.Module) -> bool:
    """Whether every load pre-hook of ``module`` and its modules is one ``keeps_keys`` marked."""
    return all(getattr(h, "hook", h) in _KEY_KEEPING for m in module.modules() for h in m._load_state_dict_pre_hooks.values())


class AllOrNothing:
    """Mixin for an ``nn.Module``: ``load_state_dict`` checks the whole state dict first when strict (module docstring)."""

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """torch's ``load_state_dict``, all-or-nothing when ``strict``: ``headwise.convert.StateDictError`` (a ValueError
        and a RuntimeError, as torch raises) names every missing, unexpected, mis-shaped or integer-for-float entry
        before any tensor is copied (torch's own load copies the entries that fit first)."""
        if strict and _checkable(self):
            from .convert import check_loadable  # (convert imports the modules this serves)

            check_loadable(self, state_dict)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)
