"""Build silver from bronze, incrementally: read what bronze gained, transform, append.

A run pins the version of every silver table, reads the bronze versions after the one the
last completed run recorded (the change data feed; a full read when the feed cannot answer),
places and deduplicates steps, facts and conflicts against what the pinned tables hold,
appends the new rows, then rewrites the small derived tables (step rewards, trajectories).

Exactly-once, whatever else runs at the same time (sensor runs, `claw materialize`, a
continuous materializer, repairs, maintenance): every commit is guarded (`lake.Guard`): it
lands only if no other silver writer committed to that table since the run pinned it, else
the run starts again from the new state. So no row is ever added on top of a state it was
not checked against. The trajectories commit comes last and is the run's marker: it records
the bronze version read and the versions the run's other commits made, so readers (gold)
see silver as of a completed run, never half of one. A run killed before its marker is
simply redone, and what it had appended is recognised (by event_id, feedback_id) and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pyarrow.compute as pc

from claw_pipelines.contracts.shards import SHARD_ORDER, Slot
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    FACT_KINDS,
    SILVER_FEEDBACK,
    SILVER_STEP_CONFLICTS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TABLES,
    SILVER_TRAJECTORIES,
    STEP_KINDS,
    TABLES,
)
from claw_pipelines.lake import delta as lake_module
from claw_pipelines.lake.delta import (
    Guard,
    Lake,
    empty_frame,
    row_groups_where,
    sql_strings,
    until_landed,
)
from claw_pipelines.materialize.history import History
from claw_pipelines.materialize.silver_view import SilverView
from claw_pipelines.settings import ClawSettings
from claw_pipelines.transforms.contexts import (
    CARRIED_REFERENCE,
    REFERENCE_COLUMNS,
    encode_prompts,
    full_layout,
    with_prompt_ids,
)
from claw_pipelines.transforms.feedback import (
    RewardTarget,
    bronze_facts,
    resolve_rewards,
    step_reward_facts,
)
from claw_pipelines.transforms.fragments import with_fragments
from claw_pipelines.transforms.partials import find_chains, is_aborted, join_chains
from claw_pipelines.transforms.quality import (
    Finding,
    feedback_targets_exist,
    lengths_are_consistent,
    retokenized_replies,
    rewards_are_finite,
    step_keys_are_unique,
    steps_have_no_conflicts,
    token_ids_are_exact,
)
from claw_pipelines.transforms.shards import owned, record_shard_keys, stored_step_shard_keys
from claw_pipelines.transforms.steps import (
    BRONZE_COLUMNS_OF_STEPS,
    FACT_COLUMNS,
    first_arrivals,
    keep_rows,
    place_unscoped,
    renumber_clashes,
    split_duplicates,
    step_candidates,
    with_content_ids,
    with_step_keys,
)
from claw_pipelines.transforms.trajectories import trajectory_statuses, with_returns

log = logging.getLogger(__name__)
WATERMARK_TABLE = SILVER_TRAJECTORIES  # its commit is a run's marker: written last
SILVER_WRITER = "claw.silver"  # the application id every silver commit carries
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
    token_rows: int = 0  # bronze records whose tokens it read (a shard skips the others')
    steps_added: int = 0
    feedback_added: int = 0
    conflicts_added: int = 0
    duplicates_dropped: int = 0
    steps_renumbered: int = 0  # proxied calls the gateway gave a taken key (renumber_clashes)
    write_conflicts: int = 0  # attempts that lost to a concurrent writer and started again
    steps_total: int = 0
    trajectories: int = 0
    versions: dict[str, int | None] = field(default_factory=dict)
    new_steps: pl.DataFrame = field(default_factory=pl.DataFrame)
    index: pl.DataFrame = field(default_factory=pl.DataFrame)
    new_facts: pl.DataFrame = field(default_factory=pl.DataFrame)
    conflicts: pl.DataFrame = field(default_factory=pl.DataFrame)
    view: SilverView | None = None  # silver as this run left it, for the next run

    def summary(self) -> dict[str, Any]:
        """The run's counts, as plain JSON-able values."""
        return {
            "bronze_version": self.bronze_version,
            "previous_bronze_version": self.previous_bronze_version,
            "read_mode": self.read_mode,
            "bronze_rows": self.bronze_rows,
            "token_rows": self.token_rows,
            "steps_added": self.steps_added,
            "feedback_added": self.feedback_added,
            "conflicts_added": self.conflicts_added,
            "duplicates_dropped": self.duplicates_dropped,
            "steps_renumbered": self.steps_renumbered,
            "write_conflicts": self.write_conflicts,
            "steps_total": self.steps_total,
            "trajectories": self.trajectories,
        }


@dataclass(frozen=True)
class SilverState:
    """Silver as the last completed run left it: the bronze version it had read and the
    version of every silver table its commits made (a consistent snapshot to read)."""

    bronze_version: int | None
    versions: dict[str, int | None]


