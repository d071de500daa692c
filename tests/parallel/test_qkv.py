"""qkv_rows: the row order that gives each rank its own heads of a fused [q | k | v] projection."""

import pytest
import torch

pytest.importorskip("torch.distributed.tensor")

from headwise.parallel import qkv_rows


def by_head(num_heads: int, num_kv_heads: int, head_dim: int, world: int) -> list[int]:
    """The same order spelled head by head."""
    rows = []
    for r in range(world):
        q_heads = range(r * num_heads // world, (r + 1) * num_heads // world)
        kv_heads = range(r * num_kv_heads // world, (r + 1) * num_kv_heads // world)
        rows += [h * head_dim + i for h in q_heads for i in range(head_dim)]
        rows += [(num_heads + j) * head_dim + i for j in kv_heads for i in range(head_dim)]
        rows += [(num_heads + num_kv_heads + j) * head_dim + i for j in kv_heads for i in range(head_dim)]
    return rows


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "world"), [(12, 12, 64, 2), (12, 4, 8, 2), (8, 2, 4, 2), (12, 12, 2, 4), (4, 4, 3, 1)])
def test_qkv_rows_gives_each_rank_whole_heads(heads, kv_heads, head_dim, world):
    rows = qkv_rows(heads, kv_heads, head_dim, world)
    assert rows.tolist() == by_head(heads, kv_heads, head_dim, world)
    assert torch.equal(rows.sort().values, torch.arange((heads + 2 * kv_heads) * head_dim))  # a permutation
