"""Build silver from bronze, incrementally: read what bronze gained, transform, append.

Each run reads the bronze versions after the one recorded in the last silver commit (the
change data feed; a full read when the feed cannot answer), places and deduplicates steps
against what silver holds, appends new steps, facts and conflicts, then rewrites the small
derived tables (step rewards, trajectories). The trajectories commit records the bronze
version read, so it is written last: a run killed earlier is simply redone, and everything
it had appended is recognised by event_id and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import polars as pl

from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    FACT_KINDS,
    SILVER_FEEDBACK,
    SILVER_STEP_CONFLICTS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    STEP_KINDS,
    TABLES,
)
from claw_pipelines.lake import Lake
from claw_pipelines.quality import (
    Finding,
    consistent_lengths,
    feedback_targets_exist,
    finite_rewards,
    nesting,
    no_conflicts,
    unique_step_keys,
)
from claw_pipelines.settings import ClawSettings
from claw_pipelines.transforms.feedback import (
    RewardTarget,
    bronze_facts,
    resolve_rewards,
    step_reward_facts,
)
from claw_pipelines.transforms.steps import (
    FACT_COLUMNS,
    STEP_COLUMNS,
    first_arrivals,
    keep_rows,
    place_unscoped,
    split_duplicates,
    step_candidates,
    with_content_ids,
    with_step_keys,
)
from claw_pipelines.transforms.trajectories import trajectory_statuses, with_returns

SILVER_TABLES = (
    SILVER_STEPS,
    SILVER_FEEDBACK,
    SILVER_TRAJECTORIES,
    SILVER_STEP_REWARDS,
    SILVER_STEP_CONFLICTS,
)
WATERMARK_TABLE = SILVER_TRAJECTORIES
STEP_INDEX_COLUMNS = [
    "step_key",
    "trajectory_uid",
    "step_index",
    "tenant",
    "origin_step_key",
    "prompt_uid",
    "policy_version",
    "created_at",
    "is_last",
]
INDEX_COLUMNS = [
    *STEP_INDEX_COLUMNS,
    "event_id",
    "prompt_id",
    "response_id",
    "prompt_len",
    "response_len",
]
_US = 1_000_000


@dataclass(frozen=True)
class SilverOptions:
    """How steps are stitched, trajectories expire and trajectory rewards apply."""

    stitch_window_s: float = 3600.0
    idle_timeout_s: float = 3600.0
    trajectory_reward_to: RewardTarget = "last"

    @classmethod
    def from_settings(cls, settings: ClawSettings) -> SilverOptions:
        """The options named by `CLAW_STITCH_WINDOW_S`, `CLAW_IDLE_TIMEOUT_S`, ..."""
        return cls(settings.stitch_window_s, settings.idle_timeout_s, settings.trajectory_reward_to)


@dataclass
class SilverRun:
    """What one silver run read and wrote (the new rows are kept for the asset checks)."""

    bronze_version: int | None
    previous_bronze_version: int | None
    read_mode: str = "none"  # none | changes | full
    bronze_rows: int = 0
    steps_added: int = 0
    feedback_added: int = 0
    conflicts_added: int = 0
    duplicates_dropped: int = 0
    steps_total: int = 0
    trajectories: int = 0
    versions: dict[str, int | None] = field(default_factory=dict)
    new_steps: pl.DataFrame = field(default_factory=pl.DataFrame)
    index: pl.DataFrame = field(default_factory=pl.DataFrame)
    new_facts: pl.DataFrame = field(default_factory=pl.DataFrame)
    conflicts: pl.DataFrame = field(default_factory=pl.DataFrame)

    def summary(self) -> dict[str, Any]:
        """The run's counts, as plain JSON-able values."""
        return {
            "bronze_version": self.bronze_version,
            "previous_bronze_version": self.previous_bronze_version,
            "read_mode": self.read_mode,
            "bronze_rows": self.bronze_rows,
            "steps_added": self.steps_added,
            "feedback_added": self.feedback_added,
            "conflicts_added": self.conflicts_added,
            "duplicates_dropped": self.duplicates_dropped,
            "steps_total": self.steps_total,
            "trajectories": self.trajectories,
        }


def watermark(lake: Lake) -> int | None:
    """The bronze version silver has read up to (None: silver never ran)."""
    if not lake.exists(WATERMARK_TABLE):
        return None
    return lake.commit_metadata(WATERMARK_TABLE).get("bronze_version")