def silver_state(lake: Lake, at: int | None = None, slot: Slot | None = None) -> SilverState:
    """The state recorded by the newest run marker (at or before trajectories version `at`;
    with `slot`, that shard's newest marker).

    Before any run completed, the tables' current versions (and no bronze version)."""
    found = None
    if lake.exists(WATERMARK_TABLE) and slot is None:
        found = lake.last_commit_with(WATERMARK_TABLE, "bronze_version", at, without="shard")
    elif lake.exists(WATERMARK_TABLE):
        found = lake.last_commit_with(WATERMARK_TABLE, "shard", at, equal=str(slot))
    if found is None:
        return SilverState(None, {t: lake.version(t) for t in SILVER_TABLES})
    version, marker = found
    pinned = marker.get("silver_versions")
    if pinned is None:  # a marker written before runs recorded their versions
        pinned = {t: lake.version(t) for t in SILVER_TABLES}
    return SilverState(marker["bronze_version"], {**pinned, WATERMARK_TABLE: version})


def watermark(lake: Lake) -> int | None:
    """The bronze version silver has read up to (None: silver never ran)."""
    return silver_state(lake).bronze_version


@dataclass(frozen=True)
class BronzeRead:
    """What a silver run read of bronze: its step records (a shard's: of its buckets), every
    fact record, the step records of other shards (`received_at`, `policy_version`: they
    move its clocks) and how it read them (changes | full)."""

    steps: pl.DataFrame
    facts: pl.DataFrame
    others: pl.DataFrame
    mode: str
    decoded: int = 0  # records whose token columns were read (a shard: its range's only)


def _read_bronze(lake: Lake, after: int | None, until: int, slot: Slot | None) -> BronzeRead:
    """The bronze records of the versions after `after` up to `until`. A shard whose records
    lie in one range of `shard_order` reads the others' records' small columns only (their
    clocks), not their tokens: bronze's row groups of other ranges are skipped."""
    columns = list(dict.fromkeys([*BRONZE_COLUMNS_OF_STEPS, *FACT_COLUMNS]))
    ranged = _order_range(lake, slot)
    if ranged is None:
        rows, mode = _read_rows(lake, after, until, columns, None)
        return _split_records(rows, slot, mode)
    # three reads, pruned on the row groups' statistics: the row groups that may hold the
    # range's records, whole (its steps are taken from them by ownership); the facts (null
    # order) without token columns; the clocks of the other ranges' records.
    order = pc.field(SHARD_ORDER)
    inside = (order >= ranged[0]) & (order < ranged[1])
    facts, _ = _read_rows(lake, after, until, FACT_COLUMNS, order.is_null())
    if facts.filter(pl.col("kind").is_in(STEP_KINDS)).height:  # steps written before the
        rows, mode = _read_rows(lake, after, until, columns, inside | order.is_null())  # layout
        return _split_records(rows, slot, mode)
    rows, mode = _read_rows(lake, after, until, columns, inside, prune_only=True)
    others, _ = _read_rows(lake, after, until, ["kind", *CLOCK_COLUMNS], ~inside)
    others = others.filter(pl.col("kind").is_in(STEP_KINDS)).select(CLOCK_COLUMNS)
    return _split_records(rows, slot, mode, facts, others)


CLOCK_COLUMNS = ["received_at", "policy_version"]  # what another shard's records move


def _order_range(lake: Lake, slot: Slot | None) -> tuple[int, int] | None:
    """The `shard_order` range of `slot`'s records when bronze is laid out by it."""
    ranged = None if slot is None else slot.order_range()
    if ranged is None or SHARD_ORDER not in lake.column_names(BRONZE_EVENTS):
        return None  # (no shard, a count not a power of two, or an older bronze)
    return ranged


def _read_rows(
    lake: Lake,
    after: int | None,
    until: int,
    columns: list[str],
    where: pc.Expression | None,
    prune_only: bool = False,
) -> tuple[pl.DataFrame, str]:
    """Bronze's rows of the versions after `after` up to `until` (those `where` holds for;
    with `prune_only`, maybe more: see `Lake.changes`), and how they were read: their
    changes, or the whole table (the feed could not answer)."""
    rows, mode = None, "changes"
    if after is not None and after >= 0:
        rows = lake.changes(BRONZE_EVENTS, after, until, columns, where, prune_only)
    elif after is None:  # all of it: as the files its log added, when it only appended (a
        mode = "full"  # local lake's then read with no Python call a read)
        rows = lake.appended(BRONZE_EVENTS, -1, until, columns, where, prune_only)
    if rows is None:
        table = lake.open(BRONZE_EVENTS, until).to_pyarrow_dataset()
        if where is not None and prune_only:
            table = row_groups_where(table, where)
            where = None
        rows, mode = table.to_table(columns, filter=where), "full"
    frame = pl.from_arrow(rows)
    assert isinstance(frame, pl.DataFrame)
    return frame, mode


