"""Trainer consumption (DESIGN §8): gold partitions by policy version, as tree-packed or flat
batches, exact and reproducible. Needs nothing of the agent runtime (no gateway, no Dagster).

```python
ds = open_dataset("default", lake_uri="./lake")          # version=N: time travel
for batch in ds.batches(policy_version=3, batch_size=64, layout="tree", consumer="run-7"):
    tensors = batch.to_torch()                            # torch: `pip install .[train]`
```

A tree batch packs whole prefix trees (a trajectory or prompt group, as the dataset's spec
merged them) in depth-first order. Per token: `input_ids`, `parent` (the previous token on
its path, -1 at a root), `position_ids` (its position in its original sequence),
`loss_mask` (1 where it is a trained response token of some step), `advantages` and
`token_rewards` (summed over the steps whose response holds the token: the sum of per-step
losses is then the same on the tree as on the flat sequences). Per step: `step_keys` and
`step_token_index` (indices into `input_ids` of its whole sequence, in order). The log-prob
of token t is read from the logits at row `parent[t]`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.tables import GOLD_CONSUMPTION, gold_dataset_table
from claw_pipelines.lake import Lake
from claw_pipelines.settings import ClawSettings
from claw_pipelines.transforms.hashing import list_parts
from claw_pipelines.transforms.prefix_tree import NO_PARENT, build_forest

Layout = Literal["tree", "flat"]
BATCH_COLUMNS = [
    "step_key",
    "tree_id",
    "prompt_ids",
    "response_ids",
    "response_mask",
    "reward",
    "advantage",
]


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
    tree_offsets: np.ndarray  # tokens of tree i are input_ids[tree_offsets[i]:tree_offsets[i+1]]
    step_starts: np.ndarray  # per step: the depth where its own tokens start (0 when flat)
    trees: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch (the tree tokens, or the flat ones)."""
        return len(self.input_ids)

    def attention_mask(self) -> np.ndarray:
        """Bool [T, T]: q may attend to k iff k is an ancestor-or-self of q (same tree).

        Built one tree block at a time from ancestor chains by pointer doubling: no Python
        loop per token."""
        total = self.num_tokens
        mask = np.zeros((total, total), dtype=bool)
        for begin, end in zip(self.tree_offsets[:-1], self.tree_offsets[1:], strict=True):
            mask[begin:end, begin:end] = _ancestors(self.parent[begin:end] - begin)
        return mask

    def to_torch(self) -> dict[str, Any]:
        """Tensors (long ids, bool masks, float32 weights) and the ancestor attention mask."""
        try:
            import torch
        except ImportError:
            raise ImportError(
                "batch.to_torch() needs torch: pip install 'claw-lakehouse[train]'"
            ) from None
        return {
            "input_ids": torch.from_numpy(self.input_ids.astype(np.int64)),
            "parent": torch.from_numpy(self.parent.astype(np.int64)),
            "position_ids": torch.from_numpy(self.position_ids.astype(np.int64)),
            "loss_mask": torch.from_numpy(self.loss_mask.astype(bool)),
            "token_rewards": torch.from_numpy(self.token_rewards),
            "advantages": torch.from_numpy(self.advantages),
            "attention_mask": torch.from_numpy(self.attention_mask()),
            "step_keys": list(self.step_keys),
            "step_token_index": [
                torch.from_numpy(i.astype(np.int64)) for i in self.step_token_index
            ],
        }


def _ancestors(parent: np.ndarray) -> np.ndarray:
    """Ancestor-or-self matrix of a forest given parent links (parents precede children)."""
    n = len(parent)
    reach = np.zeros((n, n), dtype=bool)
    reach[np.arange(n), np.arange(n)] = True
    has = parent >= 0
    reach[np.flatnonzero(has), parent[has]] = True
    jump = np.where(has, parent, np.arange(n))
    while True:  # doubling: after j rounds, every ancestor within 2**j steps is marked
        widened = reach | reach[jump]
        jump_next = jump[jump]
        if np.array_equal(widened, reach) and np.array_equal(jump_next, jump):
            return reach
        reach, jump = widened, jump_next


