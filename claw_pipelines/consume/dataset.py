"""Trainer consumption (docs/DESIGN.md §8): gold partitions by policy version, as tree-packed or
flat batches, exact and reproducible. Needs nothing of the agent runtime (no gateway, no Dagster).

```python
ds = open_dataset("default", lake_uri="./lake")          # version=N: time travel
for batch in ds.batches(policy_version=3, batch_size=64, layout="tree", consumer="run-7"):
    tensors = batch.to_torch()                            # torch: `pip install .[train]`

# the same batches planned (no token read), the same on every rank; a rank packs its own
plan = ds.batch_plan(policy_version=3, batch_size=64, seed=0)
for batch in plan.batches(range(rank, len(plan), world_size)): ...

# asynchronous RL: block for fresh whole groups, each delivered once per consumer rank
batch = ds.next_batch(groups=16, consumer="run-7", min_policy_version=4, timeout=60)
publish_policy_version(5, lake_uri="./lake")             # agents move on to policy 5
```

A tree batch packs whole prefix trees (a trajectory or prompt group, as the dataset's spec
merged them) in depth-first order. Per token: `input_ids`, `parent` (the previous token on
its path, -1 at a root), `position_ids` (its position in its original sequence),
`loss_mask` (1 where it is a trained response token of some step), `advantages` and
`token_rewards` (summed over the steps whose response holds the token: the sum of per-step
losses is then the same on the tree as on the flat sequences). Per step: `step_keys` and
`step_token_index` (indices into `input_ids` of its whole sequence, in order). The log-prob
of token t is read from the logits at row `parent[t]`.

The attention mask is described in O(T): tokens are in depth-first order, so token k is an
ancestor-or-self of q exactly when `k <= q < subtree_end[k]` (`subtree_end`: one past the last
token of k's subtree; a subtree never leaves its tree block, `tree_offsets`). Dense masks are
built only when asked (`attention_mask()`, `block_attention_mask(b)`, `to_torch(dense_mask=True)`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from itertools import pairwise
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
from deltalake.exceptions import DeltaError

from claw_pipelines.consume.delivery import (
    NEXT,
    REFUSED,
    UNIT_COLUMNS,
    Ledger,
    LiveRows,
    available_units,
    choose,
    ledger,
    record_delivery,
)
from claw_pipelines.consume.report import (
    CONTRACT_COLUMNS,
    ContractReport,
    Verdicts,
    blocking_failures,
    verdicts,
)
from claw_pipelines.contracts.errors import ContractViolation, NotFound
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    GOLD_CONSUMPTION,
    GOLD_CONSUMPTION_SPEC,
    GOLD_LINEAGE,
    GOLD_POLICY_VERSIONS,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.lake import policy
from claw_pipelines.lake.catalog import gold_datasets, lake_exists
from claw_pipelines.lake.delta import Lake, until_landed
from claw_pipelines.settings import ClawSettings
from claw_pipelines.transforms.packing import Layout, Packed, pack

BATCH_STEP_COLUMNS = [
    "step_key",
    "tree_id",
    "prompt_len",
    "response_len",
    "response_mask",
    "reward",
    "advantage",
]


def _listed(values: Sequence[object], none: str) -> str:
    """`values` as '1, 2, 3' (a range as '0..12' when contiguous), or `none`."""
    if not values:
        return none
    ints = all(isinstance(v, int) for v in values)
    if ints and len(values) > 3 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}..{values[-1]}"
    return ", ".join(str(v) for v in values)


def require_lake(lake: Lake) -> None:
    """Raise NotFound when a local lake's directory does not exist (object stores have no
    directories to look for: a missing table says so instead)."""
    if not lake_exists(lake):
        raise NotFound(f"no lake at {lake.uri} (the directory does not exist)")


# what a batch's steps are read with: their training columns and what the contract checks
BATCH_READ_COLUMNS = list(dict.fromkeys([*BATCH_STEP_COLUMNS, *CONTRACT_COLUMNS]))
# what a dataset keeps of its lineage rows: which spec wrote each partition, and the trees
LINEAGE_COLUMNS = ["policy_version", "spec_hash", "dataset_version", "trees_version", "written_at"]


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
    groups: list[str] = field(default_factory=list)  # next_batch: the units it delivers
    batch_index: int | None = None  # batches: its index in the plan; next_batch: in the record
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
        (`subtree_end`, `tree_offsets`); the dense [T, T] `attention_mask` only if asked."""
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