def _split_records(
    rows: pl.DataFrame,
    slot: Slot | None,
    mode: str,
    facts: pl.DataFrame | None = None,
    others: pl.DataFrame | None = None,
) -> BronzeRead:
    """Bronze `rows` split (the fact records read apart: `facts`; the other shards' clocks
    read apart: `others`). The steps are taken with one gather, in one chunk (every later
    view of their token columns as Arrow is then free) and in the order of the keys most
    will take (arrival order within a key): gold, which merges steps in step_key order, then
    takes the new steps' tokens without a copy."""
    key = pl.col("trajectory_uid") + ":" + pl.col("step_index").cast(pl.String)
    order = pl.arg_sort_by(key, maintain_order=True, nulls_last=True)
    is_step = pl.col("kind").is_in(STEP_KINDS)
    if slot is not None:
        mine = pl.Series(owned(slot, record_shard_keys(rows)))
        if others is None:
            others = rows.filter(is_step & ~mine).select(CLOCK_COLUMNS)
        is_step = is_step & pl.lit(mine)
    if others is None:
        others = rows.head(0).select(CLOCK_COLUMNS)
    steps_at = rows.select(order.filter(is_step.gather(order))).to_series()
    facts = rows if facts is None else facts
    facts = facts.select(FACT_COLUMNS).filter(pl.col("kind").is_in(FACT_KINDS))
    steps = rows.select(BRONZE_COLUMNS_OF_STEPS)[steps_at]
    return BronzeRead(steps, facts, others, mode, rows.height)


def _stored(lake: Lake, table: str, columns: list[str], version: int | None = None) -> pl.DataFrame:
    spec = TABLES[table]
    if not lake.exists(table):
        return empty_frame(spec.schema).select(columns)
    return lake.read(table, version=version, columns=columns)


def _anchors(view: SilverView, calls: pl.DataFrame, window_us: int) -> pl.DataFrame:
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
    since = calls["received_us"].min() - window_us
    anchors = (
        view.stitched_since(since)
        .filter(pl.col("tenant").is_in(calls["tenant"].unique().implode()))
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
    )
    successors = view.steps_of(anchors["trajectory_uid"].unique()).select(
        "trajectory_uid", step_index=pl.col("step_index") - 1, has_successor=pl.lit(True)
    )
    anchors = anchors.join(successors, on=["trajectory_uid", "step_index"], how="left")
    return anchors.with_columns(pl.col("has_successor").fill_null(False))


def _new_steps(
    view: SilverView, steps: pl.DataFrame, options: SilverOptions
) -> tuple[pl.DataFrame, pl.DataFrame, int, int]:
    """(new silver steps with their `reward`, conflicts, duplicates dropped, proxied steps
    renumbered), looked up in the view (silver before this run): only the stored rows
    sharing an event id or a step key with the new ones are compared."""
    candidates = step_candidates(steps)
    first = first_arrivals(candidates, view.known_event_ids(candidates["event_id"]))
    candidates = with_content_ids(keep_rows(candidates, first))
    window_us = int(options.stitch_window_s * _US)
    unscoped = candidates.filter(pl.col("unscoped")).select("tenant", "received_us")
    anchors = _anchors(view, unscoped, window_us)
    candidates = with_step_keys(place_unscoped(candidates, anchors, window_us))
    taken = view.steps_by_key(candidates["step_key"])
    candidates, renumbered = renumber_clashes(candidates, taken)
    if renumbered:
        log.warning("silver: %d proxied steps had a taken key: renumbered", renumbered)
        taken = view.steps_by_key(candidates["step_key"])
    keep, conflicts, duplicates = split_duplicates(candidates, taken.select(INDEX_COLUMNS))
    known = steps.height - int(first.sum())
    new = keep_rows(candidates, keep)
    earlier = view.steps_of(new["trajectory_uid"].unique())
    return with_fragments(new, earlier), conflicts, known + duplicates, renumbered


def _join_partials(
    lake: Lake, view: SilverView, new: pl.DataFrame, steps_version: int | None
) -> tuple[pl.DataFrame, pl.DataFrame, pl.Series]:
    """(new steps with aborted generations joined into their continuations, the stored steps
    they absorb: step_key and policy_version, the keys of the continuations that absorb
    some). The stored partials are the view's aborted steps of the new steps' trajectories;
    only the absorbed ones' log-probs and masks are read from silver."""
    none = pl.DataFrame(schema={"step_key": pl.String, "policy_version": pl.Int64})
    if new.is_empty():
        return new, none, pl.Series("step_key", [], pl.String)
    stored = view.steps_of(new["trajectory_uid"].unique()).filter(is_aborted())
    if stored.is_empty() and not new.select(is_aborted().any()).item():
        return new, none, pl.Series("step_key", [], pl.String)
    chains = find_chains(new, stored)
    absorbed = stored[chains.absorbed_stored()]
    tokens = pl.DataFrame(
        schema={
            "step_key": pl.String,
            "rollout_log_probs": pl.List(pl.Float32),
            "response_mask": pl.List(pl.Int8),
        }
    )
    if absorbed.height:
        tokens = lake.read(
            SILVER_STEPS,
            steps_version,
            columns=["step_key", "rollout_log_probs", "response_mask"],
            where=_in_partitions(absorbed)
            & pl.col("step_key").is_in(absorbed["step_key"].implode()),
        )
    joined = join_chains(new, stored, tokens, chains)
    members = chains.members
    tails = members.filter(pl.col("stored"))["tail"].unique()
    replacing = new["step_key"].gather(tails.to_numpy()) if tails.len() else tails.cast(pl.String)
    return joined, absorbed.select("step_key", "policy_version"), replacing


