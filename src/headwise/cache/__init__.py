"""Key/value caches, read by the core through one protocol (``protocol.py``): ``KVCache`` (static.py),
``PagedKVCache`` and its ``batch(...)`` (paged.py, paged_batch.py), cross-attention's ``ContextCache`` (context.py)."""

from .context import ContextCache
from .paged import PagedBatch, PagedKVCache
from .protocol import Attended, Cache
from .static import KVCache

__all__ = ["Attended", "Cache", "ContextCache", "KVCache", "PagedBatch", "PagedKVCache", "checked"]


def checked(cache: object) -> Cache | None:
    """``cache`` if it is a cache the core reads (or None), else a TypeError naming what came."""
    if cache is None or isinstance(cache, (KVCache, PagedBatch)):
        return cache
    hint = ": pass paged.batch(seq_ids, new_tokens), which says whose tokens the row holds" if isinstance(cache, PagedKVCache) else ""
    raise TypeError(f"cache must be a headwise.KVCache, a PagedKVCache.batch(...) or None, got {type(cache).__name__}{hint}")
