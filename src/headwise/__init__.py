"""headwise: multi-head attention, from the book's lesson to a fast drop-in layer.

``import headwise as hw`` loads torch and the core alone. The learner's tools are one attribute
away: ``hw.grade(MyMultiHeadAttention)``, ``hw.explain()``, ``hw.heads()``. The larger parts
load on first use, as attributes: ``hw.models``, ``hw.hf``, ``hw.viz``, ``hw.bench``,
``hw.parallel``, ``hw.quantize``, ``hw.rope``; a part whose optional packages are missing
names the extra to install when it is used.

``hw.grade`` and ``hw.explain`` are the functions, as ``hw.observe`` is; their modules keep their
names: ``from headwise.grade import grade, Report``, ``from headwise.explain import BOOK_TOKENS``
(``import headwise.grade as g`` reads the package's attribute, so it binds the function too).

Example:
    >>> import headwise as hw
    >>> hw.explain().steps[6].tensors["scores"].shape  # (B, H, T, T): the book's six tokens, two heads
    torch.Size([1, 2, 6, 6])
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# `explain` and `grade` are also module names: each module is imported before its function takes
# the package's attribute, so a later `import headwise.grade` finds it loaded and leaves the name alone.
from .cache import KVCache, PagedKVCache
from .config import GPT2Config
from .convert import gpt2_attention_from_hf, gpt2_to_mha, mha_to_gpt2, wrapper_to_mha
from .explain import explain
from .functional import Plan, attention, attention_weights, plan
from .fused import GPT2MultiHeadAttention
from .grade import grade
from .layer import ContextCache
from .masks import causal_mask
from .observe import observe
from .teaching import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper

if TYPE_CHECKING:  # what the lazy attributes below are, for type checkers and editors
    from . import bench, hf, models, parallel, quantize, rope, viz  # noqa: F401
    from .viz import heads

__version__ = "0.1.0"

#: Parts loaded on first use (`hw.models`, ...): they pull in more code, or optional packages.
SUBMODULES = ("bench", "hf", "models", "parallel", "quantize", "rope", "viz")
#: Functions loaded on first use, with the module that defines them.
LAZY_FUNCTIONS = {"heads": "viz"}

__all__ = [
    "CausalAttention",
    "ContextCache",
    "GPT2Config",
    "GPT2MultiHeadAttention",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "PagedKVCache",
    "Plan",
    "attention",
    "attention_weights",
    "causal_mask",
    "explain",
    "gpt2_attention_from_hf",
    "gpt2_to_mha",
    "grade",
    "heads",
    "mha_to_gpt2",
    "observe",
    "plan",
    "wrapper_to_mha",
]


def __getattr__(name: str) -> Any:
    """Load a part (``hw.models``) or a function (``hw.heads``) the first time it is asked for."""
    if name in SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in LAZY_FUNCTIONS:
        value = getattr(importlib.import_module(f".{LAZY_FUNCTIONS[name]}", __name__), name)
    else:  # AttributeError, not ImportError: `from headwise import demo` then imports the submodule
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *SUBMODULES, *LAZY_FUNCTIONS})
