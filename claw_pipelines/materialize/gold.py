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

from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    GOLD_LINEAGE,
    GOLD_POLICY_VERSIONS,
    GOLD_REJECTION_SCHEMA,
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    TableSpec,
    gold_dataset_spec,
    gold_rejection_spec,
    gold_tree_spec,
    gold_tree_table,
)
from claw_pipelines.lake.delta import Guard, Lake, conform, until_landed
from claw_pipelines.lake.prompts import prompt_columns, with_prompts
from claw_pipelines.lake.specs import SpecError, load_spec
from claw_pipelines.materialize.silver import silver_state
from claw_pipelines.transforms.contexts import (
    CARRIED_REFERENCE,
    REFERENCE_COLUMNS,
    encode_prompts,
    full_layout,
)
from claw_pipelines.transforms.curation import (
    CANDIDATE_STEP_COLUMNS,
    GROUP,
    candidates,
    classify,
    judged,
    kept_steps,
    rejected_steps,
    tree_ids,
)
from claw_pipelines.transforms.prefix_tree import (
    PrefixForest,
    build_forest,
    build_forest_from_parts,
)
from claw_pipelines.transforms.quality import (
    Finding,
    groups_are_complete,
    partition_within_staleness,
    steps_in_one_partition,
    trees_are_minimal,
    trees_rebuild_steps,
)

SILVER_COLUMNS_FOR_GOLD = [*CANDIDATE_STEP_COLUMNS, "model", "created_at", "event_id"]
# what a spec with `reward_judge` reads of silver/feedback
JUDGE_FACT_COLUMNS = [
    "feedback_id",
    "step_key",
    "kind",
    "value_number",
    "judge",
    "judge_version",
    "created_at",
    "received_at",
]
TOKEN_COLUMNS = ["step_key", "prompt_ids", "response_ids", "rollout_log_probs", "response_mask"]
# silver's stored reference of a step's prompt, carried beside its whole prompt: gold keeps it
# when the step it names is in the same tree of the same partition (`stored_layout`)
SILVER_REFERENCE = list(CARRIED_REFERENCE.values())


@dataclass
class GoldPartition:
    """What one partition write read and wrote (for an increment: the trees it rewrote)."""

    dataset: str
    policy_version: int
    spec: CurationSpec
    source_versions: dict[str, int | str | None]
    steps: pl.DataFrame = field(default_factory=pl.DataFrame)
    rejected: pl.DataFrame = field(default_factory=pl.DataFrame)  # the steps left out
    forest: PrefixForest | None = None
    newest_version: int = 0
    dataset_version: int | None = None
    trees_version: int | None = None
    rejections_version: int | None = None
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


def source_versions(
    lake: Lake, at: int | None = None, slot: Slot | None = None
) -> dict[str, int | None]:
    """The silver table versions a gold build reads (as the last completed silver run left
    them, or the last at or before marker version `at`; a shard's: its own last run), the
    bronze version behind them, and the published policy versions' table."""
    state = silver_state(lake, at, slot)
    tables = (SILVER_STEPS, SILVER_STEP_REWARDS, SILVER_TRAJECTORIES, SILVER_FEEDBACK)
    versions = {t: state.versions[t] for t in tables}
    published = lake.version(GOLD_POLICY_VERSIONS)
    return versions | {"bronze/events": state.bronze_version, GOLD_POLICY_VERSIONS: published}


def published_newest(lake: Lake, versions: dict[str, int | None]) -> int:
    """The newest policy version published at `versions` (0 when none is)."""
    if versions.get(GOLD_POLICY_VERSIONS) is None:
        return 0
    published = lake.read(
        GOLD_POLICY_VERSIONS, versions[GOLD_POLICY_VERSIONS], columns=["policy_version"]
    )["policy_version"].max()
    return 0 if published is None else int(published)


def newest_policy(lake: Lake, versions: dict[str, int | None], steps: pl.DataFrame) -> int:
    """The version staleness counts from: the newest published, or in silver if newer."""
    in_silver = steps["policy_version"].max()
    return max(0 if in_silver is None else int(in_silver), published_newest(lake, versions))


