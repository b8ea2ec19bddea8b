"""Tree attention for trainers: a FlexAttention `BlockMask` built from a batch's O(T) mask
description, never from a T×T grid (torch: the `train` extra).

In depth-first order token k is an ancestor-or-self of q exactly when
`k <= q < subtree_end[k]`. A (query block, key block) tile of the BlockMask is partial when
some key's interval `[k, subtree_end[k])` reaches into the query block, and full when every
key of the block precedes the whole query block and every key's interval covers it. Memory
is O(T + (T/block)²): 16k tokens in 128-token blocks is a 128×128 tile grid.

```python
from torch.nn.attention.flex_attention import flex_attention
mask = tree_block_mask(batch.subtree_end)          # or to_torch()["subtree_end"]
out = flex_attention(q, k, v, block_mask=mask)     # q, k, v: [1, heads, T, dim]
```
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK_SIZE = 128


def tile_masks(subtree_end: np.ndarray, block: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Bool [q blocks, kv blocks] grids: tiles with any allowed pair, and tiles all allowed."""
    end = np.asarray(subtree_end, dtype=np.int64)
    total = len(end)
    blocks = -(-total // block)
    keys = np.arange(total)
    kv_block = keys // block
    first_q, last_q = keys // block, (end - 1) // block  # query blocks each key's interval hits
    reach = np.zeros((blocks, blocks + 1), dtype=np.int32)  # per kv block: difference array
    np.add.at(reach, (kv_block, first_q), 1)
    np.add.at(reach, (kv_block, last_q + 1), -1)
    any_allowed = (np.cumsum(reach, axis=1)[:, :blocks] > 0).T  # [q block, kv block]
    starts = np.arange(blocks) * block
    q_first, q_last = starts, np.minimum(starts + block, total) - 1
    k_last = np.minimum(starts + block, total) - 1
    min_end = np.minimum.reduceat(end, starts)
    full = (q_first[:, None] >= k_last[None, :]) & (q_last[:, None] < min_end[None, :])
    return any_allowed & ~full, full


def _indices(tiles: np.ndarray) -> tuple[Any, Any]:
    """BlockMask's (num_blocks [1,1,Q], indices [1,1,Q,KV]) of a tile grid."""
    import torch

    counts = tiles.sum(axis=1)
    order = np.argsort(~tiles, axis=1, kind="stable")  # the set tiles first, in kv order
    return (
        torch.from_numpy(counts.astype(np.int32))[None, None],
        torch.from_numpy(order.astype(np.int32))[None, None],
    )


def tree_block_mask(subtree_end: Any, block: int = BLOCK_SIZE) -> Any:
    """A FlexAttention BlockMask in which each token attends to its ancestors-or-self."""
    try:
        import torch
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        raise ImportError(
            "tree_block_mask needs torch: pip install 'claw-lakehouse[train]'"
        ) from None
    end_np = np.asarray(subtree_end.cpu() if hasattr(subtree_end, "cpu") else subtree_end)
    total = len(end_np)
    partial, full = tile_masks(end_np, block)
    padded = np.zeros(partial.shape[0] * block, dtype=np.int64)  # keys past T attend nothing
    padded[:total] = end_np
    ends = torch.from_numpy(padded)

    def ancestor_or_self(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    kv_num, kv_idx = _indices(partial)
    full_num, full_idx = _indices(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block,
        mask_mod=ancestor_or_self,
        seq_lengths=(total, total),
    )
