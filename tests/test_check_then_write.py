"""A refused attention call changes no cache: every argument is checked before the cache's write.

Every argument ``attention`` refuses, against every kind of cache it writes (a ``KVCache``, a
sliding one, a ``PagedKVCache`` batch): the error names the argument, the cache holds what it
held, and it still takes the next good call.
"""

from __future__ import annotations

import math

import pytest
import torch

import headwise as hw

D = 8


def _qkv(T: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 4, T, D, generator=g).to(dtype), torch.randn(1, 2, T, D, generator=g).to(dtype), torch.randn(1, 2, T, D, generator=g).to(dtype)


#: name: (keyword arguments of the refused call, error, match)
REFUSED = {
    "softcap": ({"softcap": -1.0}, ValueError, r"softcap must be a number"),
    "softcap beyond the range": ({"softcap": 1e31}, ValueError, r"softcap must be a number in \[1e-06, 1e\+30\]"),
    "sinks shape": ({"sinks": torch.zeros(3)}, ValueError, r"sinks must have shape \(H=4,\)"),
    "sinks values": ({"sinks": torch.tensor([0.0, math.nan, 0.0, 0.0])}, ValueError, r"sinks must hold finite numbers or -inf"),
    "alibi_slopes values": ({"alibi_slopes": torch.full((4,), math.inf)}, ValueError, r"alibi_slopes must hold finite numbers"),
    "alibi_slopes shape": ({"alibi_slopes": torch.ones(5)}, ValueError, r"alibi_slopes must have shape"),
    "mask shape": ({"mask": torch.ones(7, 7, dtype=torch.bool)}, ValueError, r"mask"),
    "mask values": ({"mask": torch.full((1, 1), math.nan)}, ValueError, r"mask"),
    "documents": ({"documents": torch.zeros(1, 30)}, (TypeError, ValueError), r"documents"),
    "attention_mask": ({"attention_mask": torch.full((1, 2), 2)}, ValueError, r"attention_mask|paged"),
    "dropout_p": ({"dropout_p": 1.5}, ValueError, r"dropout_p must be a number in \[0, 1\]"),
    "scale": ({"scale": -1.0}, ValueError, r"scale must be a positive finite number"),
    "backend": ({"backend": "fast"}, ValueError, r"backend must be one of"),
    "causal": ({"causal": "yes"}, TypeError, r"causal must be True or False"),
    "window": ({"window": 0}, ValueError, r"window must be a positive int"),
    "keys of another dtype": ({"k": torch.zeros(1, 2, 2, D, dtype=torch.float64)}, TypeError, r"q and k must share one dtype"),
    "keys of another batch": ({"k": torch.zeros(2, 2, 2, D), "v": torch.zeros(2, 2, 2, D)}, ValueError, r"k must have shape"),
}


class Kind:
    """A cache with a 5-token prefix: ``call(**kwargs)`` attends 2 new tokens through it; ``state()`` is all it holds."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        if kind == "paged":
            self.cache = hw.PagedKVCache(num_blocks=8, block_size=2, num_kv_heads=2, head_dim=D)
            self.cache.add(0)
        else:
            self.cache = hw.KVCache.sliding(1, 2, 4, D) if kind == "ring" else hw.KVCache(1, 2, 32, D)
        self.call(*_qkv(5))

    def where(self, T: int):
        return self.cache.batch([0], [T]) if self.kind == "paged" else self.cache

    def call(self, q, k, v, **kwargs):
        terms = {"causal": True} | ({"window": 4} if self.kind == "ring" else {}) | kwargs
        return hw.attention(q, k, v, cache=self.where(q.shape[2]), **terms)

    def state(self) -> list:
        c = self.cache
        if self.kind == "paged":
            return [c.length(0), c.blocks(0), c.free_blocks, c.k.clone(), c.v.clone()]
        return [len(c), c.k.clone(), c.v.clone(), c.is_token.clone(), c._padded]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kind", ["kv", "ring", "paged"])
@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_call_leaves_every_kind_of_cache_as_it_was(kind, case):
    cache = Kind(kind)
    before = cache.state()
    kwargs, error, match = REFUSED[case]
    q, k, v = _qkv(2, seed=1)
    kwargs = dict(kwargs)
    k, v = kwargs.pop("k", k), kwargs.pop("v", v)
    if "k" in REFUSED[case][0] and "v" not in REFUSED[case][0]:
        v = k
    with pytest.raises(error, match=match):
        cache.call(q, k, v, **kwargs)
    assert _same(before, cache.state()), case
    cache.call(*_qkv(2, seed=2))  # and it takes the next good call
    assert cache.state()[0] == 7