def candidate_steps(lake: Lake, versions: dict[str, int | None]) -> pl.DataFrame:
    """Every silver step (small columns) beside its reward and trajectory, at `versions`:
    what any spec curates from."""
    steps = lake.read(SILVER_STEPS, versions[SILVER_STEPS], columns=SILVER_COLUMNS_FOR_GOLD)
    rewards = lake.read(SILVER_STEP_REWARDS, versions[SILVER_STEP_REWARDS])
    trajectories = lake.read(SILVER_TRAJECTORIES, versions[SILVER_TRAJECTORIES])
    return candidates(steps, rewards, trajectories)


@dataclass(frozen=True)
class Part:
    """Some groups of silver to curate alone: their `candidates`, and what curation needs
    of the rest (the newest policy version, the deadline clock, the judges' facts)."""

    frame: pl.DataFrame
    newest: int
    clock: datetime | None
    facts: pl.DataFrame | None = None  # silver/feedback rows of the part's steps


def classified(
    lake: Lake,
    spec: CurationSpec,
    versions: dict[str, int | None],
    frame: pl.DataFrame | Part | None = None,
    trail: tuple[str, ...] = (),
) -> pl.DataFrame:
    """Every step the spec draws from (silver, or another dataset's rejections when it
    re-admits them) classified by it (`classify`: its reasons, null when kept), at the
    pinned `versions`. `frame`: `candidate_steps` at `versions`, when already at hand, or a
    `Part` of it."""
    frame = candidate_steps(lake, versions) if frame is None else frame
    if isinstance(frame, Part):
        part = frame
    else:
        part = Part(frame, newest_policy(lake, versions, frame), None)
    pool = part.frame
    if spec.readmit is not None:
        pool = readmitted(lake, spec, versions, part, trail)
    if spec.reward_judge is not None:
        judge, pinned = spec.reward_judge, versions.get(SILVER_FEEDBACK)
        facts = part.facts
        if facts is None:
            facts = lake.read(SILVER_FEEDBACK, pinned, columns=JUDGE_FACT_COLUMNS)
        pool = judged(pool, facts.select(JUDGE_FACT_COLUMNS), judge.name, judge.version)
    return classify(pool, spec, part.newest, part.clock)


def readmitted(
    lake: Lake,
    spec: CurationSpec,
    versions: dict[str, int | None],
    frame: pl.DataFrame | Part,
    trail: tuple[str, ...] = (),
) -> pl.DataFrame:
    """The candidate steps `spec.readmit` names: those its dataset's spec rejects (for one
    of the given reasons) at the same silver versions."""
    assert spec.readmit is not None
    trail = (*trail, spec.name)
    source = readmit_source(lake, spec, trail)
    rejected = classified(lake, source, versions, frame, trail).filter(
        pl.col("reason").is_not_null()
    )
    if spec.readmit.reasons is not None:
        rejected = rejected.filter(pl.col("reason").is_in(spec.readmit.reasons))
    pool = frame.frame if isinstance(frame, Part) else frame
    return pool.filter(pl.col("step_key").is_in(rejected["step_key"].implode()))


def readmit_source(lake: Lake, spec: CurationSpec, trail: tuple[str, ...] = ()) -> CurationSpec:
    """The spec whose rejections `spec` re-admits; a SpecError names a missing one or a
    cycle."""
    assert spec.readmit is not None
    name = spec.readmit.dataset
    if name in (*trail, spec.name):
        raise SpecError(f"readmit: {' -> '.join((*trail, name))} is a cycle")
    try:
        return load_spec(lake, name)
    except SpecError as exc:
        raise SpecError(f"readmit: {exc}") from None


def spec_sources(lake: Lake, spec: CurationSpec) -> dict[str, str]:
    """The hashes of the specs a dataset re-admits from (`spec:<name>` -> hash), recorded
    in lineage beside the table versions: a change to one rebuilds the dataset."""
    sources, trail, current = {}, (spec.name,), spec
    while current.readmit is not None:
        current = readmit_source(lake, current, trail)
        trail += (current.name,)
        sources[f"spec:{current.name}"] = current.spec_hash
    return sources


