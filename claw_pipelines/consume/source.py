"""A gold dataset's tables as trainers read them: its rows at a dataset version, their tokens,
the stored prefix trees (`gold/trees`, found through lineage) that stand for some of its steps,
and steps laid out for training from either: the one place steps are packed (offline
partitions and live batches alike).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import polars as pl
from deltalake.exceptions import DeltaError

from claw_pipelines.consume.lineage import Lineage
from claw_pipelines.consume.report import CONTRACT_COLUMNS
from claw_pipelines.contracts.errors import NotFound
from claw_pipelines.contracts.tables import (
    GOLD_DATASET_SCHEMA,
    GOLD_LINEAGE,
    gold_dataset_table,
    gold_tree_table,
)
from claw_pipelines.lake.catalog import gold_datasets, lake_exists
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import prompt_columns, with_prompts
from claw_pipelines.transforms.packing import Layout, Packed, StoredTreesMismatch, pack

BATCH_STEP_COLUMNS = [
    "step_key",
    "tree_id",
    "prompt_len",
    "response_len",
    "response_mask",
    "reward",
    "advantage",
    "policy_version_runs",  # per-token policy versions (packing.VERSION_COLUMNS)
    "policy_run_lengths",
]
# what a batch's steps are read with: their training columns and what the contract checks
BATCH_READ_COLUMNS = list(dict.fromkeys([*BATCH_STEP_COLUMNS, *CONTRACT_COLUMNS]))
_DECLARED = pl.from_arrow(GOLD_DATASET_SCHEMA.empty_table()).schema  # gold's column types
# what packing reads of steps whose trees are rebuilt (or laid out flat), and of steps that
# captured behaviour log-probs (read only when one of them did)
TOKEN_COLUMNS = ("prompt_ids", "response_ids")
BEHAVIOUR_COLUMNS = ("rollout_log_probs",)
# what `stored_trees` reads of a partition's segments
SEGMENT_COLUMNS = ["segment", "tree_id", "parent", "start_depth", "end_depth", "tokens", "step_key"]

log = logging.getLogger(__name__)


def listed(values: Sequence[object], none: str) -> str:
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


class GoldSource:
    """The tables of gold dataset `name`: every read takes the dataset version it is at."""

    def __init__(self, lake: Lake, name: str, lineage: Lineage) -> None:
        self.lake, self.name, self.lineage = lake, name, lineage
        self.table = gold_dataset_table(name)
        self.trees_table = gold_tree_table(name)
        self.token_versions = True  # batches carry token_policy_versions

    # -- versions and steps -----------------------------------------------------------------
    def pinned(self, version: object | None) -> int:
        """The dataset version to read: `version`, or the newest; NotFound when the lake, the
        dataset or that version is not there (or its log can no longer be read)."""
        require_lake(self.lake)
        newest = self.lake.version(self.table)
        if newest is None:
            known = listed(gold_datasets(self.lake), "none yet: `claw materialize` builds them")
            raise NotFound(f"no gold dataset {self.name!r} in {self.lake.uri} (datasets: {known})")
        return newest if version is None else self._readable(version, newest)

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

    def scan(self, at: int) -> pl.LazyFrame:
        """The dataset's rows at version `at`."""
        return self.lake.scan(self.table, at)

    def read(self, frame: pl.LazyFrame, columns: list[str]) -> pl.DataFrame:
        """`columns` of a scan of the dataset; one declared since the version it reads was
        written (a table written before it) as typed nulls."""
        have = set(frame.collect_schema().names())
        nulls = [pl.lit(None, _DECLARED[c]).alias(c) for c in columns if c not in have]
        return frame.with_columns(nulls).select(columns).collect()

    def policy_versions(self, at: int) -> list[int]:
        """The policy versions (partitions) version `at` of the dataset holds."""
        versions = self.scan(at).select(pl.col("policy_version").unique()).collect()
        return sorted(int(v) for v in versions["policy_version"].to_list())

    def missing_policy_version(self, policy_version: int, at: int) -> NotFound:
        """The error for a policy version dataset version `at` does not hold."""
        held = listed(self.policy_versions(at), "none")
        return NotFound(
            f"dataset {self.name!r} (version {at}) has policy versions {held}; "
            f"policy version {policy_version} does not exist"
        )

    def steps(self, at: int, policy_version: int | None = None) -> pl.DataFrame:
        """The steps at version `at` (of one policy version when given: NotFound when it
        holds none of it), in step order."""
        frame = self.scan(at)
        if policy_version is not None:
            frame = frame.filter(pl.col("policy_version") == policy_version)
        steps = frame.sort("policy_version", "tree_id", "segment").collect()
        if policy_version is not None and steps.is_empty():
            raise self.missing_policy_version(policy_version, at)
        return self.whole_prompts(steps, at)

    def whole_prompts(self, rows: pl.DataFrame, at: int) -> pl.DataFrame:
        """`rows` of the dataset at version `at` with their whole `prompt_ids` (gold keeps a
        prompt relative to an earlier step of its tree, docs/DESIGN.md §18): what a tree's
        other steps hold is read from the same version when `rows` lack them."""
        partitions = rows["policy_version"].unique().implode()
        where = pl.col("policy_version").is_in(partitions)
        return with_prompts(self.lake, self.table, at, rows, where=where)

    def batch_rows(self, policy_version: int, at: int) -> pl.DataFrame:
        """A partition's steps as batches read them (BATCH_READ_COLUMNS: no token), NotFound
        when version `at` holds none of it."""
        in_partition = self.scan(at).filter(pl.col("policy_version") == policy_version)
        frame = self.read(in_partition, BATCH_READ_COLUMNS)
        if frame.is_empty():
            raise self.missing_policy_version(policy_version, at)
        return frame

    def tokens(
        self,
        at: int,
        steps: pl.DataFrame,
        policy_version: int | None = None,
        every_step: bool = False,
        columns: tuple[str, ...] = TOKEN_COLUMNS,
    ) -> pl.DataFrame:
        """(step_key, `columns`: by default prompt_ids, response_ids) of `steps` at version
        `at`: of partition `policy_version` when given, and all of its steps when
        `every_step` (no key lookup); otherwise read from the partitions of `steps` only
        (their `policy_version`, when they carry it: a live batch's few steps would
        otherwise be looked for in every file of the dataset)."""
        rows = self.scan(at)
        if policy_version is not None:
            rows = rows.filter(pl.col("policy_version") == policy_version)
        elif "policy_version" in steps.columns and not steps["policy_version"].has_nulls():
            partitions = steps["policy_version"].unique().implode()
            rows = rows.filter(pl.col("policy_version").is_in(partitions))
        if not every_step:
            rows = rows.filter(pl.col("step_key").is_in(steps["step_key"].implode()))
        if "prompt_ids" not in columns:
            return rows.select("step_key", *columns).collect()
        read = self.read(rows, prompt_columns(["step_key", *columns], self.table))
        return self.whole_prompts(read, at).select("step_key", *columns)

    # -- stored trees -----------------------------------------------------------------------
    def stored_trees(
        self, policy_version: int, steps: pl.DataFrame, at: int
    ) -> pl.DataFrame | None:
        """The stored prefix trees (`gold/trees` segments) of the trees of `steps` (step_key,
        tree_id, prompt_len, response_len: a partition, or some of its trees), as written
        with the rows of dataset version `at`, found through lineage; None when they cannot
        stand for exactly those steps."""
        return self.segments(policy_version, steps, at, SEGMENT_COLUMNS)

    def segments(
        self, policy_version: int, steps: pl.DataFrame, at: int, columns: list[str]
    ) -> pl.DataFrame | None:
        """`stored_trees`, reading only `columns` (which must hold tree_id, step_key and
        end_depth: the check that the segments stand for exactly `steps` reads them)."""
        if not (self.lake.exists(GOLD_LINEAGE) and self.lake.exists(self.trees_table)):
            return None
        written = self.lineage.written(policy_version, at)
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

    def tree_tokens(
        self, policy_version: int, steps: pl.DataFrame, layout: Layout, at: int
    ) -> pl.DataFrame | None:
        """Per tree of `steps` (tree_id, tokens): its tokens in `layout`, without reading a
        token: flat, the steps' lengths; tree, its stored segments' (None when the stored
        trees do not stand for exactly these steps)."""
        if layout == "flat":
            length = pl.col("prompt_len") + pl.col("response_len")
            return steps.group_by("tree_id").agg(tokens=length.sum().cast(pl.Int64))
        columns = ["tree_id", "step_key", "start_depth", "end_depth"]
        segments = self.segments(policy_version, steps, at, columns)
        if segments is None:
            return None
        own = pl.col("end_depth") - pl.col("start_depth")
        return segments.group_by("tree_id").agg(tokens=own.sum().cast(pl.Int64))

    # -- packing ----------------------------------------------------------------------------
    def pack(
        self,
        frame: pl.DataFrame,
        trees: pl.DataFrame,
        layout: Layout,
        segments: pl.DataFrame | None,
        at: int,
        policy_version: int | None = None,
        every_step: bool = False,
        stale_floor: int | None = None,
    ) -> tuple[Packed, pl.DataFrame]:
        """The steps of `frame` (whole trees) packed with their trees in the order of `trees`
        (tree_id): from `segments`, their stored trees, or when None from their tokens, read
        at dataset version `at` (see `tokens`), with their behaviour log-probs when a step
        of `frame` captured them (`has_log_probs`, read beside the tokens or alone); and
        `frame` as packed (with what was read). `stale_floor`: response tokens of older
        policy versions are masked out of the loss (a spec with token-level staleness)."""
        captured = "has_log_probs" not in frame.columns or bool(frame["has_log_probs"].any())
        behaviour = BEHAVIOUR_COLUMNS if captured else ()
        columns = behaviour if segments is not None else (*TOKEN_COLUMNS, *behaviour)
        if columns:  # tokens: flat, a partly consumed partition, or no usable stored trees
            read = self.tokens(at, frame, policy_version, every_step, columns)
            frame = frame.join(read, on="step_key", how="left", maintain_order="left")
        ranked = trees.select("tree_id").with_row_index("rank")
        rank = frame.select("tree_id").join(ranked, on="tree_id", how="left", maintain_order="left")
        ranks = rank["rank"].to_numpy().astype(np.int64)
        try:
            packed = pack(
                frame,
                ranks,
                layout,
                segments,
                token_versions=self.token_versions,
                stale_floor=stale_floor,
            )
        except StoredTreesMismatch:  # (writers of other shards in between): from the tokens
            log.warning(
                "%s v%s: stored trees do not fit the batch; built from tokens", self.name, at
            )
            bare = frame.drop([c for c in behaviour if c in frame.columns])
            return self.pack(bare, trees, layout, None, at, policy_version, every_step, stale_floor)
        return packed, frame

    def pack_partition(
        self,
        policy_version: int,
        frame: pl.DataFrame,
        trees: pl.DataFrame,
        layout: Layout,
        everything: bool,
        at: int,
        stale_floor: int | None = None,
    ) -> tuple[Packed, pl.DataFrame]:
        """`pack` for steps of one partition (whole trees, `everything` when all of it at
        version `at`), from its stored trees when they stand for those steps."""
        segments = self.stored_trees(policy_version, frame, at) if layout == "tree" else None
        return self.pack(
            frame, trees, layout, segments, at, policy_version, everything, stale_floor
        )
