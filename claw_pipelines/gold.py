"""Build gold: one (dataset, policy version) partition at a time — read, curate, merge, write.

A partition write replaces exactly that policy version's rows in `gold/datasets/<name>` and
`gold/trees/<name>` (predicate overwrites), then appends one `gold/lineage` row saying what
was read (spec and hash, silver and bronze versions) and what was written.

A build reads silver as of its last completed run (`silver_state`) and pins both gold
tables; its two commits are guarded per partition (`lake.Guard`), so a build that another
build of the same partition overtook starts again from the new state instead of landing
stale rows, and two builds never mix. Its lineage row, written last, names the dataset and
trees versions that belong together; readers take trees only through it.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    GOLD_LINEAGE,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    gold_dataset_spec,
    gold_tree_spec,
)
from claw_pipelines.lake import Guard, Lake, until_landed
from claw_pipelines.quality import (
    Finding,
    group_completeness,
    one_partition_per_step,
    trees_are_minimal,
    trees_rebuild_steps,
    within_staleness,
)
from claw_pipelines.silver import silver_state
from claw_pipelines.transforms.curation import (
    CANDIDATE_STEP_COLUMNS,
    GROUP,
    candidates,
    curate,
    tree_ids,
)
from claw_pipelines.transforms.prefix_tree import PrefixForest, build_forest

STEP_COLUMNS = [*CANDIDATE_STEP_COLUMNS, "model", "created_at", "event_id"]
TOKEN_COLUMNS = ["step_key", "prompt_ids", "response_ids", "rollout_log_probs", "response_mask"]


@dataclass
class GoldPartition:
    """What one partition write read and wrote."""

    dataset: str
    policy_version: int
    spec: CurationSpec
    source_versions: dict[str, int | None]
    steps: pl.DataFrame = field(default_factory=pl.DataFrame)
    forest: PrefixForest | None = None
    newest_version: int = 0
    dataset_version: int | None = None
    trees_version: int | None = None
    lineage: dict[str, Any] = field(default_factory=dict)
    reason: str = "build"
    write_conflicts: int = 0

    @property
    def raw_tokens(self) -> int:
        """Tokens of the partition's steps, unmerged."""
        return self.forest.raw_tokens if self.forest else 0

    @property
    def tree_tokens(self) -> int:
        """Tokens stored in its prefix trees."""
        return self.forest.tree_tokens if self.forest else 0


@cache
def code_version() -> str:
    """The package version, and the git commit when running from a checkout."""
    try:
        version = package_version("claw-lakehouse")
    except PackageNotFoundError:
        version = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{version}+g{commit}" if commit else version


def source_versions(lake: Lake) -> dict[str, int | None]:
    """The silver table versions a gold build reads (as the last completed silver run left
    them), and the bronze version behind them."""
    state = silver_state(lake)
    versions = {
        t: state.versions[t] for t in (SILVER_STEPS, SILVER_STEP_REWARDS, SILVER_TRAJECTORIES)
    }
    return versions | {"bronze/events": state.bronze_version}


def curated(lake: Lake, spec: CurationSpec, versions: dict[str, int | None]) -> pl.DataFrame:
    """Every step the spec keeps, over all policy versions (small columns, pinned versions)."""
    steps = lake.read(SILVER_STEPS, versions[SILVER_STEPS], columns=STEP_COLUMNS)
    rewards = lake.read(SILVER_STEP_REWARDS, versions[SILVER_STEP_REWARDS])
    trajectories = lake.read(SILVER_TRAJECTORIES, versions[SILVER_TRAJECTORIES])
    return curate(candidates(steps, rewards, trajectories), spec)


def policy_versions(lake: Lake) -> list[int]:
    """The policy versions silver holds (steps without one count as 0)."""
    if not lake.exists(SILVER_STEPS):
        return []
    versions = lake.read(SILVER_STEPS, columns=["policy_version"])["policy_version"]
    return sorted(int(v) for v in versions.fill_null(0).unique().to_list())


def _tokens(lake: Lake, version: int, keys: pl.Series, at: int | None) -> pl.DataFrame:
    """Token columns of the given steps of one policy version (its partition only)."""
    in_partition = pl.col("policy_version") == version
    if version == 0:
        in_partition = in_partition | pl.col("policy_version").is_null()
    return (
        lake.scan(SILVER_STEPS, at)
        .filter(in_partition & pl.col("step_key").is_in(keys.implode()))
        .select(TOKEN_COLUMNS)
        .collect()
    )


def _tree_rows(part: GoldPartition, trees: pl.Series) -> pa.Table:
    """One row per segment of the partition's forest; segments are numbered within their
    tree (so a tree's rows do not depend on the other trees: increments and full builds
    write the same rows)."""
    forest = part.forest
    keys = part.steps["step_key"]
    offsets = pa.array(forest.offsets.astype(np.int32))
    first = forest.tree_first()
    paths = [[k - f for k in path] for path, f in zip(forest.paths(), first.tolist(), strict=True)]
    return pa.table(
        {
            "policy_version": pa.array(np.full(len(forest.row), part.policy_version), pa.int64()),
            "tree_id": trees.gather(forest.row).to_arrow(),
            "segment": pa.array(np.arange(len(forest.row)) - first, pa.int64()),
            "parent": pa.array(np.where(forest.parent >= 0, forest.parent - first, -1), pa.int64()),
            "start_depth": pa.array(forest.start, pa.int64()),
            "end_depth": pa.array(forest.length, pa.int64()),
            "tokens": pa.ListArray.from_arrays(offsets, pa.array(forest.tokens, pa.int32())),
            "step_key": keys.gather(forest.row).to_arrow(),
            "path": pa.array(paths, pa.list_(pa.int64())),
        }
    )