def curated(
    lake: Lake,
    spec: CurationSpec,
    versions: dict[str, int | None],
    frame: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """Every step the spec keeps, over all policy versions (small columns, pinned versions),
    with its `tree_id`. `frame`: `candidate_steps` at `versions`, when already at hand."""
    return curated_and_rejected(lake, spec, versions, frame)[0]


def curated_and_rejected(
    lake: Lake,
    spec: CurationSpec,
    versions: dict[str, int | None],
    frame: pl.DataFrame | Part | None = None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the steps the spec keeps, with `tree_id`; the steps it leaves out, with reasons)."""
    rows = classified(lake, spec, versions, frame)
    kept = kept_steps(rows, spec)
    return kept.with_columns(tree_id=tree_ids(kept, spec)), rejected_steps(rows, spec)


def rejection_rows(rejected: pl.DataFrame, landed_at: datetime) -> pa.Table:
    """The `gold/rejections` rows of rejected steps (in step_key order), stamped."""
    rows = rejected.sort("step_key").with_columns(
        landed_at=pl.lit(landed_at, dtype=pl.Datetime("us", "UTC"))
    )
    return conform(rows.rename({GROUP: "group_key"}).to_arrow(), GOLD_REJECTION_SCHEMA)


def policy_versions(lake: Lake) -> list[int]:
    """The policy versions silver holds (steps without one count as 0)."""
    if not lake.exists(SILVER_STEPS):
        return []
    versions = lake.read(SILVER_STEPS, columns=["policy_version"])["policy_version"]
    return sorted(int(v) for v in versions.fill_null(0).unique().to_list())


def with_tokens(
    lake: Lake, chosen: pl.DataFrame, at: int | None, known: pl.DataFrame | None = None
) -> pl.DataFrame:
    """`chosen` (curated rows) beside their token columns from silver and the reference
    silver stores each prompt with (SILVER_REFERENCE), in step_key order (the canonical order
    trees are merged in). `known` (those columns of steps at hand, e.g. the ones a silver run
    just wrote) saves reading them from silver."""
    ordered = chosen.sort("step_key")
    carried = [*TOKEN_COLUMNS, *SILVER_REFERENCE]
    wanted, parts = ordered["step_key"], []
    if known is not None and known.height:
        index = known.select("step_key").with_row_index("at")
        at_rows = ordered.select("step_key").join(
            index, on="step_key", how="left", maintain_order="left"
        )["at"]
        if not at_rows.null_count():  # all at hand: one gather, or a slice when in order
            return ordered.hstack(_rows_at(known.select(carried[1:]), at_rows).get_columns())
        hit = known.select(carried).filter(pl.col("step_key").is_in(wanted.implode()))
        parts.append(hit)
        wanted = wanted.filter(~wanted.is_in(hit["step_key"].implode()))
    if wanted.len() or not parts:
        versions = ordered["policy_version"].unique().to_list()
        in_partitions = pl.col("policy_version").is_in(versions)
        if 0 in versions:
            in_partitions = in_partitions | pl.col("policy_version").is_null()
        read = lake.read(
            SILVER_STEPS,
            at,
            columns=prompt_columns([*TOKEN_COLUMNS, "trajectory_uid"], SILVER_STEPS),
            where=in_partitions & pl.col("step_key").is_in(wanted.implode()),
        )  # prompts stored relative to earlier steps are read back whole (§18)
        references = read.select(
            "step_key", *[pl.col(c).alias(a) for c, a in CARRIED_REFERENCE.items()]
        )
        whole = with_prompts(lake, SILVER_STEPS, at, read).select(TOKEN_COLUMNS)
        parts.append(whole.join(references, on="step_key", how="left", maintain_order="left"))
    tokens = pl.concat(parts, how="vertical_relaxed")
    # in step_key order with one gather of the token columns (not a join, then a sort)
    return ordered.join(tokens, on="step_key", how="inner", maintain_order="left")


def _rows_at(frame: pl.DataFrame, at: pl.Series) -> pl.DataFrame:
    """`frame`'s rows at the positions `at` (no copy when they are one ascending run)."""
    if at.is_empty():
        return frame.clear()
    first = int(at[0])
    if (
        first + at.len() <= frame.height
        and (at - pl.int_range(at.len(), eager=True)).eq(first).all()
    ):
        return frame.slice(first, at.len())
    return frame[at]


def merge_trees(steps: pl.DataFrame) -> tuple[pl.DataFrame, PrefixForest]:
    """Merge the steps of one partition (with tokens and `tree_id`) into their prefix trees:
    (the steps with their `segment`, numbered within the tree; the forest)."""
    codes = steps["tree_id"].cast(pl.Categorical).to_physical().to_numpy().astype(np.int64)
    parts = [steps["prompt_ids"].to_arrow(), steps["response_ids"].to_arrow()]
    forest = build_forest_from_parts(codes, parts)  # no merged copy of the sequences
    segment = forest.segment_of_row()
    local = segment - forest.tree_first()[segment]
    return steps.with_columns(segment=pl.Series(local, dtype=pl.Int64)), forest


def tree_rows(policy_version: int, steps: pl.DataFrame, forest: PrefixForest) -> pa.Table:
    """One `gold/trees` row per segment of the forest of `steps` (see `merge_trees`);
    segments are numbered within their tree (so a tree's rows do not depend on the other
    trees: increments and full builds write the same rows)."""
    offsets = pa.array(forest.offsets.astype(np.int32))
    first = forest.tree_first()
    path_offsets, path_segments = forest.path_arrays()  # numbered within their tree
    path_segments = path_segments - np.repeat(first, np.diff(path_offsets))
    return pa.table(
        {
            "policy_version": pa.array(np.full(len(forest.row), policy_version), pa.int64()),
            "tree_id": steps["tree_id"].gather(forest.row).to_arrow(),
            "segment": pa.array(np.arange(len(forest.row)) - first, pa.int64()),
            "parent": pa.array(np.where(forest.parent >= 0, forest.parent - first, -1), pa.int64()),
            "start_depth": pa.array(forest.start, pa.int64()),
            "end_depth": pa.array(forest.length, pa.int64()),
            "tokens": pa.ListArray.from_arrays(offsets, pa.array(forest.tokens, pa.int32())),
            "step_key": steps["step_key"].gather(forest.row).to_arrow(),
            "path": pa.ListArray.from_arrays(
                pa.array(path_offsets.astype(np.int32)), pa.array(path_segments, pa.int64())
            ),
        }
    )


def dataset_rows(steps: pl.DataFrame, landed_at: datetime) -> pa.Table:
    """The `gold/datasets` rows of merged steps (with whole prompts), stamped with when they
    landed; each prompt stored relative to an earlier step of its trajectory in its tree
    (`stored_layout`)."""
    return (
        stored_layout(steps)
        .with_columns(landed_at=pl.lit(landed_at, dtype=pl.Datetime("us", "UTC")))
        .to_arrow()
    )


def stored_layout(steps: pl.DataFrame) -> pl.DataFrame:
    """Steps of a gold partition (whole prompts, `tree_id`) as gold stores them: a prompt
    that begins with the tokens of an earlier step of its trajectory in the same tree and
    partition refers to it, so the rows of a tree, which are written and replaced together,
    decode alone. Silver's reference is kept when the step it names is there (both hold the
    same tokens); the other prompts are encoded (`transforms.contexts`; every token is at
    hand and compared)."""
    carried = [c for c in SILVER_REFERENCE if c in steps.columns]
    if steps.is_empty():
        return full_layout(steps).drop(carried)
    scoped = pl.concat_str(
        pl.col("policy_version").cast(pl.String),
        "tree_id",
        "trajectory_uid",
        separator="\x1f",
    )
    missing = [pl.lit(None, pl.String).alias(c) for c in ("response_id",) if c not in steps]
    keyed = steps.with_columns(*missing, trajectory_uid=scoped)
    given = None
    if carried:
        here = keyed.select(silver_prefix_step_key="step_key", scope_there="trajectory_uid")
        given = keyed.select("trajectory_uid", *SILVER_REFERENCE).join(
            here, on="silver_prefix_step_key", how="left", maintain_order="left"
        )
        held = pl.col("scope_there") == pl.col("trajectory_uid")
        given = given.select(
            prefix_step_key=pl.when(held).then("silver_prefix_step_key"),
            prefix_len=pl.when(held).then("silver_prefix_len"),
        )
    encoded = encode_prompts(keyed.drop(carried), keyed.clear().select(REFERENCE_COLUMNS), given)
    return encoded.with_columns(steps["trajectory_uid"]).drop(
        [m.meta.output_name() for m in missing]
    )


def partition_writer(policy_version: int, slot: Slot | None = None) -> str:
    """The application id of the commits that write one policy-version partition (a
    shard's: its share of the partition, docs/DESIGN.md §19)."""
    share = "" if slot is None else f".{slot.index}of{slot.count}"
    return f"claw.gold.v{int(policy_version)}{share}"


def lineage_row(
    spec: CurationSpec,
    policy_version: int,
    sources: dict[str, int | str | None],
    totals: dict[str, int],
    reason: str,
) -> dict[str, Any]:
    """A `gold/lineage` row (without the versions written) for a partition of `totals`
    (steps, trees, raw_tokens, tree_tokens, after the write)."""
    raw, tree = totals["raw_tokens"], totals["tree_tokens"]
    return {
        "dataset": spec.name,
        "policy_version": policy_version,
        "spec_json": spec.canonical_json(),
        "spec_hash": spec.spec_hash,
        "source_versions": json.dumps(sources, sort_keys=True),
        "code_version": code_version(),
        "rows": totals["steps"],
        "steps": totals["steps"],
        "trees": totals["trees"],
        "raw_tokens": raw,
        "tree_tokens": tree,
        "saved_tokens": raw - tree,
        "token_ratio": (tree / raw) if raw else 1.0,
        "reason": reason,
    }


def commit_metadata(lineage: dict[str, Any]) -> dict[str, Any]:
    """What a gold commit records in its Delta commit info: the lineage, spec as `spec`."""
    return {k: v for k, v in lineage.items() if k != "spec_json"} | {"spec": lineage["spec_json"]}


class Curations:
    """A spec's curation of silver (its kept and rejected steps of every policy version) at
    the versions it was made at: the partitions one process builds in a row share it while
    silver and the spec stand, rather than curating the whole of silver once each."""

    def __init__(self) -> None:
        self._at: tuple | None = None
        self._made: tuple[pl.DataFrame, pl.DataFrame] | None = None

    def of(
        self, lake: Lake, spec: CurationSpec, versions: dict[str, int | None], sources: dict
    ) -> tuple[pl.DataFrame, pl.DataFrame]:
        """`curated_and_rejected` at `versions` (with the specs' `sources`), made once."""
        at = (spec.spec_hash, tuple(sorted((versions | sources).items())))
        if self._made is None or self._at != at:
            self._made, self._at = curated_and_rejected(lake, spec, versions), at
        return self._made


def build_partition(
    lake: Lake,
    spec: CurationSpec,
    policy_version: int,
    reason: str = "build",
    curations: Curations | None = None,
) -> GoldPartition:
    """Curate, merge and write one policy version of a dataset; record its lineage (with
    `reason`, e.g. what a repair fixed). A build overtaken by another build of the same
    partition starts again from the new state. `curations`: shared by the partitions built
    in a row."""
    curations = curations or Curations()
    part, part.write_conflicts = until_landed(
        lambda: _build_once(lake, spec, policy_version, reason, curations),
        f"gold {spec.name} v{policy_version}",
    )
    return part


def pin_gold(lake: Lake, spec: CurationSpec) -> dict[str, int]:
    """Create the dataset's tables if missing; the versions a build is based on."""
    tables = (
        gold_dataset_spec(spec.name),
        gold_tree_spec(spec.name),
        gold_rejection_spec(spec.name),
    )
    for table in tables:
        lake.ensure(table)
    return {table.name: lake.version(table.name) for table in tables}


def _build_once(
    lake: Lake, spec: CurationSpec, policy_version: int, reason: str, curations: Curations
) -> GoldPartition:
    """One attempt: pin the gold tables, read silver, build, commit guarded (rejections,
    then dataset, then trees; lineage last)."""
    pins = pin_gold(lake, spec)
    versions = source_versions(lake)
    part = GoldPartition(spec.name, policy_version, spec, versions, reason=reason)
    if versions[SILVER_STEPS] is None:
        return part
    sources = spec_sources(lake, spec)
    part.source_versions = versions | sources
    chosen, rejected = curations.of(lake, spec, versions, sources)
    part.newest_version = int(chosen["newest_policy_version"].max() or 0) if chosen.height else 0
    chosen = chosen.filter(pl.col("policy_version") == policy_version)
    part.rejected = rejected.filter(pl.col("policy_version") == policy_version)
    part.steps, part.forest = merge_trees(with_tokens(lake, chosen, versions[SILVER_STEPS]))
    totals = {
        "steps": part.steps.height,
        "trees": part.steps["tree_id"].n_unique(),
        "raw_tokens": part.raw_tokens,
        "tree_tokens": part.tree_tokens,
    }
    lineage = lineage_row(spec, policy_version, part.source_versions, totals, reason)
    guard = Guard((partition_writer(policy_version),), versions[SILVER_TRAJECTORIES] or 0, pins)
    meta = commit_metadata(lineage)
    landed_at = datetime.now(UTC)

    def replace(table: TableSpec, rows: pa.Table, metadata: dict[str, Any]) -> int:
        """Replace this policy version of one of the dataset's tables, guarded."""
        return lake.replace_partition(
            table, rows, "policy_version", policy_version, metadata=metadata, guard=guard
        )

    part.rejections_version = replace(
        gold_rejection_spec(spec.name), rejection_rows(part.rejected, landed_at), meta
    )
    part.dataset_version = replace(
        gold_dataset_spec(spec.name), dataset_rows(part.steps, landed_at), meta
    )
    part.trees_version = replace(
        gold_tree_spec(spec.name),
        tree_rows(policy_version, part.steps, part.forest),
        meta | {"dataset_version": part.dataset_version, "lineage": [lineage]},
    )
    (part.lineage,) = record_lineage(lake, [lineage], part.dataset_version, part.trees_version)
    return part


def record_lineage(
    lake: Lake, rows: list[dict[str, Any]], dataset_version: int, trees_version: int
) -> list[dict[str, Any]]:
    """Append the lineage rows of one write (its partitions), with the versions it made."""
    written = {
        "dataset_version": dataset_version,
        "trees_version": trees_version,
        "written_at": datetime.now(UTC),
    }
    full = [row | written for row in rows]
    lake.append(GOLD_LINEAGE, pa.Table.from_pylist(full), metadata=commit_metadata(rows[0]))
    return full


def recover_lineage(lake: Lake, dataset: str, slot: Slot | None = None) -> bool:
    """Write the lineage rows of the dataset's newest write (a shard's: its own newest) if a
    writer killed between its trees commit and its lineage append left them out (the trees
    commit carries them)."""
    trees = gold_tree_table(dataset)
    found = None
    if lake.exists(trees) and slot is None:
        found = lake.last_commit_with(trees, "lineage", without="shard")
    elif lake.exists(trees):
        found = lake.last_commit_with(trees, "shard", equal=str(slot))
    if found is None or "lineage" not in found[1]:
        return False
    trees_version, meta = found
    if lake.exists(GOLD_LINEAGE):
        recorded = lake.scan(GOLD_LINEAGE).filter(
            (pl.col("dataset") == dataset) & (pl.col("trees_version") == trees_version)
        )
        if recorded.select(pl.len()).collect().item():
            return False
    record_lineage(lake, meta["lineage"], meta["dataset_version"], trees_version)
    return True


def partition_findings(lake: Lake, part: GoldPartition) -> dict[str, Finding]:
    """The gold checks of one partition write."""
    forest = part.forest or build_forest(np.zeros(0, np.int64), pa.array([], pa.list_(pa.int32())))
    return {
        "steps_rebuild_from_trees": trees_rebuild_steps(forest, part.steps),
        "trees_are_minimal": trees_are_minimal(forest),
        "steps_in_one_partition": steps_in_one_partition(
            lake.read(gold_dataset_spec(part.dataset).name, columns=["step_key"])["step_key"]
            if lake.exists(gold_dataset_spec(part.dataset).name)
            else pl.Series("step_key", [], dtype=pl.String),
            part.steps["step_key"] if part.steps.height else pl.Series("step_key", [], pl.String),
        ),
        "groups_are_complete": groups_are_complete(part.spec, part.steps),
        "partition_within_staleness": partition_within_staleness(
            part.spec, part.policy_version, part.newest_version, part.steps.height
        ),
    }
