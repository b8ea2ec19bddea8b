"""A small decoder-only transformer (random init, CPU) that attends through an explicit mask:
enough to prove that training on tree batches equals training on flat sequences."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def masked_attention(mask: torch.Tensor) -> Attend:
    """Attention of q, k, v [H, T, d] in which row i sees row j iff mask[i, j] (explicit)."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    return attend


class Block(nn.Module):
    """Pre-norm attention + MLP; the attention itself is a function of q, k, v."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (tokens, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(0, 1) for t in (q, k, v))
        mixed = attend(q, k, v).transpose(0, 1).reshape(tokens, width)
        x = x + self.out(mixed)
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token + learned position embeddings, a few blocks, a vocabulary head."""

    def __init__(
        self, vocab: int, width: int = 32, heads: int = 2, layers: int = 2, positions: int = 4096
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Logits [T, vocab]; row i may see row j iff mask[i, j]."""
        return self.forward_with(ids, positions, masked_attention(mask))

    def forward_with(self, ids: torch.Tensor, positions: torch.Tensor, attend: Attend):
        """Logits [T, vocab], every block attending through `attend(q, k, v)`."""
        x = self.tokens(ids) + self.positions(positions)
        for block in self.blocks:
            x = block(x, attend)
        return self.head(self.norm(x))


def token_logprobs(model: TinyLM, tensors: dict) -> torch.Tensor:
    """Each token's log-prob under the model, read from its parent's row (0 at a root)."""
    logits = model(tensors["input_ids"], tensors["position_ids"], tensors["attention_mask"])
    logp = logits.log_softmax(-1)
    parent = tensors["parent"]
    rows = parent.clamp(min=0)
    picked = logp[rows, tensors["input_ids"]]
    return torch.where(parent >= 0, picked, torch.zeros_like(picked))


def forward_by_path(model: TinyLM, tensors: dict, starts: list[int]) -> torch.Tensor:
    """The same logits as `model(...)` with the ancestor mask, computed sparsely: each step's
    own tokens (its path after `start`, the depth where it left its parent) attend only to its
    path. Attention work is then sum(own x path), not (tree tokens)^2."""
    paths = tensors["step_token_index"]
    pieces = [(path, path[start:], start) for path, start in zip(paths, starts, strict=True)]
    pieces = [p for p in pieces if len(p[1])]

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        mixed = torch.zeros_like(q)
        for path, own, start in pieces:
            visible = torch.ones(len(own), len(path), dtype=torch.bool).tril(start)
            seen = masked_attention(visible)(q[:, own], k[:, path], v[:, path])
            mixed = mixed.index_copy(1, own, seen)
        return mixed

    return model.forward_with(tensors["input_ids"], tensors["position_ids"], attend)