def _per_step(frame: pl.DataFrame) -> dict[str, Any]:
    """Arrays of a batch's steps: sequences, response starts, per-token masks and weights."""
    prompt_offsets, _, _ = list_parts(frame["prompt_ids"].to_arrow())
    sequences = frame.select(pl.concat_list("prompt_ids", "response_ids")).to_series()
    offsets, values, _ = list_parts(sequences.to_arrow())
    values, offsets = values[offsets[0] : offsets[-1]], offsets - offsets[0]
    lengths = np.diff(offsets)
    prompt_len = np.diff(prompt_offsets)
    mask = frame.select(
        pl.coalesce(
            pl.col("response_mask"),
            pl.col("response_ids").list.eval(pl.element() * 0 + 1).cast(pl.List(pl.Int8)),
        )
    ).to_series()
    mask_offsets, mask_values, _ = list_parts(mask.to_arrow())
    return {
        "offsets": offsets,
        "values": np.ascontiguousarray(values, dtype=np.int32),
        "lengths": lengths,
        "prompt_len": prompt_len,
        "mask": mask_values.astype(np.float32),
        "mask_offsets": mask_offsets,
        "advantage": frame["advantage"].fill_null(0.0).to_numpy().astype(np.float32),
        "reward": frame["reward"].fill_null(0.0).to_numpy().astype(np.float32),
    }