def _read_bronze(
    lake: Lake, after: int | None, until: int
) -> tuple[pl.DataFrame, pl.DataFrame, str]:
    """(step records, fact records, how they were read): the versions after `after`."""
    is_step = pl.col("kind").is_in(STEP_KINDS)
    is_fact = pl.col("kind").is_in(FACT_KINDS)
    if after is not None and after >= 0:
        changed = lake.changes(BRONZE_EVENTS, after, until, columns=STEP_COLUMNS)
        if changed is not None:
            rows = pl.from_arrow(changed)
            facts = rows.filter(is_fact).select(FACT_COLUMNS)
            return rows.filter(is_step), facts, "changes"
    scan = lake.scan(BRONZE_EVENTS, version=until)
    steps = scan.filter(is_step).select(STEP_COLUMNS).collect()
    facts = scan.filter(is_fact).select(FACT_COLUMNS).collect()
    return steps, facts, "full"


def _stored(lake: Lake, table: str, columns: list[str]) -> pl.DataFrame:
    spec = TABLES[table]
    if not lake.exists(table):
        return pl.from_arrow(spec.schema.empty_table()).select(columns)
    return lake.read(table, columns=columns)


def _anchors(lake: Lake, calls: pl.DataFrame, window_us: int) -> pl.DataFrame:
    """Unscoped steps in silver that the new calls may continue (within the window), as
    hashes, content ids and lengths: their tokens are never read back."""
    columns = {
        "tenant": pl.String,
        "received_us": pl.Int64,
        "seq_len": pl.Int64,
        "sequence_hash": pl.Int64,
        "prompt_id": pl.String,
        "response_id": pl.String,
        "prompt_len": pl.Int64,
        "trajectory_uid": pl.String,
        "step_index": pl.Int64,
        "prompt_uid": pl.String,
    }
    if calls.is_empty():
        return pl.DataFrame(schema=columns | {"has_successor": pl.Boolean})
    steps = lake.scan(SILVER_STEPS)
    anchors = (
        steps.filter(
            pl.col("origin_step_key").is_not_null()
            & (pl.col("created_at").dt.epoch("us") >= calls["received_us"].min() - window_us)
            & pl.col("tenant").is_in(calls["tenant"].unique().implode())
        )
        .select(
            "tenant",
            received_us=pl.col("created_at").dt.epoch("us"),
            seq_len=pl.col("prompt_len") + pl.col("response_len"),
            sequence_hash="sequence_hash",
            prompt_id="prompt_id",
            response_id="response_id",
            prompt_len="prompt_len",
            trajectory_uid="trajectory_uid",
            step_index="step_index",
            prompt_uid="prompt_uid",
        )
        .collect()
    )
    successors = (
        steps.filter(pl.col("trajectory_uid").is_in(anchors["trajectory_uid"].unique().implode()))
        .select("trajectory_uid", step_index=pl.col("step_index") - 1, has_successor=True)
        .collect()
    )
    anchors = anchors.join(successors, on=["trajectory_uid", "step_index"], how="left")
    return anchors.with_columns(pl.col("has_successor").fill_null(False))


def _new_steps(
    lake: Lake, steps: pl.DataFrame, index: pl.DataFrame, options: SilverOptions
) -> tuple[pl.DataFrame, pl.DataFrame, int]:
    """(new silver steps with their `reward`, conflicts, duplicates dropped).

    `index` is silver's key columns before this run."""
    candidates = step_candidates(steps)
    first = first_arrivals(candidates, index["event_id"])
    candidates = with_content_ids(keep_rows(candidates, first))
    window_us = int(options.stitch_window_s * _US)
    unscoped = candidates.filter(pl.col("unscoped")).select("tenant", "received_us")
    anchors = _anchors(lake, unscoped, window_us)
    candidates = with_step_keys(place_unscoped(candidates, anchors, window_us))
    keep, conflicts, duplicates = split_duplicates(candidates, index)
    known = steps.height - int(first.sum())
    return keep_rows(candidates, keep), conflicts, known + duplicates


