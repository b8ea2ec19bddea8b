"""A batch: whole trees (or their flat sequences) as numpy arrays, and its slicing out of a
packed partition (`claw_pipelines.transforms.packing` lays the steps out; `consume.source`
packs them).

A tree batch packs whole prefix trees (a trajectory or prompt group, as the dataset's spec
merged them) in depth-first order. Per token: `input_ids`, `parent` (the previous token on
its path, -1 at a root), `position_ids` (its position in its original sequence),
`loss_mask` (1 where it is a trained response token of some step), `advantages` and
`token_rewards` (summed over the steps whose response holds the token: the sum of per-step
losses is then the same on the tree as on the flat sequences), `token_policy_versions` (int32,
int64 in `to_torch()`:
the policy version that generated the token, per run for a joined partial rollout, else its
step's; -1 on prompt tokens; a spec with token-level staleness masks older response tokens
out of `loss_mask`), `behaviour_log_probs` (the log-prob the generating policy gave each
response token, as captured: the mean where several steps' responses share the token) with
`has_behaviour_log_probs` (where one was captured; 0 and False elsewhere). Per step:
`step_keys`, `step_token_index` (indices into `input_ids` of its whole sequence, in order)
and `step_prompt_lens` (its response is `step_token_index[k][step_prompt_lens[k]:]`). The
log-prob of token t is read from the logits at row `parent[t]`.

The attention mask is described in O(T): tokens are in depth-first order, so token k is an
ancestor-or-self of q exactly when `k <= q < subtree_end[k]` (`subtree_end`: one past the last
token of k's subtree; a subtree never leaves its tree block, `tree_offsets`). Dense masks are
built only when asked (`attention_mask()`, `block_attention_mask(b)`, `to_torch(dense_mask=True)`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from claw_pipelines.consume.report import ContractReport
from claw_pipelines.transforms.packing import Layout, Packed


@dataclass
class Batch:
    """One batch of whole trees (or their flat sequences); numpy arrays, see the module doc."""

    layout: Layout
    policy_version: int
    input_ids: np.ndarray
    parent: np.ndarray
    position_ids: np.ndarray
    loss_mask: np.ndarray
    token_rewards: np.ndarray
    advantages: np.ndarray
    step_keys: list[str]
    step_token_index: list[np.ndarray]
    tree_offsets: np.ndarray  # attention blocks: a tree (or, flat, a step) per block
    subtree_end: np.ndarray  # per token: one past the last token of its subtree (see module)
    step_starts: np.ndarray  # per step: the depth where its own tokens start (0 when flat)
    step_policy_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # per token: the policy version that generated it (see the module doc)
    token_policy_versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    # per token: the behaviour policy's log-prob as captured (0 where none), and where one was
    behaviour_log_probs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    has_behaviour_log_probs: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    step_prompt_lens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    groups: list[str] = field(default_factory=list)  # next_batch: the units it delivers
    uses: list[int] = field(default_factory=list)  # next_batch: each unit's use number (1: first)
    batch_index: int | None = None  # batches: its index in the plan; next_batch: in the record
    # next_batch and replay: whom it was delivered to (what `Dataset.record_feedback` keys by)
    consumer: str | None = None
    rank: int | None = None
    max_tokens: int | None = None  # the token budget it was packed to, if any
    # its contract report, or what makes it on first use (see `contract`)
    _contract: ContractReport | Callable[[], ContractReport] | None = field(
        default=None, repr=False
    )

    @property
    def contract(self) -> ContractReport | None:
        """The checks this batch satisfies (claw_pipelines.consume.report). Judged when the batch
        is made if its spec blocks on any; otherwise on first use (for `batches`: once per
        partition, about 20 ms per 3,000 steps)."""
        if callable(self._contract):
            self._contract = self._contract()
        return self._contract

    @contract.setter
    def contract(self, report: ContractReport | Callable[[], ContractReport] | None) -> None:
        self._contract = report

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch (the tree tokens, or the flat ones)."""
        return len(self.input_ids)

    def token_report(self) -> dict[str, Any]:
        """Tokens against the budget: padding to `max_tokens` (what a fixed-size buffer
        wastes), trees, the largest tree, and whether one tree alone exceeds the budget."""
        sizes = np.diff(self.tree_offsets) if len(self.tree_offsets) > 1 else np.zeros(0)
        budget = self.max_tokens
        padding = None if budget is None else max(0, budget - self.num_tokens)
        return {
            "tokens": self.num_tokens,
            "max_tokens": budget,
            "padding_tokens": padding,
            "padding_fraction": None if budget is None else round(padding / budget, 4),
            "blocks": len(sizes),
            "largest_block_tokens": int(sizes.max()) if len(sizes) else 0,
            "over_budget": budget is not None and self.num_tokens > budget,
        }

    @property
    def subtree_size(self) -> np.ndarray:
        """Per token: the tokens of its subtree, itself included (`subtree_end - index`)."""
        return self.subtree_end - np.arange(self.num_tokens, dtype=self.subtree_end.dtype)

    def attention_mask(self) -> np.ndarray:
        """Bool [T, T] (dense: T² bytes, for small batches): q may attend to k iff k is an
        ancestor-or-self of q (same tree). Built one tree block at a time."""
        total = self.num_tokens
        mask = np.zeros((total, total), dtype=bool)
        for block, (begin, end) in enumerate(pairwise(self.tree_offsets.tolist())):
            mask[begin:end, begin:end] = self.block_attention_mask(block)
        return mask

    def block_attention_mask(self, block: int) -> np.ndarray:
        """The dense ancestor-or-self mask of one attention block (a tree; a step when flat),
        from the intervals: [q, k] is set iff k <= q < subtree_end[k]."""
        begin, end = int(self.tree_offsets[block]), int(self.tree_offsets[block + 1])
        q = np.arange(begin, end)[:, None]
        return (q >= q.T) & (q < self.subtree_end[begin:end][None, :])

    def to_torch(self, dense_mask: bool = False) -> dict[str, Any]:
        """Tensors (long ids, bool masks, float32 weights) with the O(T) mask description
        (`subtree_end`, `tree_offsets`); the behaviour log-probs as `old_log_probs` (float32,
        0 where not captured) and `old_log_probs_mask` (bool: where captured); the dense
        [T, T] `attention_mask` only if asked."""
        try:
            import torch
        except ImportError:
            raise ImportError(
                "batch.to_torch() needs torch: pip install 'claw-lakehouse[train]'"
            ) from None
        tensors = {
            "input_ids": torch.from_numpy(self.input_ids.astype(np.int64)),
            "parent": torch.from_numpy(self.parent.astype(np.int64)),
            "position_ids": torch.from_numpy(self.position_ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(self.loss_mask.astype(bool)),
            "token_rewards": torch.from_numpy(self.token_rewards),
            "advantages": torch.from_numpy(self.advantages),
            "token_policy_versions": torch.from_numpy(self.token_policy_versions.astype(np.int64)),
            "old_log_probs": torch.from_numpy(self.behaviour_log_probs),
            "old_log_probs_mask": torch.from_numpy(self.has_behaviour_log_probs),
            "subtree_end": torch.from_numpy(self.subtree_end.astype(np.int64)),
            "tree_offsets": torch.from_numpy(self.tree_offsets.astype(np.int64)),
            "step_keys": list(self.step_keys),
            "step_token_index": [
                torch.from_numpy(i.astype(np.int64)) for i in self.step_token_index
            ],
        }
        if dense_mask:
            tensors["attention_mask"] = torch.from_numpy(self.attention_mask())
        return tensors


def subtree_ends(parent: np.ndarray) -> np.ndarray:
    """Per token of a forest in depth-first order (parent links, -1 at roots): one past the
    last token of its subtree. O(T): runs of tokens each the only child of the one before
    (a step's tokens after the shared prefix, a prompt) share their last token's end, so
    ends are computed on the runs (pointer doubling over run parents, few rounds: as many as
    branchings are nested) and broadcast back."""
    n = len(parent)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    parent = parent.astype(np.int64)
    children = np.bincount(parent[parent >= 0], minlength=n)
    # token k continues into k + 1 when k + 1 is its only child
    links = np.zeros(n, dtype=bool)
    links[:-1] = (children[:-1] == 1) & (parent[1:] == np.arange(n - 1))
    heads = np.ones(n, dtype=bool)
    heads[1:] = ~links[:-1]
    run = np.cumsum(heads) - 1  # run of each token
    starts = np.flatnonzero(heads)
    tails = np.r_[starts[1:], n] - 1
    head_parent = parent[starts]
    run_parent = np.where(head_parent >= 0, run[np.maximum(head_parent, 0)], -1)
    end = tails + 1
    jump = run_parent  # each run's 2**j-th ancestor run (-1: none)
    while (has := jump >= 0).any():
        np.maximum.at(end, jump[has], end[has])
        jump = np.where(has, jump[np.maximum(jump, 0)], -1)
    return end[run]


def _step_indices(packed: Packed, first: int, stop: int, lo: int) -> list[np.ndarray]:
    """Steps [first, stop)'s token indices, relative to a batch starting at token `lo`."""
    if lo == 0:
        return packed.token_of[first:stop]
    shift = np.int32(lo)
    return [t - shift for t in packed.token_of[first:stop]]


def batch_of(packed: Packed, first: int, stop: int, policy_version: int) -> Batch:
    """Steps [first, stop) of a packed partition (whole trees) as one batch."""
    lo, hi = int(packed.block_lo[first]), int(packed.block_hi[stop - 1])
    parent = packed.parent[lo:hi].astype(np.int64) - lo
    parent[parent < 0] = -1
    blocks = np.unique(np.r_[packed.block_lo[first:stop], hi]) - lo
    return Batch(
        layout=packed.layout,
        policy_version=policy_version,
        input_ids=packed.input_ids[lo:hi],
        parent=parent.astype(np.int32),
        position_ids=packed.position_ids[lo:hi],
        loss_mask=packed.loss_mask[lo:hi],
        token_rewards=packed.token_rewards[lo:hi],
        advantages=packed.advantages[lo:hi],
        token_policy_versions=packed.token_policy_versions[lo:hi],
        behaviour_log_probs=packed.behaviour_log_probs[lo:hi],
        has_behaviour_log_probs=packed.has_behaviour_log_probs[lo:hi],
        step_prompt_lens=packed.step_prompt_lens[first:stop],
        step_keys=packed.step_keys[first:stop],
        step_token_index=_step_indices(packed, first, stop, lo),
        tree_offsets=blocks.astype(np.int64),
        subtree_end=subtree_ends(parent).astype(np.int32),
        step_starts=packed.step_starts[first:stop],
    )
