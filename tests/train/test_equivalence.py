"""Training on tree batches equals training on flat sequences, with a real (small) torch
transformer: the same response-token log-probs and the same parameter gradients."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.support.lakes import EQUIVALENCE_VOCAB as VOCAB  # noqa: E402
from tests.support.tiny_transformer import TinyLM, forward_by_path, token_logprobs  # noqa: E402


def flat_logprobs(model, tensors, index) -> torch.Tensor:
    """One step on its own: its sequence with a causal mask."""
    n = len(index)
    alone = {
        "input_ids": tensors["input_ids"][index],
        "position_ids": torch.arange(n),
        "parent": torch.arange(n) - 1,
        "attention_mask": torch.ones(n, n, dtype=torch.bool).tril(),
    }
    return token_logprobs(model, alone)


def test_tree_batch_gives_the_flat_logprobs_and_gradients(dataset):
    torch.manual_seed(0)
    model = TinyLM(VOCAB).float()
    steps = {r["step_key"]: r for r in dataset.steps(1).to_dicts()}
    tree = next(dataset.batches(1, batch_size=100, layout="tree"))
    flat = next(dataset.batches(1, batch_size=100, layout="flat"))
    assert tree.step_keys == flat.step_keys and len(tree.step_keys) == 16
    assert tree.num_tokens < flat.num_tokens
    shared = np.bincount(
        np.concatenate(
            [
                i[steps[k]["prompt_len"] :]
                for k, i in zip(tree.step_keys, tree.step_token_index, strict=True)
            ]
        )
    )
    assert (shared > 1).any()  # some response tokens belong to two steps
    tree_t, flat_t = tree.to_torch(dense_mask=True), flat.to_torch(dense_mask=True)

    # log-probs: one forward over the tree vs each step alone
    tree_lp = token_logprobs(model, tree_t)
    worst = 0.0
    for key, t_index, f_index in zip(
        tree.step_keys, tree_t["step_token_index"], flat_t["step_token_index"], strict=True
    ):
        start = steps[key]["prompt_len"]
        alone = flat_logprobs(model, flat_t, f_index)
        worst = max(worst, (tree_lp[t_index][start:] - alone[start:]).abs().max().item())
    assert worst <= 1e-4

    # gradients: the loss summed over steps, both ways
    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        loss.backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    flat_loss = 0.0
    for key, f_index in zip(flat.step_keys, flat_t["step_token_index"], strict=True):
        start, advantage = steps[key]["prompt_len"], steps[key]["advantage"]
        flat_loss = flat_loss - advantage * flat_logprobs(model, flat_t, f_index)[start:].sum()
    flat_grads = grads(flat_loss)
    tree_loss = -(tree_t["advantages"] * token_logprobs(model, tree_t)).sum()
    tree_grads = grads(tree_loss)
    assert tree_loss.item() == pytest.approx(flat_loss.item(), rel=1e-4)
    for a, b in zip(tree_grads, flat_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_path_sparse_attention_gives_the_dense_tree_logits(dataset):
    """The efficient form a trainer would run (each step's own tokens attend to its path
    only) computes the same logits as one dense forward with the ancestor mask."""
    torch.manual_seed(1)
    model = TinyLM(VOCAB).float()
    tree = next(dataset.batches(1, batch_size=100, layout="tree"))
    tensors = tree.to_torch(dense_mask=True)
    starts = [int(s) for s in tree.step_starts]
    dense = model(tensors["input_ids"], tensors["position_ids"], tensors["attention_mask"])
    sparse = forward_by_path(model, tensors, starts)
    torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-5)
