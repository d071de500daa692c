"""Key/value caches for incremental decoding, all read by the core through one protocol (protocol.py).

- ``KVCache`` (static.py): preallocated (B, Hkv, max_len, D) buffers written in place, one row
  per sequence, or a ring buffer for sliding windows.
- ``PagedKVCache`` (paged.py): one pool of fixed-size blocks shared by many sequences of any
  lengths, a block table per sequence, copy-on-write forks; ``paged.batch(seq_ids, new_tokens)``
  is what ``attention`` takes for a row that packs several sequences' new tokens.
- ``ContextCache`` (context.py): cross-attention's keys and values of a context, projected once
  (the layer reads it; ``attention`` takes its keys directly).
"""

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
