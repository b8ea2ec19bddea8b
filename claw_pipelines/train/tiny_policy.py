"""The demo's policy: token embeddings and a vocabulary head, trained from tree batches with a
policy-gradient step (`claw demo --loop`: proof that the lake's batches train something)."""

from __future__ import annotations

from claw_pipelines.consume.dataset import Batch

VOCAB = 4096  # the bundled tokenizer's ids lie below this (larger ids are folded in)


class TinyPolicy:
    """Token embeddings and a vocabulary head, trained with a policy-gradient step."""

    def __init__(self, seed: int = 0, vocab: int = VOCAB) -> None:
        import torch

        torch.manual_seed(seed)
        self.torch = torch
        self.embed = torch.nn.Embedding(vocab, 32)
        self.head = torch.nn.Linear(32, vocab)
        parameters = [*self.embed.parameters(), *self.head.parameters()]
        self.optimizer = torch.optim.SGD(parameters, lr=0.05)

    def step(self, batch: Batch) -> float:
        """One update on a tree batch: -sum(advantage * log p(token | parent)) over the
        trained tokens; returns the loss."""
        t = batch.to_torch()
        ids = t["input_ids"] % self.embed.num_embeddings
        logits = self.head(self.embed(ids))
        logp = logits.log_softmax(-1)[t["parent"].clamp(min=0), ids]
        loss = -(t["advantages"] * logp * t["loss_mask"]).sum() / max(1, len(batch.step_keys))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())