def _rebuild_derived(
    lake: Lake, index: pl.DataFrame, options: SilverOptions
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(step rewards, trajectories) from all of silver's steps (`index`) and facts."""
    facts = _stored(lake, SILVER_FEEDBACK, TABLES[SILVER_FEEDBACK].schema.names)
    newest = [index["created_at"].max(), facts["received_at"].max()]
    present = [t for t in newest if t is not None]
    clock_us = int(max(present).timestamp() * _US) if present else 0
    statuses = trajectory_statuses(index, facts, clock_us, int(options.idle_timeout_s * _US))
    rewards = resolve_rewards(index, facts, statuses, options.trajectory_reward_to)
    return rewards, with_returns(statuses, rewards)


def ensure_silver(lake: Lake) -> None:
    """Create the silver tables if missing (readers find them empty, not absent)."""
    for table in SILVER_TABLES:
        lake.ensure(table)


def build_silver(
    lake: Lake, options: SilverOptions | None = None, bronze_version: int | None = None
) -> SilverRun:
    """Bring silver up to `bronze_version` (default: bronze's current version)."""
    options = options or SilverOptions()
    ensure_silver(lake)
    until = lake.version(BRONZE_EVENTS) if bronze_version is None else bronze_version
    after = watermark(lake)
    run = SilverRun(bronze_version=until, previous_bronze_version=after)
    if until is None or (after is not None and until <= after):
        run.versions = {t: lake.version(t) for t in SILVER_TABLES}
        return run
    steps, fact_records, run.read_mode = _read_bronze(lake, after, until)
    run.bronze_rows = steps.height + fact_records.height
    index = _stored(lake, SILVER_STEPS, INDEX_COLUMNS)
    new, conflicts, run.duplicates_dropped = _new_steps(lake, steps, index, options)
    stored_facts = _stored(lake, SILVER_FEEDBACK, ["feedback_id"])
    facts = pl.concat([bronze_facts(fact_records), step_reward_facts(new)], how="vertical_relaxed")
    facts = facts.unique("feedback_id", keep="first", maintain_order=True).join(
        stored_facts, on="feedback_id", how="anti"
    )
    meta = {"bronze_version": until, "bronze_after": after, "read_mode": run.read_mode}
    if conflicts.height:
        conflicts = conflicts.with_columns(bronze_version=pl.lit(until, pl.Int64))
        lake.append(SILVER_STEP_CONFLICTS, conflicts.to_arrow(), metadata=meta)
    if facts.height:
        lake.append(SILVER_FEEDBACK, facts.to_arrow(), metadata=meta)
    if new.height:
        lake.append(SILVER_STEPS, new.to_arrow(), metadata=meta)
    index = pl.concat([index, new.select(INDEX_COLUMNS)], how="vertical_relaxed")
    rewards, trajectories = _rebuild_derived(lake, index, options)
    lake.overwrite(SILVER_STEP_REWARDS, rewards.to_arrow(), metadata=meta)
    lake.overwrite(SILVER_TRAJECTORIES, trajectories.to_arrow(), metadata=meta)
    run.steps_added, run.feedback_added = new.height, facts.height
    run.conflicts_added = conflicts.height
    run.steps_total, run.trajectories = rewards.height, trajectories.height
    run.new_steps, run.new_facts, run.conflicts, run.index = new, facts, conflicts, index
    run.versions = {t: lake.version(t) for t in SILVER_TABLES}
    return run


def _nesting_pairs(new: pl.DataFrame, index: pl.DataFrame) -> pl.DataFrame:
    """Rows of new steps with a predecessor, beside that predecessor's content ids and
    lengths (from the small columns, never its tokens)."""
    later = (
        new.select("step_key", "prompt_id", "trajectory_uid", "step_index")
        .with_row_index("row")
        .filter(pl.col("step_index") > 0)
        .select(
            "row",
            "step_key",
            "prompt_id",
            prev_key=pl.col("trajectory_uid") + ":" + (pl.col("step_index") - 1).cast(pl.String),
        )
    )
    prev = index.select(
        prev_key="step_key",
        prev_prompt_id="prompt_id",
        prev_response_id="response_id",
        prev_prompt_len="prompt_len",
        prev_response_len="response_len",
    )
    # Choices of one n > 1 call share the prompt: siblings, not turns.
    return later.join(prev, on="prev_key").filter(pl.col("prompt_id") != pl.col("prev_prompt_id"))


def silver_findings(lake: Lake, run: SilverRun) -> dict[str, Finding]:
    """The quality findings of a run: whole-table key uniqueness, the rest on its new rows."""
    index = run.index if run.index.height else _stored(lake, SILVER_STEPS, INDEX_COLUMNS)
    new, facts = run.new_steps, run.new_facts
    if new.is_empty():
        new = pl.from_arrow(TABLES[SILVER_STEPS].schema.empty_table())
    if facts.is_empty():
        facts = pl.from_arrow(TABLES[SILVER_FEEDBACK].schema.empty_table())
    return {
        "unique_step_key": unique_step_keys(index["step_key"]),
        "list_lengths": consistent_lengths(new),
        "finite_rewards": finite_rewards(facts),
        "turns_nest": nesting(new["prompt_ids"], _nesting_pairs(new, index)),
        "feedback_targets_exist": feedback_targets_exist(index, facts),
        "no_conflicts": no_conflicts(run.conflicts),
    }