def _batch(packed: Packed, first: int, stop: int, policy_version: int) -> Batch:
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
        step_keys=packed.step_keys[first:stop],
        step_token_index=_step_indices(packed, first, stop, lo),
        tree_offsets=blocks.astype(np.int64),
        subtree_end=subtree_ends(parent).astype(np.int32),
        step_starts=packed.step_starts[first:stop],
    )


class BatchPlan:
    """Which trees (so which steps) make each batch of one partition, decided from the steps'
    light columns (`Dataset.batch_plan`): no token is read and no tree is built until batches
    are asked for, and then only those batches' trees are packed. The same arguments give the
    same plan on every rank; `batches(indexes)` gives exactly the batches `Dataset.batches`
    yields at those indexes (the same token ids, trees and contract)."""

    def __init__(
        self,
        dataset: Dataset,
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
        self._bounds = np.r_[0, np.cumsum(trees["n"].to_numpy())].astype(np.int64)
        ranked = trees.select("tree_id").with_row_index("rank")
        self._keys = (  # every step in the order batches lay them out: tree rank, step key
            frame.select("step_key", "tree_id")
            .join(ranked, on="tree_id", how="left")
            .sort("rank", "step_key")["step_key"]
            .to_list()
        )
        # steps laid out for training so far (tree-built or gathered): a whole partition
        # when sizing its trees by tokens needed them packed (see `Dataset.batch_plan`)
        self.packed_steps = 0 if whole is None else frame.height
        # what the contract is judged against is read now; the judging is done once per
        # packing, when a blocking spec or the first look at a batch's contract needs it
        spec, hashes = dataset._lineage_specs(dataset.version)
        self._spec, self._hashes = spec, {v: h for v, h in hashes.items() if v == policy_version}
        self._floor = dataset.staleness_floor()
        self._left_out = dataset._left_out((policy_version,))

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
            packed, frame = self.dataset._pack_trees(
                self.policy_version, frame, share, self.layout, everything
            )
            self.packed_steps += frame.height
            steps_before = np.r_[0, np.cumsum(share["n"].to_numpy())].astype(np.int64)
            runs = np.cumsum([0] + [self._cuts[i][1] - self._cuts[i][0] for i in distinct])
            tree_at = dict(zip(distinct, runs[:-1].tolist(), strict=True))
        judged = cache(
            lambda: verdicts(self._spec, self._hashes, frame, packed, self._floor, self._left_out)
        )
        blocks = self._spec is not None and bool(self._spec.blocking)
        name, version = self.dataset.name, self.dataset.version
        for index in wanted:
            first_tree = tree_at[index]
            stop_tree = first_tree + self._cuts[index][1] - self._cuts[index][0]
            first, stop = int(steps_before[first_tree]), int(steps_before[stop_tree])
            batch = _batch(packed, first, stop, self.policy_version)
            batch.max_tokens, batch.batch_index = self.max_tokens, index
            keys = batch.step_keys
            batch.contract = lambda keys=keys: judged().report(name, version, keys)
            if blocks:
                _refuse_if_blocked(batch.contract)
            yield batch


class Dataset:
    """A gold dataset at one Delta version (the newest unless pinned)."""

    def __init__(self, lake: Lake, name: str, version: int | None = None) -> None:
        self.lake, self.name = lake, name
        self.table = gold_dataset_table(name)
        self.trees_table = gold_tree_table(name)
        require_lake(lake)
        newest = lake.version(self.table)
        if newest is None:
            known = _listed(gold_datasets(lake), "none yet: `claw materialize` builds them")
            raise NotFound(f"no gold dataset {name!r} in {lake.uri} (datasets: {known})")
        self.version: int = newest if version is None else self._readable(version, newest)
        # live delivery keeps what it read while the tables it came from have not moved
        self._books: dict[tuple[str, int], Ledger] = {}
        self._newest: LiveRows | None = None
        self._floor: tuple[tuple[int | None, int | None], int | None] | None = None
        # per dataset version: (the lineage version read, its spec and partition spec hashes)
        self._specs: dict[int, tuple[int | None, tuple[CurationSpec | None, dict[int, str]]]] = {}
        self._rejections: tuple[tuple, dict[str, int]] | None = None
        self._lineage: tuple[int, pl.DataFrame] | None = None  # (lineage version, its rows)
        self._spec_by_hash: dict[str, CurationSpec] = {}

    def __repr__(self) -> str:
        return f"Dataset({self.name!r}, version={self.version})"

    def _readable(self, version: object, newest: int) -> int:
        """`version` if this dataset has it and its log still reads; NotFound otherwise."""
        has = f"dataset {self.name!r} has versions 0..{newest}"
        try:
            number = int(version)  # type: ignore[call-overload]
        except (TypeError, ValueError):
            raise NotFound(f"{has}; version {version!r} is not a version number") from None
        if not 0 <= number <= newest:
            raise NotFound(f"{has}; version {number} does not exist")
        try:
            self.lake.open(self.table, number)
        except DeltaError:  # the log of old versions may have been cleaned up
            raise NotFound(f"{has}; version {number} can no longer be read") from None
        return number

    def _missing_policy_version(self, policy_version: int) -> NotFound:
        """The error for a policy version this dataset version does not hold."""
        held = _listed(self.policy_versions(), "none")
        return NotFound(
            f"dataset {self.name!r} (version {self.version}) has policy versions {held}; "
            f"policy version {policy_version} does not exist"
        )

    def __reduce__(self):
        """Pickles as lake, name and pinned version (e.g. into spawned DataLoader workers)."""
        return Dataset, (self.lake, self.name, self.version)

    def _scan(self) -> pl.LazyFrame:
        return self.lake.scan(self.table, self.version)

    def policy_versions(self) -> list[int]:
        """The policy versions (partitions) this version of the dataset holds."""
        versions = self._scan().select(pl.col("policy_version").unique()).collect()
        return sorted(int(v) for v in versions["policy_version"].to_list())

    def steps(self, policy_version: int | None = None) -> pl.DataFrame:
        """The dataset's steps (of one policy version when given: NotFound when it holds
        none of it), in step order."""
        frame = self._scan()
        if policy_version is not None:
            frame = frame.filter(pl.col("policy_version") == policy_version)
        steps = frame.sort("policy_version", "tree_id", "segment").collect()
        if policy_version is not None and steps.is_empty():
            raise self._missing_policy_version(policy_version)
        return steps

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
        batch_size: int | None = None,
        layout: Layout = "tree",
        consumer: str | None = None,
        seed: int | None = None,
        skip_consumed_by: str | None = None,
        max_tokens: int | None = None,
    ) -> Iterator[Batch]:
        """Batches of whole trees, of at most `batch_size` steps and at most `max_tokens`
        tokens (tree tokens, or flat ones), whichever comes first; a tree larger than that
        is a batch of its own (`token_report()` says so). Tree order: by tree id, or shuffled
        by `seed` (same seed, same order). With `consumer`, each batch pulled is logged in
        `gold/consumption`; with `skip_consumed_by`, steps that consumer already took are
        left out. The whole partition is packed at the first batch; `batch_plan` packs only
        the batches asked for."""
        plan = self.batch_plan(
            policy_version, batch_size, layout, seed, max_tokens, skip_consumed_by
        )
        for index, batch in enumerate(plan.batches()):
            if consumer is not None:
                self._log(consumer, policy_version, index, batch.step_keys)
            yield batch

    def batch_plan(
        self,
        policy_version: int,
        batch_size: int | None = None,
        layout: Layout = "tree",
        seed: int | None = None,
        max_tokens: int | None = None,
        skip_consumed_by: str | None = None,
    ) -> BatchPlan:
        """The batches `batches` would yield with these arguments, planned but not packed:
        `len(plan)`, `plan.step_keys(i)`, and `plan.batches(indexes)` packs only the trees of
        those batches (a rank, or a DataLoader worker, packs only its share). Reads the
        partition's step columns without their tokens; with `max_tokens` in the tree layout,
        tree sizes come from the stored trees, or, when those do not stand for the steps (a
        partly consumed partition), from packing the whole partition now."""
        if batch_size is None and max_tokens is None:
            raise ValueError("give batch_size (steps), max_tokens, or both")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
        if layout not in ("tree", "flat"):
            raise ValueError(f"layout must be 'tree' or 'flat', not {layout!r}")
        in_partition = self._scan().filter(pl.col("policy_version") == policy_version)
        frame = in_partition.select(BATCH_READ_COLUMNS).collect()
        if frame.is_empty():
            raise self._missing_policy_version(policy_version)
        if skip_consumed_by is not None:
            taken = self.consumed(skip_consumed_by)
            if taken.height:
                keys = taken["step_keys"].explode().unique().implode()
                frame = frame.filter(~pl.col("step_key").is_in(keys))
        trees = frame.group_by("tree_id").agg(pl.len().alias("n")).sort("tree_id")
        if seed is not None:
            trees = trees[np.random.default_rng(seed).permutation(trees.height)]
        whole = None
        sizes = np.zeros(trees.height, dtype=np.int64)  # tokens per tree: only a budget needs them
        if max_tokens is not None:
            found = self._tree_tokens(policy_version, frame, layout)
            if found is None:  # no stored trees stand for these steps: build them to count
                whole = self._pack_trees(policy_version, frame, trees, layout, everything=True)
                packed, bounds = whole[0], np.r_[0, np.cumsum(trees["n"].to_numpy())]
                ends = bounds[1:] - 1  # each tree's last step
                sizes = packed.block_hi[ends] - packed.block_lo[bounds[:-1]] if len(ends) else ends
            else:
                tokens = trees.join(found, on="tree_id", how="left", maintain_order="left")
                sizes = tokens["tokens"].to_numpy()
        cuts = list(_groups(trees["n"].to_numpy(), sizes, batch_size, max_tokens))
        return BatchPlan(self, policy_version, frame, trees, cuts, layout, max_tokens, whole)

    def _tree_tokens(
        self, policy_version: int, steps: pl.DataFrame, layout: Layout
    ) -> pl.DataFrame | None:
        """Per tree of `steps` (tree_id, tokens): its tokens in `layout`, without reading a
        token: flat, the steps' lengths; tree, its stored segments' (None when the stored
        trees do not stand for exactly these steps)."""
        if layout == "flat":
            length = pl.col("prompt_len") + pl.col("response_len")
            return steps.group_by("tree_id").agg(tokens=length.sum().cast(pl.Int64))
        columns = ["tree_id", "step_key", "start_depth", "end_depth"]
        segments = self._segments(policy_version, steps, None, columns)
        if segments is None:
            return None
        own = pl.col("end_depth") - pl.col("start_depth")
        return segments.group_by("tree_id").agg(tokens=own.sum().cast(pl.Int64))

    def _pack_trees(
        self,
        policy_version: int,
        frame: pl.DataFrame,
        trees: pl.DataFrame,
        layout: Layout,
        everything: bool,
    ) -> tuple[Packed, pl.DataFrame]:
        """The steps of `frame` (whole trees of one partition, `everything` when all of it)
        packed with their trees in the order of `trees`, from the stored trees or their
        tokens; and `frame` as packed (with its tokens when read)."""
        segments = self.stored_trees(policy_version, frame) if layout == "tree" else None
        if segments is None:  # flat, a partly consumed partition, or no usable stored trees
            rows = self._scan().filter(pl.col("policy_version") == policy_version)
            if not everything:
                rows = rows.filter(pl.col("step_key").is_in(frame["step_key"].implode()))
            tokens = rows.select("step_key", "prompt_ids", "response_ids").collect()
            frame = frame.join(tokens, on="step_key", how="left", maintain_order="left")
        ranked = trees.select("tree_id").with_row_index("rank")
        rank = frame.select("tree_id").join(ranked, on="tree_id", how="left", maintain_order="left")
        return pack(frame, rank["rank"].to_numpy().astype(np.int64), layout, segments), frame

    def stored_trees(
        self, policy_version: int, steps: pl.DataFrame, version: int | None = None
    ) -> pl.DataFrame | None:
        """The stored prefix trees (`gold/trees` segments) of the trees of `steps` (step_key,
        tree_id, prompt_len, response_len: a partition, or some of its trees), as written
        with the rows of this dataset version (or `version`), found through lineage; None
        when they cannot stand for exactly those steps."""
        columns = ["segment", "tree_id", "parent", "start_depth", "end_depth", "tokens", "step_key"]
        return self._segments(policy_version, steps, version, columns)

    def _segments(
        self, policy_version: int, steps: pl.DataFrame, version: int | None, columns: list[str]
    ) -> pl.DataFrame | None:
        """`stored_trees`, reading only `columns` (which must hold tree_id, step_key and
        end_depth: the check that the segments stand for exactly `steps` reads them)."""
        if not (self.lake.exists(GOLD_LINEAGE) and self.lake.exists(self.trees_table)):
            return None
        at = self.version if version is None else version
        written = (
            self._lineage_rows(self.lake.version(GOLD_LINEAGE))
            .filter(
                (pl.col("policy_version") == policy_version) & (pl.col("dataset_version") <= at)
            )
            .sort("dataset_version", maintain_order=True)
        )
        if written.is_empty() or written["trees_version"][-1] is None:
            return None
        trees = steps["tree_id"].unique().implode()
        segments = self.lake.read(
            self.trees_table,
            int(written["trees_version"][-1]),
            columns=columns,
            where=(pl.col("policy_version") == policy_version) & pl.col("tree_id").is_in(trees),
        )
        expected = steps.select(
            "step_key", "tree_id", end_depth=pl.col("prompt_len") + pl.col("response_len")
        )
        found = segments.select("step_key", "tree_id", "end_depth")
        if found.height != expected.height or not found.sort("step_key").equals(
            expected.sort("step_key"), null_equal=True
        ):
            return None
        return segments

    def _log(self, consumer: str, policy_version: int, index: int, step_keys: list[str]) -> None:
        row = {
            "consumer": consumer,
            "dataset": self.name,
            "dataset_version": self.version,
            "policy_version": policy_version,
            "batch_index": index,
            "step_keys": step_keys,
            "consumed_at": datetime.now(UTC),
            "kind": "batches",
        }
        self.lake.append(GOLD_CONSUMPTION_SPEC, pa.Table.from_pylist([row]))

    # -- live delivery ----------------------------------------------------------------------
    def next_batch(
        self,
        groups: int | None = None,
        *,
        consumer: str,
        max_tokens: int | None = None,
        min_policy_version: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        timeout: float | None = None,
        layout: Layout = "tree",
        poll_s: float = 0.2,
    ) -> Batch | None:
        """The next `groups` whole prompt groups (default 1; with `max_tokens`, as many as
        fit, at least one) that `consumer` rank `rank` of `world_size` has not been given,
        from the newest version of the dataset, oldest landed first. Blocks until they exist;
        None when `timeout` seconds pass first. Policy versions below `min_policy_version`
        (default: the newest published minus the spec's `max_policy_staleness`) are left out.
        Each batch is recorded in `gold/consumption` before it is returned: a group is
        delivered once per consumer rank, across restarts (`replay` re-reads a batch)."""
        _check_delivery(groups, max_tokens, rank, world_size, layout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch, _ = until_landed(
                lambda: self._deliver(
                    groups, consumer, max_tokens, min_policy_version, rank, world_size, layout
                ),
                f"delivery to {consumer}",
            )
            if batch is not None:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    def follow(
        self,
        groups: int | None = None,
        *,
        consumer: str,
        stop: Callable[[], bool] | None = None,
        poll_s: float = 0.2,
        **options: Any,
    ) -> Iterator[Batch]:
        """`next_batch` after `next_batch` as the dataset grows, until `stop()` says so (or for
        ever); the same options."""
        while stop is None or not stop():
            batch = self.next_batch(groups, consumer=consumer, timeout=poll_s, **options)
            if batch is not None:
                yield batch

    def replay(
        self, consumer: str, rank: int = 0, after_batch: int = -1, layout: Layout = "tree"
    ) -> Iterator[Batch]:
        """The batches `next_batch` delivered to `consumer` rank `rank` after batch index
        `after_batch`, rebuilt exactly (each at its recorded dataset version): a trainer that
        restarts from a checkpoint trains on them again, then goes on with `next_batch`."""
        if not self.lake.exists(GOLD_CONSUMPTION):
            return
        rows = (
            self.lake.scan(GOLD_CONSUMPTION)
            .filter(
                (pl.col("dataset") == self.name)
                & (pl.col("consumer") == consumer)
                & (pl.col("kind") == NEXT)
                & (pl.col("rank") == rank)
                & (pl.col("batch_index") > after_batch)
            )
            .sort("batch_index")
            .collect()
        )
        for row in rows.iter_rows(named=True):
            frame = (
                self.lake.scan(self.table, row["dataset_version"])
                .filter(pl.col("step_key").is_in(row["step_keys"]))
                .select(BATCH_READ_COLUMNS)
                .collect()
            )
            batch = self._pack(frame, row["dataset_version"], layout)
            batch.contract = self.contract(batch, frame, row["dataset_version"])
            batch.groups, batch.batch_index = list(row["groups"]), row["batch_index"]
            yield batch

    def _deliver(
        self,
        groups: int | None,
        consumer: str,
        max_tokens: int | None,
        min_policy_version: int | None,
        rank: int,
        world_size: int,
        layout: Layout,
    ) -> Batch | None:
        """One attempt: choose from the newest version, pack, record (guarded), or None."""
        book = self._ledger(consumer, rank)
        version = self.lake.version(self.table)
        columns = list(dict.fromkeys([*BATCH_READ_COLUMNS, *UNIT_COLUMNS]))
        if self._newest is None:
            self._newest = LiveRows.read(self.lake, self.table, version, columns)
        self._newest = live = self._newest.at(self.lake, self.table, version, columns)
        floor = self.staleness_floor() if min_policy_version is None else min_policy_version
        units = available_units(live.units, book.units, floor, rank, world_size)
        chosen = choose(units, groups, max_tokens)
        if chosen is None:
            return None
        frame = live.rows_of(chosen).drop("unit")
        batch = self._pack(frame.select(BATCH_READ_COLUMNS), version, layout)
        batch.contract = self.contract(batch, frame, version)
        failed = blocking_failures(batch.contract)
        newest = int(frame["policy_version"].max())
        written = record_delivery(
            self.lake,
            self.name,
            version,
            consumer,
            rank,
            world_size,
            book,
            chosen,
            batch.step_keys,
            newest,
            REFUSED if failed else NEXT,
        )
        self._books[consumer, rank] = Ledger(written, book.units | set(chosen), book.next_index + 1)
        if failed:  # recorded as refused (never offered again), never returned
            raise ContractViolation(batch.contract, failed)
        batch.groups, batch.batch_index = chosen, book.next_index
        return batch

    # -- contract ---------------------------------------------------------------------------
    def contract(
        self, batch: Batch, rows: pl.DataFrame, version: int | None = None
    ) -> ContractReport:
        """The contract report of `batch` (its steps' gold rows in `rows`, BATCH_READ_COLUMNS)
        as of dataset version `version` (default: this one)."""
        at = self.version if version is None else version
        versions = tuple(sorted({int(v) for v in batch.step_policy_versions.tolist()}))
        judged = self._verdicts(batch, rows, versions or (batch.policy_version,), at)
        return judged.report(self.name, at, batch.step_keys)

    def _verdicts(
        self, laid_out: Any, rows: pl.DataFrame, versions: tuple[int, ...], at: int | None = None
    ) -> Verdicts:
        """The contract's verdicts on the steps of `laid_out` (a batch, or a packed
        partition) of policy `versions`, as of dataset version `at` (default: this one)."""
        spec, hashes = self._lineage_specs(self.version if at is None else at)
        return verdicts(
            spec,
            {v: hashes[v] for v in versions if v in hashes},
            rows,
            laid_out,
            self.staleness_floor(),
            self._left_out(versions),
        )

    def _lineage_specs(self, at: int) -> tuple[CurationSpec | None, dict[int, str]]:
        """The spec of the newest write at or before dataset version `at`, and the spec hash
        of each partition's newest write (cached per lineage version)."""
        lineage = self.lake.version(GOLD_LINEAGE)
        kept = self._specs.get(at)
        if kept is not None and kept[0] == lineage:
            return kept[1]
        found: tuple[CurationSpec | None, dict[int, str]] = (None, {})
        if lineage is not None:
            rows = self._lineage_rows(lineage).filter(pl.col("dataset_version") <= at)
            if rows.height:
                spec = self._spec_of(rows["spec_hash"][-1])
                latest = rows.group_by("policy_version").agg(pl.col("spec_hash").last())
                found = spec, {int(v): h for v, h in latest.iter_rows()}
        self._specs = {at: (lineage, found)}  # live delivery asks of the newest version
        return found

    def _lineage_rows(self, lineage: int) -> pl.DataFrame:
        """This dataset's lineage rows (LINEAGE_COLUMNS) in written order, as of lineage
        version `lineage`: the rows written since the last call are read (the change feed),
        not the whole table."""
        kept = self._lineage
        if kept is not None and kept[0] == lineage:
            return kept[1]
        mine = pl.col("dataset") == self.name
        new = None
        if kept is not None and kept[0] < lineage:
            added = self.lake.changes(GOLD_LINEAGE, kept[0], lineage, [*LINEAGE_COLUMNS, "dataset"])
            if added is not None:
                new = pl.from_arrow(added).filter(mine).select(LINEAGE_COLUMNS)
                new = pl.concat([kept[1], new], how="vertical_relaxed")
        if new is None:
            new = self.lake.read(GOLD_LINEAGE, lineage, columns=LINEAGE_COLUMNS, where=mine)
        rows = new.sort("written_at", maintain_order=True)
        self._lineage = lineage, rows
        return rows

    def _spec_of(self, spec_hash: str) -> CurationSpec:
        """The spec with this hash, as lineage recorded it (read once per hash)."""
        if spec_hash not in self._spec_by_hash:
            text = (
                self.lake.scan(GOLD_LINEAGE)
                .filter((pl.col("dataset") == self.name) & (pl.col("spec_hash") == spec_hash))
                .select("spec_json")
                .head(1)
                .collect()["spec_json"][0]
            )
            self._spec_by_hash[spec_hash] = CurationSpec.model_validate_json(text)
        return self._spec_by_hash[spec_hash]

    def _left_out(self, versions: tuple[int, ...]) -> dict[str, int]:
        """Steps the spec left out of these partitions, per reason (gold/rejections)."""
        table = gold_rejection_table(self.name)
        if not self.lake.exists(table):
            return {}
        key = (self.lake.version(table), versions)
        if self._rejections is None or self._rejections[0] != key:
            counts = (
                self.lake.read(
                    table, columns=["reason"], where=pl.col("policy_version").is_in(list(versions))
                )
                .group_by("reason")
                .agg(pl.len())
            )
            self._rejections = key, {r: int(n) for r, n in counts.iter_rows()}
        return self._rejections[1]

    def _ledger(self, consumer: str, rank: int) -> Ledger:
        """The consumer rank's deliveries: as this object last wrote them when nobody has
        written since, else read again."""
        kept = self._books.get((consumer, rank))
        if kept is not None and self.lake.version(GOLD_CONSUMPTION) == kept.version:
            return kept
        self._books[consumer, rank] = book = ledger(self.lake, self.name, consumer, rank)
        return book

    def staleness_floor(self) -> int | None:
        """The oldest policy version the dataset's spec still admits: the newest published
        minus its `max_policy_staleness` (None when either is unknown)."""
        inputs = (self.lake.version(GOLD_LINEAGE), self.lake.version(GOLD_POLICY_VERSIONS))
        if self._floor is None or self._floor[0] != inputs:
            self._floor = inputs, self._staleness_floor()
        return self._floor[1]

    def _staleness_floor(self) -> int | None:
        published = policy.published_version(self.lake)
        if published is None:
            return None
        spec, _ = self._lineage_specs(self.lake.version(self.table))  # the newest write's
        if spec is None or spec.max_policy_staleness is None:
            return None
        return published - spec.max_policy_staleness

    def _pack(self, frame: pl.DataFrame, version: int, layout: Layout) -> Batch:
        """One batch of `frame`'s steps (BATCH_STEP_COLUMNS and policy_version, at dataset version
        `version`; whole trees, possibly of several partitions), trees in id order."""
        segments = None
        if layout == "tree":
            found = []
            for (policy_version,), part in frame.group_by("policy_version"):
                stored = self.stored_trees(int(policy_version), part, version)
                if stored is None:
                    break
                found.append(stored.with_columns(policy_version=pl.lit(policy_version, pl.Int64)))
            else:
                segments = pl.concat(found) if found else None
        if segments is None:
            tokens = (
                self.lake.scan(self.table, version)
                .filter(pl.col("step_key").is_in(frame["step_key"].implode()))
                .select("step_key", "prompt_ids", "response_ids")
                .collect()
            )
            frame = frame.join(tokens, on="step_key", how="left", maintain_order="left")
        # trees are told apart by partition too: a trajectory may span policy versions
        within = pl.col("policy_version").cast(pl.String) + ":" + pl.col("tree_id")
        frame = frame.with_columns(tree_id=within)
        if segments is not None:
            segments = segments.with_columns(tree_id=within).drop("policy_version")
        trees = frame.group_by("tree_id").agg(pl.len().alias("n")).sort("tree_id")
        trees = trees.with_row_index("rank")
        rank = frame.select("tree_id").join(trees, on="tree_id", how="left", maintain_order="left")
        packed = pack(frame, rank["rank"].to_numpy().astype(np.int64), layout, segments)
        newest = int(frame["policy_version"].max()) if frame.height else 0
        batch = _batch(packed, 0, frame.height, newest)
        version_of = dict(zip(frame["step_key"], frame["policy_version"], strict=True))
        batch.step_policy_versions = np.array(
            [version_of[k] for k in batch.step_keys], dtype=np.int64
        )
        return batch


def _refuse_if_blocked(report: ContractReport) -> None:
    """Raise ContractViolation when the batch fails a check its spec makes blocking."""
    failed = blocking_failures(report)
    if failed:
        raise ContractViolation(report, failed)


def _check_delivery(
    groups: int | None, max_tokens: int | None, rank: int, world_size: int, layout: str
) -> None:
    """One clear error naming the argument, before anything is read."""
    if groups is not None and groups < 1:
        raise ValueError(f"groups must be at least 1, not {groups}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), not {rank}")
    if layout not in ("tree", "flat"):
        raise ValueError(f"layout must be 'tree' or 'flat', not {layout!r}")


def _groups(
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


def open_dataset(name: str, lake_uri: str | None = None, version: int | None = None) -> Dataset:
    """A gold dataset by name, from `lake_uri` (default: `CLAW_LAKE_URI`), at a Delta version
    (default: the newest)."""
    settings = ClawSettings().with_overrides(lake_uri=lake_uri)
    return Dataset(Lake.from_settings(settings), name, version)


def publish_policy_version(
    version: int, lake_uri: str | None = None, by: str | None = None, note: str | None = None
) -> int:
    """Record that the trainer's policy `version` is current (newer than every published one):
    the gateway stamps it on steps that name none, and staleness counts from it."""
    settings = ClawSettings().with_overrides(lake_uri=lake_uri)
    return policy.publish_policy_version(Lake.from_settings(settings), version, by, note)


def current_policy_version(lake_uri: str | None = None) -> int | None:
    """The newest published policy version (None before the first)."""
    settings = ClawSettings().with_overrides(lake_uri=lake_uri)
    return policy.published_version(Lake.from_settings(settings))