def _weights(
    steps: dict[str, Any], token_of: list[np.ndarray], total: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(loss_mask, advantages, token_rewards) per token: sums over the steps whose response
    holds the token (masked by the step's response_mask); rewards on each step's last token."""
    prompt_len, lengths = steps["prompt_len"], steps["lengths"]
    response = np.concatenate([t[p:] for t, p in zip(token_of, prompt_len.tolist(), strict=True)])
    response_len = lengths - prompt_len
    mask = steps["mask"]
    weight = mask * np.repeat(steps["advantage"], response_len)
    loss = np.bincount(response, weights=mask, minlength=total) > 0
    advantages = np.bincount(response, weights=weight, minlength=total).astype(np.float32)
    has_response = response_len > 0
    last = np.cumsum(response_len)[has_response] - 1
    rewards = np.bincount(
        response[last], weights=steps["reward"][has_response], minlength=total
    ).astype(np.float32)
    return loss.astype(np.int8), advantages, rewards


def tree_batch(frame: pl.DataFrame, policy_version: int) -> Batch:
    """Pack the steps of whole trees into one tree batch (depth-first, shared tokens once)."""
    steps = _per_step(frame)
    tree_names, tree_codes = np.unique(frame["tree_id"].to_numpy(), return_inverse=True)
    sequences = pa.ListArray.from_arrays(
        pa.array(steps["offsets"].astype(np.int32)), pa.array(steps["values"])
    )
    forest = build_forest(tree_codes.astype(np.int64), sequences)
    sizes = np.diff(forest.offsets)
    seg_first = forest.offsets[:-1]  # batch index of each segment's first token
    total = forest.tree_tokens
    depth_in_segment = np.arange(total) - np.repeat(seg_first, sizes)
    position = np.repeat(forest.start, sizes) + depth_in_segment
    parent = np.arange(total, dtype=np.int64) - 1
    firsts = seg_first[sizes > 0]
    first_segments = np.flatnonzero(sizes > 0)
    parent[firsts] = _attach_points(forest, first_segments)
    segment_of_row = forest.segment_of_row()
    by_segment = _segment_tokens(forest)
    token_of = [by_segment[k] for k in segment_of_row.tolist()]
    loss, advantages, rewards = _weights(steps, token_of, total)
    tree_starts = (
        np.flatnonzero(np.r_[True, forest.tree[1:] != forest.tree[:-1]]) if len(sizes) else []
    )
    tree_offsets = np.r_[seg_first[tree_starts] if len(sizes) else [], total].astype(np.int64)
    return Batch(
        layout="tree",
        policy_version=policy_version,
        input_ids=forest.tokens.astype(np.int32),
        parent=parent.astype(np.int32),
        position_ids=position.astype(np.int32),
        loss_mask=loss,
        token_rewards=rewards,
        advantages=advantages,
        step_keys=frame["step_key"].to_list(),
        step_token_index=token_of,
        tree_offsets=tree_offsets,
        step_starts=forest.start[segment_of_row],
        trees=[str(t) for t in tree_names],
    )


def _attach_points(forest, segments: np.ndarray) -> np.ndarray:
    """For each segment, the batch index of the token it hangs from (-1 for a root)."""
    parents = forest.parent[segments]
    at = forest.offsets[np.maximum(parents, 0)] + (
        forest.start[segments] - 1 - forest.start[np.maximum(parents, 0)]
    )
    return np.where(parents == NO_PARENT, -1, at)


def _segment_tokens(forest) -> list[np.ndarray]:
    """For each segment (parents first), the batch indices of its row's whole sequence: its
    parent's up to the depth where it branches, then its own."""
    indices: list[np.ndarray] = []
    offsets, starts = forest.offsets.tolist(), forest.start.tolist()
    for k, p in enumerate(forest.parent.tolist()):
        own = np.arange(offsets[k], offsets[k + 1], dtype=np.int32)
        indices.append(own if p == NO_PARENT else np.concatenate([indices[p][: starts[k]], own]))
    return indices


def flat_batch(frame: pl.DataFrame, policy_version: int) -> Batch:
    """The same steps as unmerged sequences, one after another."""
    steps = _per_step(frame)
    offsets, lengths = steps["offsets"], steps["lengths"]
    total = int(offsets[-1])
    starts = np.repeat(offsets[:-1], lengths)
    position = np.arange(total, dtype=np.int64) - starts
    parent = np.where(position == 0, -1, np.arange(total) - 1)
    token_of = [np.arange(offsets[s], offsets[s + 1]) for s in range(frame.height)]
    loss, advantages, rewards = _weights(steps, token_of, total)
    return Batch(
        layout="flat",
        policy_version=policy_version,
        input_ids=steps["values"].copy(),
        parent=parent.astype(np.int32),
        position_ids=position.astype(np.int32),
        loss_mask=loss,
        token_rewards=rewards,
        advantages=advantages,
        step_keys=frame["step_key"].to_list(),
        step_token_index=[t.astype(np.int32) for t in token_of],
        tree_offsets=offsets.astype(np.int64),
        step_starts=np.zeros(frame.height, dtype=np.int64),
        trees=frame["step_key"].to_list(),
    )


class Dataset:
    """A gold dataset at one Delta version (the newest unless pinned)."""

    def __init__(self, lake: Lake, name: str, version: int | None = None) -> None:
        self.lake, self.name = lake, name
        self.table = gold_dataset_table(name)
        if not lake.exists(self.table):
            raise LookupError(f"no gold dataset {name!r} in {lake.uri}")
        self.version: int = lake.version(self.table) if version is None else int(version)

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, version={self.version})"

    def _scan(self) -> pl.LazyFrame:
        return self.lake.scan(self.table, self.version)

    def policy_versions(self) -> list[int]:
        """The policy versions (partitions) this version of the dataset holds."""
        versions = self._scan().select(pl.col("policy_version").unique()).collect()
        return sorted(int(v) for v in versions["policy_version"].to_list())

    def steps(self, policy_version: int | None = None) -> pl.DataFrame:
        """The dataset's steps (of one policy version when given), in step order."""
        frame = self._scan()
        if policy_version is not None:
            frame = frame.filter(pl.col("policy_version") == policy_version)
        return frame.sort("policy_version", "tree_id", "segment").collect()

    def consumed(self, consumer: str) -> pl.DataFrame:
        """Batches `consumer` pulled from this dataset (any version), oldest first."""
        if not self.lake.exists(GOLD_CONSUMPTION):
            return pl.DataFrame(
                schema={
                    "consumer": pl.String,
                    "dataset": pl.String,
                    "step_keys": pl.List(pl.String),
                }
            )
        return (
            self.lake.scan(GOLD_CONSUMPTION)
            .filter((pl.col("consumer") == consumer) & (pl.col("dataset") == self.name))
            .sort("consumed_at")
            .collect()
        )

    def batches(
        self,
        policy_version: int,
        batch_size: int,
        layout: Layout = "tree",
        consumer: str | None = None,
        seed: int | None = None,
        skip_consumed_by: str | None = None,
    ) -> Iterator[Batch]:
        """Batches of whole trees, about `batch_size` steps each (a tree larger than that is a
        batch of its own). Tree order: by tree id, or shuffled by `seed` (same seed, same
        order). With `consumer`, each batch pulled is logged in `gold/consumption`; with
        `skip_consumed_by`, steps that consumer already took are left out."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if layout not in ("tree", "flat"):
            raise ValueError(f"layout must be 'tree' or 'flat', not {layout!r}")
        frame = (
            self._scan()
            .filter(pl.col("policy_version") == policy_version)
            .select(BATCH_COLUMNS)
            .collect()
        )
        if skip_consumed_by is not None:
            taken = self.consumed(skip_consumed_by)
            if taken.height:
                keys = taken["step_keys"].explode().unique().implode()
                frame = frame.filter(~pl.col("step_key").is_in(keys))
        trees = frame.group_by("tree_id").agg(pl.len().alias("n")).sort("tree_id")
        if seed is not None:
            trees = trees[np.random.default_rng(seed).permutation(trees.height)]
        build = tree_batch if layout == "tree" else flat_batch
        for index, chosen in enumerate(_pack(trees, batch_size)):
            rows = frame.filter(pl.col("tree_id").is_in(chosen.implode()))
            order = pl.DataFrame({"tree_id": chosen}).with_row_index("tree_rank")
            rows = rows.join(order, on="tree_id").sort("tree_rank", "step_key").drop("tree_rank")
            batch = build(rows, policy_version)
            if consumer is not None:
                self._log(consumer, policy_version, index, batch.step_keys)
            yield batch

    def _log(self, consumer: str, policy_version: int, index: int, step_keys: list[str]) -> None:
        row = {
            "consumer": consumer,
            "dataset": self.name,
            "dataset_version": self.version,
            "policy_version": policy_version,
            "batch_index": index,
            "step_keys": step_keys,
            "consumed_at": datetime.now(UTC),
        }
        self.lake.append(GOLD_CONSUMPTION, pa.Table.from_pylist([row]))


def _pack(trees: pl.DataFrame, batch_size: int) -> Iterator[pl.Series]:
    """Consecutive trees, cut into groups of at most `batch_size` steps (never splitting one)."""
    chosen: list[str] = []
    count = 0
    for tree, n in trees.select("tree_id", "n").iter_rows():
        if chosen and count + n > batch_size:
            yield pl.Series("tree_id", chosen, dtype=pl.String)
            chosen, count = [], 0
        chosen.append(tree)
        count += n
    if chosen:
        yield pl.Series("tree_id", chosen, dtype=pl.String)


def open_dataset(name: str, lake_uri: str | None = None, version: int | None = None) -> Dataset:
    """A gold dataset by name, from `lake_uri` (default: `CLAW_LAKE_URI`), at a Delta version
    (default: the newest)."""
    settings = ClawSettings().with_overrides(lake_uri=lake_uri)
    return Dataset(Lake.from_settings(settings), name, version)
