"""Key/value caches for incremental decoding.

``KVCache`` (static.py): preallocated (B, Hkv, max_len, D) buffers written in place, one row per
sequence, or a ring buffer for sliding windows.
"""

from .static import KVCache

__all__ = ["KVCache"]
