"""Offline batches of one partition: planned from the steps' light columns (`plan_batches`, a
`BatchPlan`: which trees make each batch, no token read), packed only for the batches asked
for, and the `gold/consumption` rows `Dataset.batches` writes and `skip_consumed_by` reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from functools import cache
from typing import Protocol

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.consume.batch import Batch, batch_of
from claw_pipelines.consume.judge import Judge
from claw_pipelines.consume.report import ContractReport, blocking_failures
from claw_pipelines.consume.source import GoldSource
from claw_pipelines.contracts.errors import ContractViolation
from claw_pipelines.contracts.tables import GOLD_CONSUMPTION, GOLD_CONSUMPTION_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.transforms.packing import Layout, Packed


class Planned(Protocol):
    """What a plan reads of its dataset (a `consume.dataset.Dataset`)."""

    name: str
    version: int
    _source: GoldSource
    _judge: Judge


class BatchPlan:
    """Which trees (so which steps) make each batch of one partition, decided from the steps'
    light columns (`Dataset.batch_plan`): no token is read and no tree is built until batches
    are asked for, and then only those batches' trees are packed. The same arguments give the
    same plan on every rank; `batches(indexes)` gives exactly the batches `Dataset.batches`
    yields at those indexes (the same token ids, trees and contract)."""

    def __init__(
        self,
        dataset: Planned,
        policy_version: int,
        frame: pl.DataFrame,
        trees: pl.DataFrame,
        cuts: list[tuple[int, int]],
        layout: Layout,
        max_tokens: int | None,
        whole: tuple[Packed, pl.DataFrame] | None = None,
    ) -> None:
        self.dataset, self.policy_version = dataset, policy_version
        self.layout, self.max_tokens = layout, max_tokens
        self._frame, self._trees, self._cuts, self._whole = frame, trees, cuts, whole
        self._source = dataset._source
        self._bounds = np.r_[0, np.cumsum(trees["n"].to_numpy())].astype(np.int64)
        ranked = trees.select("tree_id").with_row_index("rank")
        self._keys = (  # every step in the order batches lay them out: tree rank, step key
            frame.select("step_key", "tree_id")
            .join(ranked, on="tree_id", how="left")
            .sort("rank", "step_key")["step_key"]
            .to_list()
        )
        # steps laid out for training so far (tree-built or gathered): a whole partition
        # when sizing its trees by tokens needed them packed (see `plan_batches`)
        self.packed_steps = 0 if whole is None else frame.height
        # what the contract is judged against is read now; the judging is done once per
        # packing, when a blocking spec or the first look at a batch's contract needs it
        self._grounds = dataset._judge.grounds((policy_version,), dataset.version)

    def __len__(self) -> int:
        return len(self._cuts)

    def __repr__(self) -> str:
        return (
            f"BatchPlan({self.dataset.name!r}, version={self.dataset.version}, "
            f"policy_version={self.policy_version}, batches={len(self)}, layout={self.layout!r})"
        )

    def step_keys(self, index: int) -> list[str]:
        """The step keys of batch `index`, in the order the batch holds them (no packing)."""
        first, stop = self._cuts[self._index(index)]
        return self._keys[self._bounds[first] : self._bounds[stop]]

    def tree_ids(self, index: int) -> list[str]:
        """The trees (trajectories or prompt groups) of batch `index`, in batch order."""
        first, stop = self._cuts[self._index(index)]
        return self._trees["tree_id"][first:stop].to_list()

    def batches(self, indexes: Iterable[int] | None = None) -> Iterator[Batch]:
        """Batches `indexes` (default: all, in order), in the order given (an index may come
        again: the same batch). Packing waits for the first one; then the trees of every
        distinct batch asked for are packed together, once, and nothing else."""
        wanted = list(range(len(self))) if indexes is None else [self._index(i) for i in indexes]
        return self._packed(wanted)

    def _index(self, index: int) -> int:
        if not 0 <= index < len(self):
            raise IndexError(f"batch index {index} out of range: the plan has {len(self)} batches")
        return int(index)

    def _packed(self, wanted: list[int]) -> Iterator[Batch]:
        if not wanted:
            return
        distinct = sorted(set(wanted))
        version = self.dataset.version
        if self._whole is not None:
            (packed, frame), steps_before = self._whole, self._bounds
            tree_at = {i: self._cuts[i][0] for i in distinct}
        else:
            positions = np.concatenate([np.arange(*self._cuts[i]) for i in distinct])
            share = self._trees[positions]
            everything = len(positions) == self._trees.height
            frame = self._frame
            if not everything:
                frame = frame.filter(pl.col("tree_id").is_in(share["tree_id"].implode()))
            packed, frame = self._source.pack_partition(
                self.policy_version,
                frame,
                share,
                self.layout,
                everything,
                version,
                self._grounds.token_floor,
            )
            self.packed_steps += frame.height
            steps_before = np.r_[0, np.cumsum(share["n"].to_numpy())].astype(np.int64)
            runs = np.cumsum([0] + [self._cuts[i][1] - self._cuts[i][0] for i in distinct])
            tree_at = dict(zip(distinct, runs[:-1].tolist(), strict=True))
        grounds = self._grounds
        judged = cache(lambda: grounds.verdicts(frame, packed))
        blocks, name = grounds.blocking, self.dataset.name
        for index in wanted:
            first_tree = tree_at[index]
            stop_tree = first_tree + self._cuts[index][1] - self._cuts[index][0]
            first, stop = int(steps_before[first_tree]), int(steps_before[stop_tree])
            batch = batch_of(packed, first, stop, self.policy_version)
            batch.max_tokens, batch.batch_index = self.max_tokens, index
            keys = batch.step_keys
            batch.contract = lambda keys=keys: judged().report(name, version, keys)
            if blocks:
                refuse_if_blocked(batch.contract)
            yield batch


def plan_batches(
    dataset: Planned,
    policy_version: int,
    batch_size: int | None,
    layout: Layout,
    seed: int | None,
    max_tokens: int | None,
    skip_consumed_by: str | None,
) -> BatchPlan:
    """`Dataset.batch_plan`: the partition's steps read without their tokens (less those
    `skip_consumed_by` took), their trees in id order or shuffled by `seed`, cut into batches
    of at most `batch_size` steps and `max_tokens` tokens."""
    if batch_size is None and max_tokens is None:
        raise ValueError("give batch_size (steps), max_tokens, or both")
    if batch_size is not None and batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    if layout not in ("tree", "flat"):
        raise ValueError(f"layout must be 'tree' or 'flat', not {layout!r}")
    source, at = dataset._source, dataset.version
    frame = source.batch_rows(policy_version, at)
    if skip_consumed_by is not None:
        taken = consumed(source.lake, dataset.name, skip_consumed_by)
        if taken.height:
            keys = taken["step_keys"].explode().unique().implode()
            frame = frame.filter(~pl.col("step_key").is_in(keys))
    trees = frame.group_by("tree_id").agg(pl.len().alias("n")).sort("tree_id")
    if seed is not None:
        trees = trees[np.random.default_rng(seed).permutation(trees.height)]
    whole = None
    sizes = np.zeros(trees.height, dtype=np.int64)  # tokens per tree: only a budget needs them
    if max_tokens is not None:
        found = source.tree_tokens(policy_version, frame, layout, at)
        if found is None:  # no stored trees stand for these steps: build them to count
            floor = dataset._judge.grounds((policy_version,), at).token_floor
            whole = source.pack_partition(policy_version, frame, trees, layout, True, at, floor)
            packed, bounds = whole[0], np.r_[0, np.cumsum(trees["n"].to_numpy())]
            ends = bounds[1:] - 1  # each tree's last step
            sizes = packed.block_hi[ends] - packed.block_lo[bounds[:-1]] if len(ends) else ends
        else:
            tokens = trees.join(found, on="tree_id", how="left", maintain_order="left")
            sizes = tokens["tokens"].to_numpy()
    cuts = list(cut(trees["n"].to_numpy(), sizes, batch_size, max_tokens))
    return BatchPlan(dataset, policy_version, frame, trees, cuts, layout, max_tokens, whole)


def cut(
    steps: np.ndarray, tokens: np.ndarray, max_steps: int | None, max_tokens: int | None
) -> Iterator[tuple[int, int]]:
    """Consecutive trees (their step and token counts) cut into groups of at most
    `max_steps` steps and `max_tokens` tokens, never splitting a tree; yields
    (first tree, stop tree)."""
    step_cap = max_steps if max_steps is not None else np.inf
    token_cap = max_tokens if max_tokens is not None else np.inf
    first, count, held = 0, 0, 0
    for i, (n, t) in enumerate(zip(steps.tolist(), tokens.tolist(), strict=True)):
        if i > first and (count + n > step_cap or held + t > token_cap):
            yield first, i
            first, count, held = i, 0, 0
        count += n
        held += t
    if len(steps):
        yield first, len(steps)


def refuse_if_blocked(report: ContractReport) -> None:
    """Raise ContractViolation when the batch fails a check its spec makes blocking."""
    failed = blocking_failures(report)
    if failed:
        raise ContractViolation(report, failed)


def consumed(lake: Lake, dataset: str, consumer: str) -> pl.DataFrame:
    """Batches `consumer` pulled from `dataset` (any version), oldest first."""
    if not lake.exists(GOLD_CONSUMPTION):
        return pl.DataFrame(
            schema={
                "consumer": pl.String,
                "dataset": pl.String,
                "step_keys": pl.List(pl.String),
            }
        )
    return (
        lake.scan(GOLD_CONSUMPTION)
        .filter((pl.col("consumer") == consumer) & (pl.col("dataset") == dataset))
        .sort("consumed_at")
        .collect()
    )


def log_batch(
    lake: Lake,
    dataset: str,
    dataset_version: int,
    consumer: str,
    policy_version: int,
    index: int,
    step_keys: list[str],
) -> None:
    """Record that `consumer` pulled batch `index` (its `step_keys`) of partition
    `policy_version` at `dataset_version` (kind `batches`)."""
    row = {
        "consumer": consumer,
        "dataset": dataset,
        "dataset_version": dataset_version,
        "policy_version": policy_version,
        "batch_index": index,
        "step_keys": step_keys,
        "consumed_at": datetime.now(UTC),
        "kind": "batches",
    }
    lake.append(GOLD_CONSUMPTION_SPEC, pa.Table.from_pylist([row]))