def partition_writer(policy_version: int) -> str:
    """The application id of the commits that write one policy-version partition."""
    return f"claw.gold.v{int(policy_version)}"


def build_partition(
    lake: Lake, spec: CurationSpec, policy_version: int, reason: str = "build"
) -> GoldPartition:
    """Curate, merge and write one policy version of a dataset; record its lineage (with
    `reason`, e.g. what a repair fixed). A build overtaken by another build of the same
    partition starts again from the new state."""
    part, part.write_conflicts = until_landed(
        lambda: _build_once(lake, spec, policy_version, reason),
        f"gold {spec.name} v{policy_version}",
    )
    return part


def _build_once(lake: Lake, spec: CurationSpec, policy_version: int, reason: str) -> GoldPartition:
    """One attempt: pin both gold tables, read silver, build, commit guarded."""
    tables = (gold_dataset_spec(spec.name), gold_tree_spec(spec.name))
    pins = {table.name: lake.ensure(table).version() for table in tables}
    versions = source_versions(lake)
    part = GoldPartition(spec.name, policy_version, spec, versions, reason=reason)
    if versions[SILVER_STEPS] is None:
        return part
    chosen = curated(lake, spec, versions)
    newest = chosen["policy_version"].max()
    part.newest_version = int(newest) if newest is not None else 0
    chosen = chosen.filter(pl.col("policy_version") == policy_version)
    tokens = _tokens(lake, policy_version, chosen["step_key"], versions[SILVER_STEPS])
    steps = chosen.join(tokens, on="step_key", how="inner").sort("step_key")  # canonical
    trees = tree_ids(steps, spec)
    sequences = steps.select(pl.concat_list("prompt_ids", "response_ids")).to_series()
    codes = trees.cast(pl.Categorical).to_physical().to_numpy().astype(np.int64)
    part.forest = build_forest(codes, sequences.to_arrow())
    segment = part.forest.segment_of_row()
    local = segment - part.forest.tree_first()[segment]  # numbered within the tree
    part.steps = steps.with_columns(tree_id=trees, segment=pl.Series(local, dtype=pl.Int64))
    guard = Guard(partition_writer(policy_version), versions[SILVER_TRAJECTORIES] or 0, pins)
    _write(lake, part, trees, guard)
    return part


def _write(lake: Lake, part: GoldPartition, trees: pl.Series, guard: Guard) -> None:
    """The partition's two guarded commits, then its lineage row."""
    spec = part.spec
    lineage = {
        "dataset": spec.name,
        "policy_version": part.policy_version,
        "spec_json": spec.canonical_json(),
        "spec_hash": spec.spec_hash,
        "source_versions": json.dumps(part.source_versions, sort_keys=True),
        "code_version": code_version(),
        "rows": part.steps.height,
        "steps": part.steps.height,
        "trees": trees.n_unique(),
        "raw_tokens": part.raw_tokens,
        "tree_tokens": part.tree_tokens,
        "saved_tokens": part.raw_tokens - part.tree_tokens,
        "token_ratio": (part.tree_tokens / part.raw_tokens) if part.raw_tokens else 1.0,
        "reason": part.reason,
    }
    meta = {k: v for k, v in lineage.items() if k != "spec_json"} | {"spec": spec.canonical_json()}
    part.dataset_version = lake.replace_partition(
        gold_dataset_spec(spec.name),
        part.steps.drop(GROUP, strict=False).to_arrow(),
        "policy_version",
        part.policy_version,
        metadata=meta,
        guard=guard,
    )
    part.trees_version = lake.replace_partition(
        gold_tree_spec(spec.name),
        _tree_rows(part, trees),
        "policy_version",
        part.policy_version,
        metadata=meta | {"dataset_version": part.dataset_version},
        guard=guard,
    )
    part.lineage = lineage | {
        "dataset_version": part.dataset_version,
        "trees_version": part.trees_version,
        "written_at": datetime.now(UTC),
    }
    lake.append(GOLD_LINEAGE, pa.Table.from_pylist([part.lineage]), metadata=meta)


def partition_findings(lake: Lake, part: GoldPartition) -> dict[str, Finding]:
    """The gold checks of one partition write."""
    forest = part.forest or build_forest(np.zeros(0, np.int64), pa.array([], pa.list_(pa.int32())))
    return {
        "steps_rebuild_from_trees": trees_rebuild_steps(forest, part.steps),
        "tree_tokens_optimal": trees_are_minimal(forest),
        "one_partition_per_step": one_partition_per_step(
            lake.read(gold_dataset_spec(part.dataset).name, columns=["step_key"])["step_key"]
            if lake.exists(gold_dataset_spec(part.dataset).name)
            else pl.Series("step_key", [], dtype=pl.String)
        ),
        "group_completeness": group_completeness(part.spec, part.steps),
        "within_staleness": within_staleness(
            part.spec, part.policy_version, part.newest_version, part.steps.height
        ),
    }
