"""Block-sparse tree attention (the CPU training path): forward and gradients equal SDPA with
the dense ancestor mask, on random forests, with grouped-query heads and any block size."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from claw_pipelines.consume.dataset import subtree_ends  # noqa: E402
from claw_pipelines.train.block_attention import tree_attention, tree_plan  # noqa: E402
from tests.support.trees import ancestors_brute_force, random_forest  # noqa: E402


@pytest.mark.parametrize(
    ("n", "block", "heads", "kv_heads"), [(7, 4, 2, 2), (300, 32, 4, 2), (700, 64, 4, 1)]
)
@pytest.mark.parametrize("kernel", ["flash", "matmul"])
def test_tree_attention_and_its_gradients_equal_dense_sdpa(n, block, heads, kv_heads, kernel):
    rng = np.random.default_rng(n)
    parent = random_forest(n, rng)
    plan = tree_plan(subtree_ends(parent), block=block)
    torch.manual_seed(n)
    q = torch.randn(heads, n, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kv_heads, n, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kv_heads, n, 16, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(heads, n, 16, dtype=torch.float64)

    out = tree_attention(q, k, v, plan, kernel=kernel)
    grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))

    mask = torch.from_numpy(ancestors_brute_force(parent))
    groups = heads // kv_heads
    dense = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0), attn_mask=mask
    )
    expected = torch.autograd.grad((dense * upstream).sum(), (q, k, v))
    torch.testing.assert_close(out, dense)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)
    assert plan.pairs_computed() < n * n or n < 3 * block  # tiles skipped, not a dense sweep