def _stored_layout(view: SilverView, new: pl.DataFrame) -> pl.DataFrame:
    """`new` steps as silver stores them: each prompt relative to an earlier step of its
    trajectory when it begins with that step's tokens (`transforms.contexts`; the view's
    steps of their trajectories are the stored candidates, never read back)."""
    if new.is_empty():
        return full_layout(new)
    earlier = view.steps_of(new["trajectory_uid"].unique())
    return encode_prompts(new, earlier.select(REFERENCE_COLUMNS))


def _in_partitions(steps: pl.DataFrame) -> pl.Expr:
    """Silver's partitions holding `steps` (policy_version; null is its own)."""
    versions = steps["policy_version"].drop_nulls().unique().to_list()
    where = pl.col("policy_version").is_in(versions)
    return (
        where | pl.col("policy_version").is_null()
        if steps["policy_version"].null_count()
        else where
    )


def _replace_partials(
    lake: Lake,
    guard: Guard,
    joined: pl.DataFrame,
    absorbed: pl.DataFrame,
    meta: dict[str, Any],
) -> int | None:
    """Write continuations that absorb stored steps, deleting those in the same commit (a
    predicate overwrite naming both), a bounded number of keys per commit, each based on the
    version the run's commit before it made; the version."""
    version = guard.read_versions[SILVER_STEPS]
    chunk = max(1, lake_module.MAX_PREDICATE_KEYS // 2)
    for first in range(0, joined.height, chunk):
        rows = joined.slice(first, chunk)
        gone = absorbed.filter(
            pl.col("step_key").is_in(rows["partial_step_keys"].explode().drop_nulls().implode())
        )
        keys = pl.concat([rows["step_key"], gone["step_key"]]).unique().to_list()
        where = f"step_key IN ({sql_strings(keys)})"
        based = Guard(guard.app_ids, guard.version, {**guard.read_versions, SILVER_STEPS: version})
        version = lake.overwrite(
            SILVER_STEPS, rows.to_arrow(), metadata=meta, where=where, guard=based
        )
    return version


def _derive(
    index: pl.DataFrame, facts: pl.DataFrame, clock_us: int, options: SilverOptions
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(step rewards, trajectories) of the trajectories of `index` (their steps' key
    columns), from `facts` (every fact that may address them) and the silver clock."""
    statuses = trajectory_statuses(index, facts, clock_us, int(options.idle_timeout_s * _US))
    rewards = resolve_rewards(index, facts, statuses, options.trajectory_reward_to)
    return rewards, with_returns(statuses, rewards)


def _rebuild_derived(
    lake: Lake, index: pl.DataFrame, options: SilverOptions, facts_version: int
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(step rewards, trajectories) from all of silver's steps (`index`) and facts."""
    facts = _stored(lake, SILVER_FEEDBACK, TABLES[SILVER_FEEDBACK].schema.names, facts_version)
    newest = [index["created_at"].max(), facts["received_at"].max()]
    present = [t for t in newest if t is not None]
    clock_us = int(max(present).timestamp() * _US) if present else 0
    return _derive(index, facts, clock_us, options)


def _finish(
    lake: Lake,
    guard: Guard,
    versions: dict[str, int | None],
    index: pl.DataFrame,
    options: SilverOptions,
    meta: dict[str, Any],
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Rewrite the derived tables from `index` and the facts at `versions`; the trajectories
    commit, last, is the run's marker (it records `versions`, updated in place)."""
    rewards, trajectories = _rebuild_derived(lake, index, options, versions[SILVER_FEEDBACK])
    _write_derived(lake, guard, versions, rewards, trajectories, meta, None)
    return rewards, trajectories


def _write_derived(
    lake: Lake,
    guard: Guard,
    versions: dict[str, int | None],
    rewards: pl.DataFrame,
    trajectories: pl.DataFrame,
    meta: dict[str, Any],
    stored: pl.DataFrame | None,
    steps_stay: bool = False,
) -> None:
    """Write derived rows, the trajectories commit last (the run's marker, recording
    `versions`, updated in place). `stored`: the rows of silver/trajectories these replace
    (only those and their steps' rewards are rewritten; `steps_stay`: every step of theirs is
    still in silver); None: the tables are rewritten whole. When every stored
    row has its successor among the new ones (the common case: trajectories grow), the
    rows are merged in by key; when some stored row goes (a partial step absorbed), a
    predicate overwrite names the trajectories."""
    write: dict[str, dict[str, Any]] = {SILVER_STEP_REWARDS: {}, SILVER_TRAJECTORIES: {}}
    merge: dict[str, dict[str, Any]] = {}
    if stored is not None and stored.height:  # rows written must match the predicate
        both = pl.concat([stored["trajectory_uid"], trajectories["trajectory_uid"]]).unique()
        uids = f"trajectory_uid IN ({sql_strings(both.to_list())})"
        write[SILVER_STEP_REWARDS] = {"where": uids}
        write[SILVER_TRAJECTORIES] = {"where": uids}
        since = pl.concat([stored["first_seen_at"], trajectories["first_seen_at"]])
        if since.null_count() == 0:  # lets the deletes skip the files of older trajectories
            after = f"'{since.min()}'"
            write[SILVER_TRAJECTORIES]["where"] = f"first_seen_at >= {after} AND {uids}"
            recent = f"(created_at IS NULL OR created_at >= {after})"  # null: written before
            write[SILVER_STEP_REWARDS]["where"] = f"{recent} AND {uids}"
            stay = stored["trajectory_uid"].is_in(trajectories["trajectory_uid"].implode())
            if steps_stay and stay.all():
                merge[SILVER_TRAJECTORIES] = {
                    "key": ("trajectory_uid",),
                    "within": f"stored.first_seen_at >= {after}",
                }
                merge[SILVER_STEP_REWARDS] = {
                    "key": ("step_key",),
                    "within": f"(stored.created_at IS NULL OR stored.created_at >= {after})",
                }
    marker = meta | {"silver_versions": {t: v for t, v in versions.items() if t != WATERMARK_TABLE}}
    for table, rows, metadata in (
        (SILVER_STEP_REWARDS, rewards, meta),
        (SILVER_TRAJECTORIES, trajectories, marker),
    ):
        if stored is not None and not write[table]:  # only trajectories new to silver
            versions[table] = lake.append(table, rows.to_arrow(), metadata=metadata, guard=guard)
        elif table in merge:
            versions[table] = lake.upsert(
                table, rows.to_arrow(), metadata=metadata, guard=guard, **merge[table]
            )
        else:
            versions[table] = lake.overwrite(
                table, rows.to_arrow(), metadata=metadata, guard=guard, **write[table]
            )
        if table == SILVER_STEP_REWARDS:
            marker["silver_versions"][table] = versions[table]


def ensure_silver(lake: Lake) -> None:
    """Create the silver tables if missing (readers find them empty, not absent)."""
    for table in SILVER_TABLES:
        lake.ensure(table)


def build_silver(
    lake: Lake,
    options: SilverOptions | None = None,
    bronze_version: int | None = None,
    *,
    full: bool = False,
    view: SilverView | None = None,
    slot: Slot | None = None,
    fences: Mapping[str, int] | None = None,
    start_after: int | None = None,
) -> SilverRun:
    """Bring silver up to `bronze_version` (default: bronze's current version).

    `full` reads all of bronze again instead of what it gained (everything already in silver
    is recognised and dropped) and rewrites the derived tables whole: the repair for a
    watermark that cannot be trusted. `view`: the silver view a follower kept (loaded from
    the lake when missing or behind); the run's `view` is the one to keep. A run that loses
    to a concurrent writer starts again from the new state.

    `slot`: the run of one shard (docs/DESIGN.md §19): the steps of its buckets, the facts
    they derive and the bronze facts of its buckets (by `feedback_id`), the derived rows of
    its trajectories, under its own writer and marker; `fences`: its lease's
    (`Lease.guard`); `start_after`: where a shard with no marker yet starts reading bronze
    (the earliest marker of the split before, `earliest_marker`; None: all of bronze)."""
    options = options or SilverOptions()
    ensure_silver(lake)
    kept = [view]
    share = Share(slot, dict(fences or {}), start_after)

    def attempt() -> SilverRun:
        run = _build_once(lake, options, bronze_version, full, kept[0], share)
        kept[0] = run.view
        return run

    run, run.write_conflicts = until_landed(attempt, "silver")
    return run


@dataclass(frozen=True)
class Share:
    """Whose silver a run writes: all of it (no slot), or one shard's (its fences)."""

    slot: Slot | None = None
    fences: dict[str, int] = field(default_factory=dict)
    start_after: int | None = None  # a shard with no marker yet: bronze read after this

    @property
    def writer(self) -> str:
        """The application id the run's commits carry."""
        return SILVER_WRITER if self.slot is None else self.slot.silver_app_id

    def own_writes(self, lake: Lake) -> dict[str, int | None]:
        """The version of this writer's transaction in each silver table."""
        return {t: lake.transaction_version(t, self.writer) for t in SILVER_TABLES}

    def holds(self, view: SilverView | None, pins: dict[str, int | None], lake: Lake) -> bool:
        """Whether `view` is silver (this share's) as of `pins`: for a shard, no commit of
        its own writer came since the view was brought up to date (other shards' commits
        hold nothing it keeps but facts, which it files from bronze itself)."""
        if view is None or view.slot != self.slot:
            return False
        if self.slot is None:
            return view.stands_at(pins, lake)
        if not view.own_writes or view.own_writes != self.own_writes(lake):
            return False
        view.versions = dict(pins)
        return True


def _build_once(
    lake: Lake,
    options: SilverOptions,
    bronze_version: int | None,
    full: bool,
    view: SilverView | None,
    share: Share,
) -> SilverRun:
    """One attempt: pin every silver table, compute against the pins, commit guarded."""
    pins = {t: lake.version(t) for t in SILVER_TABLES}
    slot = share.slot
    state = silver_state(lake, at=pins[WATERMARK_TABLE], slot=slot)
    until = lake.version(BRONZE_EVENTS) if bronze_version is None else bronze_version
    after = None if full else state.bronze_version
    if after is None and not full and slot is not None:
        after = share.start_after
    run = SilverRun(bronze_version=until, previous_bronze_version=state.bronze_version)
    run.view = view
    if until is None or (after is not None and until <= after):
        run.bronze_version = state.bronze_version
        run.versions = dict(state.versions)
        return run
    if not share.holds(view, pins, lake):
        view = run.view = _reloaded(lake, pins, view, share)
    guard = Guard((share.writer,), until, pins, share.fences)
    read = _read_bronze(lake, after, until, slot)
    steps, fact_records, run.read_mode = read.steps, read.facts, read.mode
    run.bronze_rows = steps.height + fact_records.height + read.others.height
    run.token_rows = read.decoded
    view.saw(read.others)
    new, conflicts, run.duplicates_dropped, run.steps_renumbered = _new_steps(view, steps, options)
    new, absorbed, replacing = _join_partials(lake, view, new, pins[SILVER_STEPS])
    if conflicts.height:  # rare: the (small) conflicts table is read only then
        stored_conflicts = _stored(
            lake, SILVER_STEP_CONFLICTS, ["event_id"], pins[SILVER_STEP_CONFLICTS]
        )
        conflicts = conflicts.join(stored_conflicts, on="event_id", how="anti")
    derived_facts = step_reward_facts(new)
    facts = pl.concat([bronze_facts(fact_records), derived_facts], how="vertical_relaxed")
    # what the run's facts touch: a shard's, every fact it read (another shard may have
    # written one already, none of them has been applied to this shard's trajectories)
    touching = facts if slot is not None else None
    stored_facts = view.known_fact_ids(facts["feedback_id"])
    facts = facts.unique("feedback_id", keep="first", maintain_order=True).filter(
        ~pl.col("feedback_id").is_in(stored_facts.implode())
    )
    written_facts = facts  # a shard files every fact, writes those of its buckets
    if slot is not None:
        ours = pl.Series(owned(slot, facts["feedback_id"])) | facts["feedback_id"].is_in(
            derived_facts["feedback_id"].implode()
        )
        written_facts = facts.filter(ours)
    meta: dict[str, Any] = {"bronze_version": until, "bronze_after": after}
    meta |= {"read_mode": run.read_mode} | ({} if slot is None else {"shard": str(slot)})
    versions = dict(pins)
    leftovers = _left_over(lake, share, state, view, pins)
    view.versions = {}  # changing: not to be trusted until the run completes
    if conflicts.height:  # appends first, in this order: a rerun recognises each of them
        conflicts = conflicts.with_columns(bronze_version=pl.lit(until, pl.Int64))
        versions[SILVER_STEP_CONFLICTS] = lake.append(
            SILVER_STEP_CONFLICTS, conflicts.to_arrow(), metadata=meta, guard=guard
        )
    if written_facts.height:  # before the steps: a rerun would not derive their facts again
        versions[SILVER_FEEDBACK] = lake.append(
            SILVER_FEEDBACK, written_facts.to_arrow(), metadata=meta, guard=guard
        )
    written = _stored_layout(view, new)  # each prompt relative to an earlier step (§18)
    plain = (
        written.filter(~pl.col("step_key").is_in(replacing.implode()))
        if replacing.len()
        else written
    )
    if plain.height:
        versions[SILVER_STEPS] = lake.append(
            SILVER_STEPS, plain.to_arrow(), metadata=meta, guard=guard
        )
    if replacing.len():  # continuations of stored partials: written with the partials' delete
        joined = written.filter(pl.col("step_key").is_in(replacing.implode()))
        based = Guard(guard.app_ids, guard.version, {**pins, SILVER_STEPS: versions[SILVER_STEPS]})
        versions[SILVER_STEPS] = _replace_partials(lake, based, joined, absorbed, meta)
    view.add(new, facts)
    view.drop_steps(absorbed["step_key"])
    touching = facts if touching is None else touching
    touched = None if full or leftovers else _touched(view, new, touching, options)
    if touched is not None and touched.len() > lake_module.MAX_PREDICATE_KEYS:
        touched = None  # most of silver: rewritten whole rather than listed in a predicate
    if touched is None and slot is not None:  # a shard's whole share: its trajectories
        touched = _share_trajectories(lake, view, slot, versions[SILVER_STEPS], new)
    if touched is None and view.complete:
        index, derived_from, stored = view.steps.current(), view.facts.current(), None
        steps_stay = False
    elif touched is None:  # a bounded view holds its window only: all of silver is read
        index = _stored(lake, SILVER_STEPS, INDEX_COLUMNS, versions[SILVER_STEPS])
        facts_all = TABLES[SILVER_FEEDBACK].schema.names
        derived_from = _stored(lake, SILVER_FEEDBACK, facts_all, versions[SILVER_FEEDBACK])
        stored, steps_stay = None, False
    else:
        index = view.steps_of(touched)
        derived_from = view.facts_of(index)
        stored = view.trajectory_rows(touched)
        # every stored reward row has its successor unless a step went (a partial absorbed)
        steps_stay = absorbed.is_empty()
    rewards, trajectories = _derive(
        index.select(INDEX_COLUMNS), derived_from, view.clock_us, options
    )
    _write_derived(lake, guard, versions, rewards, trajectories, meta, stored, steps_stay)
    view.derived(versions[WATERMARK_TABLE], versions, rewards, trajectories)
    if slot is not None:
        view.own_writes = share.own_writes(lake)
    run.steps_added, run.feedback_added = new.height, written_facts.height
    run.conflicts_added = conflicts.height
    run.steps_total, run.trajectories = view.steps_total, trajectories.height
    # with the references silver stored them with (gold keeps those that hold there)
    carried = [written[c].alias(name) for c, name in CARRIED_REFERENCE.items()]
    run.new_steps, run.new_facts, run.conflicts = new.hstack(carried), written_facts, conflicts
    if view.complete:  # (a bounded view's findings read the lake)
        run.index = view.steps.frame.select(INDEX_COLUMNS)
    run.versions = versions
    return run


def _reloaded(
    lake: Lake, pins: dict[str, int | None], view: SilverView | None, share: Share | None = None
) -> SilverView:
    """The view at `pins` after another writer moved silver: read from the lake again, or for
    a bounded view its history brought there (rebuilt from the lake). A shard's view also
    files the facts bronze holds that their shards have not written yet."""
    if share is not None and share.slot is not None:
        if view is not None and view.history is not None:
            return share_view(
                lake, pins, share.slot, share.start_after, view.history, view.hot_steps
            )
        return share_view(lake, pins, share.slot, share.start_after)
    if view is None or view.history is None:
        return SilverView.load(lake, pins)
    return SilverView.open(lake, pins, view.history, view.hot_steps)


def share_view(
    lake: Lake,
    pins: dict[str, int | None],
    slot: Slot,
    start_after: int | None = None,
    history: History | None = None,
    hot_steps: int = 0,
) -> SilverView:
    """A shard's view at `pins`: its share of silver, every fact, and the facts bronze holds
    that other shards may not have written yet (after the earliest marker of its split;
    `start_after` where there is none). Read from the lake, or bounded over its `history`
    (a follower's, brought to `pins`)."""
    if history is not None and hot_steps:
        loaded = SilverView.open(lake, pins, history, hot_steps, slot)
    else:
        loaded = SilverView.load(lake, pins, slot)
    pending = _unwritten_facts(lake, slot, start_after)  # its own: read again from its marker
    pending = pending.filter(~pl.Series(owned(slot, pending["feedback_id"])))
    known = loaded.known_fact_ids(pending["feedback_id"])
    loaded.add(pending.head(0), pending.filter(~pl.col("feedback_id").is_in(known.implode())))
    return loaded


def earliest_marker(lake: Lake, count: int) -> int | None:
    """The bronze version every follower of a split `count` ways (1: one follower,
    unsharded) had read: the smallest of their markers (None: one has none)."""
    if count == 1:
        return silver_state(lake).bronze_version
    marks = [silver_state(lake, slot=Slot(i, count)).bronze_version for i in range(count)]
    return None if None in marks else min(m for m in marks if m is not None)


def _unwritten_facts(lake: Lake, slot: Slot, start_after: int | None = None) -> pl.DataFrame:
    """The facts of bronze's records after the oldest marker of the shards of `slot`'s count
    (`start_after` when one has none; None: all of bronze): those another shard may not
    have written yet."""
    after = earliest_marker(lake, slot.count)
    if after is None:
        after = start_after
    until = lake.version(BRONZE_EVENTS)
    if until is None or (after is not None and until <= after):
        return bronze_facts(empty_frame(TABLES[BRONZE_EVENTS].schema).select(FACT_COLUMNS))
    columns = FACT_COLUMNS
    changed = None if after is None else lake.changes(BRONZE_EVENTS, after, until, columns)
    records = pl.from_arrow(
        changed
        if changed is not None
        else lake.open(BRONZE_EVENTS, until).to_pyarrow_table(columns=columns)
    )
    assert isinstance(records, pl.DataFrame)
    return bronze_facts(records.filter(pl.col("kind").is_in(FACT_KINDS)))


def _share_trajectories(
    lake: Lake, view: SilverView, slot: Slot, steps_version: int | None, new: pl.DataFrame
) -> pl.Series:
    """Every trajectory of a shard's share: the view's when it holds all of it, else (a
    bounded view: most of the share is on disk) those of the share's steps in silver."""
    parts = [new["trajectory_uid"]]
    if view.complete:
        parts += [view.trajectories.current()["trajectory_uid"], view.steps.frame["trajectory_uid"]]
    else:
        parts.append(share_trajectories(lake, slot, steps_version))
    return pl.concat([p.cast(pl.String) for p in parts]).unique()


def share_trajectories(lake: Lake, slot: Slot, steps_version: int | None) -> pl.Series:
    """The trajectories of a shard's share in silver (its steps' keys read from the lake)."""
    columns = ["trajectory_uid", "prompt_uid", "tenant", "origin_step_key"]
    steps = _stored(lake, SILVER_STEPS, columns, steps_version)
    mine = steps.filter(pl.Series(owned(slot, stored_step_shard_keys(steps))))
    return mine["trajectory_uid"].unique()


def _left_over(
    lake: Lake, share: Share, state: SilverState, view: SilverView, pins: dict[str, int | None]
) -> bool:
    """Whether a run killed after its appends left rows past its writer's last marker: then
    everything (a shard: its share) is derived again. Before any marker, rows already in
    silver are a killed first run's."""
    if share.slot is not None:  # its writer's transactions name the bronze version read
        marked = state.bronze_version
        return any(
            written is not None and (marked is None or written > marked)
            for written in share.own_writes(lake).values()
        )
    first_killed = state.bronze_version is None and bool(view.steps_total + view.facts.frame.height)
    return first_killed or not all(
        pins[t] == state.versions.get(t) or lake.only_maintenance(t, state.versions.get(t), pins[t])
        for t in (SILVER_STEPS, SILVER_FEEDBACK)
    )


def _touched(
    view: SilverView, new: pl.DataFrame, facts: pl.DataFrame, options: SilverOptions
) -> pl.Series:
    """The trajectories whose derived rows a run changes: those of its new steps, those its
    new facts address, and those the advancing clock ends (idle past the timeout). `view`
    already holds the run's new rows."""
    idle = view.idle_since(view.clock_us - int(options.idle_timeout_s * _US))
    parts = [new["trajectory_uid"], idle]
    if facts.height:
        parts.append(view.trajectories_of_facts(facts))
    return pl.concat([p.cast(pl.String) for p in parts]).unique()


def dedupe_silver(lake: Lake, options: SilverOptions | None = None) -> dict[str, int]:
    """Rewrite silver so that each step, fact and conflict is held once, losing nothing: the
    first landing (first received) of each step_key stays; a later copy with the same tokens
    is dropped, one with other tokens becomes a conflict; repeated facts and conflicts are
    dropped; the derived tables are rebuilt. Guarded like a run. Returns what was removed."""
    options = options or SilverOptions()
    ensure_silver(lake)
    removed, _ = until_landed(lambda: _dedupe_once(lake, options), "silver repair")
    return removed


def _dedupe_once(lake: Lake, options: SilverOptions) -> dict[str, int]:
    pins = {t: lake.version(t) for t in SILVER_TABLES}
    state = silver_state(lake, at=pins[WATERMARK_TABLE])
    guard = Guard((SILVER_WRITER,), state.bronze_version or 0, pins)
    steps = lake.read(SILVER_STEPS, pins[SILVER_STEPS]).with_columns(
        received_at=pl.col("created_at")
    )
    once = keep_rows(steps, first_arrivals(steps, pl.Series([], dtype=pl.String)))
    nobody = pl.DataFrame(
        schema={c: pl.String for c in ("step_key", "event_id", "prompt_id", "response_id")}
    )
    keep, moved, _ = split_duplicates(once, nobody)
    # whole prompts, decoded among the kept rows only (a key held twice is ambiguous), then
    # stored again relative to what is kept (§18)
    kept = with_prompt_ids(keep_rows(once, keep).drop("received_at"))
    stored = lake.read(SILVER_STEP_CONFLICTS, pins[SILVER_STEP_CONFLICTS])
    moved = moved.with_columns(bronze_version=pl.lit(state.bronze_version, pl.Int64))
    conflicts = pl.concat([stored, moved], how="diagonal_relaxed").unique(
        "event_id", keep="first", maintain_order=True
    )
    facts = lake.read(SILVER_FEEDBACK, pins[SILVER_FEEDBACK])
    unique_facts = facts.unique("feedback_id", keep="first", maintain_order=True)
    removed = {
        "step_copies": steps.height - kept.height - moved.height,
        "steps_moved_to_conflicts": moved.height,
        "fact_copies": facts.height - unique_facts.height,
        "conflict_copies": stored.height + moved.height - conflicts.height,
    }
    summary = ", ".join(f"{n} {what}" for what, n in removed.items() if n) or "nothing to remove"
    meta = {
        "bronze_version": state.bronze_version,
        "bronze_after": state.bronze_version,
        "read_mode": "repair",
        "repair": summary,
    }
    versions: dict[str, int | None] = dict(pins)
    rewrites = (
        (
            SILVER_STEP_CONFLICTS,
            conflicts,
            removed["steps_moved_to_conflicts"] or removed["conflict_copies"],
        ),
        (SILVER_FEEDBACK, unique_facts, removed["fact_copies"]),
        (
            SILVER_STEPS,
            encode_prompts(kept, kept.clear().select(REFERENCE_COLUMNS)),
            removed["step_copies"] or removed["steps_moved_to_conflicts"],
        ),
    )
    for table, rows, changed in rewrites:
        if changed:
            versions[table] = lake.overwrite(table, rows.to_arrow(), metadata=meta, guard=guard)
    _finish(lake, guard, versions, kept.select(INDEX_COLUMNS), options, meta)
    return removed


def silver_findings(lake: Lake, run: SilverRun) -> dict[str, Finding]:
    """The quality findings of a run: whole-table key uniqueness, the rest on its new rows."""
    index = run.index if run.index.height else _stored(lake, SILVER_STEPS, INDEX_COLUMNS)
    new, facts = run.new_steps, run.new_facts
    if new.is_empty():
        new = empty_frame(TABLES[SILVER_STEPS].schema)
    if facts.is_empty():
        facts = empty_frame(TABLES[SILVER_FEEDBACK].schema)
    return {
        "step_keys_are_unique": step_keys_are_unique(index["step_key"]),
        "lengths_are_consistent": lengths_are_consistent(new),
        "rewards_are_finite": rewards_are_finite(facts),
        "turns_nest": retokenized_replies(new),
        "feedback_targets_exist": feedback_targets_exist(index, facts),
        "steps_have_no_conflicts": steps_have_no_conflicts(run.conflicts),
        "token_ids_are_exact": token_ids_are_exact(new),
    }
