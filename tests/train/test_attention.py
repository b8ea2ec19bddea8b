"""FlexAttention on tree batches: the BlockMask built from the O(T) intervals is the ancestor
mask, and flex attention through it equals SDPA with the dense mask (forward: CPU flex has
no backward)."""

from __future__ import annotations

import numpy as np
import pytest

from claw_pipelines.consume.dataset import open_dataset, subtree_ends
from claw_pipelines.train.attention import tile_masks, tree_block_mask
from tests.support.trees import ancestors_brute_force, random_forest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")
# eager flex (small T here) materializes scores; trainers compile it
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("n", [5, 128, 300, 700])
def test_block_tiles_match_the_dense_mask(n):
    rng = np.random.default_rng(n)
    parent = random_forest(n, rng)
    dense = ancestors_brute_force(parent)
    partial, full = tile_masks(subtree_ends(parent), block=32)
    blocks = partial.shape[0]
    padded = np.zeros((blocks * 32, blocks * 32), bool)
    padded[:n, :n] = dense
    tiles = padded.reshape(blocks, 32, blocks, 32)
    any_set = tiles.any(axis=(1, 3))
    real = np.zeros_like(padded)
    real[:n, :n] = True
    all_set = (tiles | ~real.reshape(blocks, 32, blocks, 32)).all(axis=(1, 3)) & any_set
    assert ((partial | full) == any_set).all()
    assert (full <= all_set).all()  # a tile called full is full; partial ones get mask_mod
    mask = tree_block_mask(subtree_ends(parent), block=32)
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    assert (mask.mask_mod(0, 0, q, k).numpy() == dense).all()


def test_flex_attention_through_the_tree_mask_equals_sdpa_with_the_dense_mask():
    rng = np.random.default_rng(7)
    parent = random_forest(333, rng)  # not a multiple of the block size
    end = subtree_ends(parent)
    dense = torch.from_numpy(ancestors_brute_force(parent))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, len(parent), 16) for _ in range(3))
    out = flex.flex_attention(q, k, v, block_mask=tree_block_mask(end, block=64))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_a_gold_tree_batch_feeds_flex_attention(lake):
    batch = next(open_dataset("train", lake.uri).batches(1, 9, layout="tree"))
    tensors = batch.to_torch(dense_mask=True)
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, batch.num_tokens, 16) for _ in range(3))
    out = flex.flex_attention(q, k, v, block_mask=tree_block_mask(tensors["subtree_end"]))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=tensors["attention_mask"]
    )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
