"""Gold in increments: bring a dataset up to date with silver, rewriting only what changed.

The unit is a prompt group within one policy-version partition (the trees of its steps). An
increment curates silver exactly as a full build does (small columns only), fingerprints
every unit, and compares with the fingerprints of the rows gold holds. Only units that
differ are written: a group that became ready is appended once, with its trees; a kept group
whose inputs changed (a late reward or feedback, another trajectory) has exactly its rows
replaced; a group no longer kept is removed. Tokens are read and trees merged for those
units alone. One guarded commit per table covers every partition touched (a predicate
overwrite of those units' trees), then one lineage row per partition says what changed.
Since trees are numbered within themselves and merged in step_key order, the rows equal a
full build's (`landed_at` aside).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    GOLD_DATASET_SCHEMA,
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    TableSpec,
    gold_dataset_spec,
    gold_dataset_table,
    gold_rejection_spec,
    gold_rejection_table,
    gold_tree_spec,
    gold_tree_table,
)
from claw_pipelines.lake import delta as lake_module
from claw_pipelines.lake.delta import Guard, Lake, conform, sql_strings, until_landed
from claw_pipelines.materialize.gold import (
    TOKEN_COLUMNS,
    GoldPartition,
    Part,
    candidate_steps,
    curated_and_rejected,
    dataset_rows,
    lineage_row,
    merge_trees,
    partition_writer,
    pin_gold,
    published_newest,
    record_lineage,
    recover_lineage,
    rejection_rows,
    source_versions,
    spec_sources,
    tree_rows,
    with_tokens,
)
from claw_pipelines.materialize.silver import share_trajectories
from claw_pipelines.materialize.silver_view import SilverView
from claw_pipelines.transforms.contexts import PREFIX_TYPES
from claw_pipelines.transforms.curation import GROUP
from claw_pipelines.transforms.partials import oldest_version

UNIT = ["policy_version", "unit"]
# what a unit's rows are judged on: every dataset column but tokens and write bookkeeping
FINGERPRINTED = pa.schema(
    [
        f
        for f in GOLD_DATASET_SCHEMA
        if f.name not in {*TOKEN_COLUMNS[1:], *PREFIX_TYPES, "segment", "landed_at"}
    ]
)
SHOWN_UNITS = 5  # unit keys a lineage reason names


@dataclass
class GoldIncrement:
    """What one increment of a dataset found and wrote."""

    dataset: str
    source_versions: dict[str, int | str | None]
    added: list[str] = field(default_factory=list)  # "policy_version:unit" keys
    rewritten: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rejected: list[int] = field(default_factory=list)  # policy versions whose rejections changed
    partitions: dict[int, GoldPartition] = field(default_factory=dict)
    dataset_version: int | None = None
    trees_version: int | None = None
    write_conflicts: int = 0
    brings: Brought | None = None  # what the dataset stands at once this increment landed
    groups_curated: int | None = None  # prompt groups curated (None: all of silver)
    seconds: float = 0.0  # wall time of the increment

    @property
    def changed(self) -> bool:
        """Whether the increment wrote anything."""
        return bool(self.added or self.rewritten or self.removed or self.rejected)

    def summary(self) -> dict[str, object]:
        """Counts, as plain JSON-able values."""
        return {
            "dataset": self.dataset,
            "added": len(self.added),
            "rewritten": len(self.rewritten),
            "removed": len(self.removed),
            "rejections_rewritten": self.rejected,
            "partitions": sorted(self.partitions),
            "dataset_version": self.dataset_version,
            "write_conflicts": self.write_conflicts,
            "groups_curated": "all" if self.groups_curated is None else self.groups_curated,
        }


def with_units(rows: pl.DataFrame) -> pl.DataFrame:
    """Rows with their `unit`: the prompt group (its `prompt_uid`, else the trajectory) of
    their tree, the smallest one when a tree's steps name several (a tree is never split)."""
    group = pl.coalesce("prompt_uid", "trajectory_uid")
    return rows.with_columns(unit=group.min().over("policy_version", "tree_id"))


def unit_fingerprints(rows: pl.DataFrame) -> pl.DataFrame:
    """Per unit (policy_version, unit): a fingerprint of its rows, and its tree ids."""
    columns = [c for c in FINGERPRINTED.names if c in rows.columns]
    typed = pl.from_arrow(conform(rows.select(columns).to_arrow(), FINGERPRINTED))
    typed = with_units(typed)
    return typed.group_by(UNIT).agg(
        fingerprint=pl.struct(FINGERPRINTED.names).hash().sum(),
        trees=pl.col("tree_id").unique(),
    )


@dataclass(frozen=True)
class Brought:
    """What a follower last brought a dataset up to: silver's marker version, the spec and
    the specs it re-admits from, the newest policy version and the deadline clock."""

    marker: int | None
    spec_hash: str
    sources: dict[str, str]
    newest: int
    clock: datetime | None

    def to_json(self) -> dict[str, Any]:
        """As plain JSON values (kept in the follower's heartbeat)."""
        clock = None if self.clock is None else self.clock.isoformat()
        return {"marker": self.marker, "spec_hash": self.spec_hash, "sources": self.sources} | {
            "newest": self.newest,
            "clock": clock,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Brought:
        """Read back `to_json`'s values."""
        clock = data.get("clock")
        return cls(
            data["marker"],
            data["spec_hash"],
            dict(data["sources"]),
            int(data["newest"]),
            None if clock is None else datetime.fromisoformat(clock),
        )


# what StoredTrees keeps per tree
TREE_STATS = {
    "policy_version": pl.Int64,
    "tree_id": pl.String,
    "steps": pl.Int64,
    "raw_tokens": pl.Int64,
    "tree_tokens": pl.Int64,
    "segmented": pl.Boolean,
}


@dataclass
class StoredTrees:
    """A dataset's stored trees as of its dataset and trees tables' versions, per
    policy-version partition read so far: per (policy_version, tree_id) its steps, raw and
    tree tokens, and whether the trees table holds its segments (`segmented`; not: a killed
    writer tore it). A partition is read the first time an increment touches it, then kept
    current by the increments' own writes, so an increment reads only its scope's rows."""

    dataset_version: int
    trees_version: int
    parts: dict[int, pl.DataFrame] = field(default_factory=dict)

    def of(
        self, lake: Lake, spec: CurationSpec, pins: dict[str, int], partitions: list[int]
    ) -> pl.DataFrame:
        """The trees of `partitions` (those not read yet are read at `pins`)."""
        missing = sorted(set(partitions) - set(self.parts))
        if missing:
            table = gold_dataset_table(spec.name)
            columns = ["policy_version", "tree_id", "prompt_len", "response_len"]
            where = pl.col("policy_version").is_in(missing)
            rows = lake.read(table, pins[table], columns=columns, where=where)
            segments = _stored_segments(lake, spec, pins, missing)
            self.put(missing, _stored_tree_stats(segments, rows))
        return self.frame(partitions)

    def put(self, partitions: list[int], trees: pl.DataFrame) -> None:
        """Keep `trees` as the whole of `partitions`."""
        trees = trees.select(TREE_STATS.keys()).cast(TREE_STATS)
        for version in partitions:
            self.parts[int(version)] = trees.clear()
        for (version,), part in trees.partition_by("policy_version", as_dict=True).items():
            self.parts[int(version)] = part

    def frame(self, partitions: list[int]) -> pl.DataFrame:
        """The kept trees of `partitions` (each read before)."""
        kept = [self.parts[v] for v in sorted(set(partitions))]
        return pl.concat(kept) if kept else pl.DataFrame(schema=TREE_STATS)

    def stands_at(self, lake: Lake, spec: CurationSpec, pins: dict[str, int]) -> bool:
        """Whether it holds what the tables hold at `pins` (commits since that only
        compacted them are passed over)."""
        own = (
            (gold_dataset_table(spec.name), self.dataset_version),
            (gold_tree_table(spec.name), self.trees_version),
        )
        if any(not lake.only_maintenance(t, v, pins[t]) for t, v in own if pins[t] != v):
            return False
        self.dataset_version, self.trees_version = (pins[t] for t, _ in own)
        return True

    def replaced(
        self, gone: pl.DataFrame, rows: pa.Table, segments: pa.Table, versions: tuple[int, int]
    ) -> StoredTrees:
        """After a write that replaced the trees `gone` (policy_version, tree_id, of kept
        partitions) with the dataset `rows` and tree `segments` it wrote, at `versions`."""
        written = _stored_tree_stats(_frame(segments), _frame(rows))
        touched = sorted({*gone["policy_version"], *written["policy_version"]})
        kept = self.frame(touched).join(gone, on=["policy_version", "tree_id"], how="anti")
        after = StoredTrees(versions[0], versions[1], dict(self.parts))
        after.put(touched, pl.concat([kept, written], how="vertical_relaxed"))
        return after


def _frame(table: pa.Table) -> pl.DataFrame:
    """`table` as a polars frame."""
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


@dataclass
class AtHand:
    """What a follower keeps between increments: the token columns of steps silver took
    lately (`tokens`), its silver view (`silver`), what each dataset was last brought up to
    (`brought`: an increment then curates the groups that changed since, alone), and the
    candidate steps at the silver versions it last read in full."""

    tokens: pl.DataFrame | None = None
    silver: SilverView | None = None
    brought: dict[str, Brought] = field(default_factory=dict)
    _candidates: tuple[tuple, pl.DataFrame] | None = None
    # per dataset: (its rejections table's version, the fingerprints of that version)
    rejections: dict[str, tuple[int, pl.DataFrame]] = field(default_factory=dict)
    # per dataset: its stored trees' sizes, kept current by its increments' own writes
    trees: dict[str, StoredTrees] = field(default_factory=dict)
    # the silver marker version increments read at (None: silver's last completed run)
    pinned: int | None = None

    def aside(self) -> AtHand:
        """What an increment running beside this follower's rounds reads: the silver view
        as it stands now (a snapshot later rounds leave alone), pinned to its marker
        version; what datasets were brought to and their rejections are shared."""
        if self.silver is None:
            return AtHand(
                tokens=self.tokens,
                brought=self.brought,
                rejections=self.rejections,
                trees=self.trees,
            )
        return AtHand(
            tokens=self.tokens,
            silver=self.silver.snapshot(),
            brought=self.brought,
            rejections=self.rejections,
            trees=self.trees,
            pinned=self.silver.versions.get(SILVER_TRAJECTORIES),
        )

    def view_at(self, versions: dict[str, int | None]) -> SilverView | None:
        """The silver view when it stands at `versions` (what a gold build reads)."""
        view = self.silver
        tables = (SILVER_STEPS, SILVER_STEP_REWARDS, SILVER_TRAJECTORIES, SILVER_FEEDBACK)
        if view is None or any(view.versions.get(t) != versions[t] for t in tables):
            return None
        return view

    def candidates(self, lake: Lake, versions: dict[str, int | None]) -> pl.DataFrame:
        """`candidate_steps` at `versions`, read once per set of silver versions."""
        key = tuple(versions[t] for t in (SILVER_STEPS, SILVER_STEP_REWARDS, SILVER_TRAJECTORIES))
        view = self.view_at(versions)
        if view is not None and not view.complete:  # a bounded view: read, never kept
            return candidate_steps(lake, versions)
        if self._candidates is None or self._candidates[0] != key:
            frame = candidate_steps(lake, versions) if view is None else view.all_candidates()
            self._candidates = (key, frame)
        return self._candidates[1]


@dataclass(frozen=True)
class GoldShare:
    """Whose gold an increment writes: all of it (no slot), or one shard's: the groups of
    its silver view, under its writers and its lease's fences (docs/DESIGN.md §19)."""

    slot: Slot | None = None
    fences: dict[str, int] = field(default_factory=dict)

    def writer(self, policy_version: int) -> str:
        """The application id of its commits to one partition."""
        return partition_writer(policy_version, self.slot)


def update_dataset(
    lake: Lake,
    spec: CurationSpec,
    at_hand: AtHand | None = None,
    recover: bool = True,
    slot: Slot | None = None,
    fences: Mapping[str, int] | None = None,
) -> GoldIncrement:
    """Bring every partition of `spec`'s dataset up to date with silver's last completed run,
    rewriting only the units that changed. Guarded: an increment overtaken by another
    writer of a partition it touches starts again from the new state. `at_hand` (a
    follower's) saves reading silver again; `recover` first writes lineage
    a killed writer left out (a follower does it once, on its first increment). `slot`:
    one shard's increment (its silver view at hand: the groups it holds), `fences` its
    lease's."""
    if recover:
        recover_lineage(lake, spec.name, slot)
    at_hand = at_hand or AtHand()
    share = GoldShare(slot, dict(fences or {}))
    increment, lost = until_landed(
        lambda: _increment_once(lake, spec, at_hand, share=share), f"gold {spec.name}"
    )
    increment.write_conflicts = lost
    if increment.brings is not None:
        at_hand.brought[spec.name] = increment.brings
    return increment


@dataclass(frozen=True)
class Scope:
    """The part of a dataset an increment curates: some prompt groups (`groups`, in the
    policy-version partitions `partitions`) of silver, or all of it (`groups` None)."""

    groups: pl.Series | None = None
    partitions: list[int] | None = None

    def where(self) -> pl.Expr | None:
        """Which gold rows lie in the scope (None: all)."""
        if self.groups is None or self.partitions is None:
            return None
        group = pl.coalesce("prompt_uid", "trajectory_uid")
        return pl.col("policy_version").is_in(self.partitions) & group.is_in(self.groups.implode())


def _of_trajectories(part: Part | pl.DataFrame, uids: pl.Series) -> Part | pl.DataFrame:
    """`part` (candidates) of the trajectories `uids` only."""
    frame = part.frame if isinstance(part, Part) else part
    kept = frame.filter(pl.col("trajectory_uid").is_in(uids.implode()))
    return replace(part, frame=kept) if isinstance(part, Part) else kept


def _whole_share(
    lake: Lake, spec: CurationSpec, pins: dict[str, int], part: Part | pl.DataFrame
) -> Scope:
    """A shard's "everything": the groups its silver view holds (`part`'s candidates), in
    every partition where silver or the dataset has them (never the other shards')."""
    frame = part.frame if isinstance(part, Part) else part
    groups = frame[GROUP].unique()
    table = gold_dataset_table(spec.name)
    group = pl.coalesce("prompt_uid", "trajectory_uid")
    stored = lake.read(
        table, pins[table], columns=["policy_version"], where=group.is_in(groups.implode())
    )
    versions = {*frame["policy_version"].drop_nulls().to_list()}
    versions |= {*stored["policy_version"].drop_nulls().to_list()}
    return Scope(groups, sorted(int(v) for v in versions))


def _scope(
    lake: Lake,
    spec: CurationSpec,
    versions: dict[str, int | None],
    at_hand: AtHand,
    everything: bool = False,
) -> tuple[Scope, Part | pl.DataFrame, Brought | None]:
    """What the increment curates: the groups that changed since the follower last brought
    the dataset up to date (their steps' trajectories touched by silver runs since, groups
    a newer policy version moved past the staleness bound, groups whose deadline passed),
    or everything when it cannot tell (a first increment, a spec change, a view that does
    not reach back). Returns the scope, what to curate and what it brings the dataset to."""
    view = at_hand.view_at(versions)
    if view is None:
        return Scope(), at_hand.candidates(lake, versions), None
    sources = spec_sources(lake, spec)
    newest = max(view.newest_policy, published_newest(lake, versions))
    now = Brought(versions[SILVER_TRAJECTORIES], spec.spec_hash, sources, newest, view.last_seen)
    before = at_hand.brought.get(spec.name)
    touched = None
    if before is not None and (before.spec_hash, before.sources) == (now.spec_hash, sources):
        touched = view.touched_since(before.marker, lake)
    if everything or before is None or touched is None:
        return Scope(), Part(at_hand.candidates(lake, versions), newest, view.last_seen), now
    if touched.len() > lake_module.MAX_PREDICATE_KEYS:  # most of silver: curate it all
        return Scope(), Part(at_hand.candidates(lake, versions), newest, view.last_seen), now
    groups = [view.groups_of(touched)]
    if spec.max_policy_staleness is not None and before.newest != newest:
        low, high = sorted(v - spec.max_policy_staleness for v in (before.newest, newest))
        moved = (  # by the version that finished a step or its oldest
            pl.col("policy_version").fill_null(0).is_between(low, high, closed="left")
            | oldest_version().is_between(low, high, closed="left")
        )
        groups.append(_steps_where(lake, view, versions, moved, low)[GROUP].unique())
    if spec.group_deadline_s is not None and before.clock != view.last_seen:
        late = timedelta(seconds=spec.group_deadline_s)
        start = (before.clock or view.last_seen) - late
        first_seen = pl.col("first_seen_at")
        crossed = (first_seen >= start) & (first_seen <= view.last_seen - late)
        if view.complete:
            uids = view.trajectories.frame.filter(crossed)["trajectory_uid"]
        else:  # the lake's trajectories first seen then (files pruned by their times)
            table = SILVER_TRAJECTORIES
            uids = lake.read(table, versions[table], ["trajectory_uid"], where=crossed)
            uids = uids["trajectory_uid"]
        groups.append(view.groups_of(uids.unique()))
    frame = view.candidates_of(pl.concat(groups).unique())
    facts = view.facts_of(frame) if spec.reward_judge is not None else None
    versions_in = frame["policy_version"].unique().to_list()
    scope = Scope(frame[GROUP].unique(), sorted(int(v) for v in versions_in))
    return scope, Part(frame, newest, view.last_seen, facts), now


def _steps_where(
    lake: Lake, view: SilverView, versions: dict[str, int | None], where: pl.Expr, low: int
) -> pl.DataFrame:
    """The steps matching `where` (finished at policy version `low` or later): the view's
    when it holds all of silver, else read from the lake's partitions from `low` on."""
    if view.complete:
        return view.steps.frame.filter(where)
    columns = ["trajectory_uid", "prompt_uid", "policy_version", "policy_version_runs"]
    recent = (pl.col("policy_version") >= low) | pl.col("policy_version").is_null()
    rows = lake.read(SILVER_STEPS, versions[SILVER_STEPS], columns, where=recent)
    rows = rows.cast({"policy_version_runs": pl.List(pl.Int64)}).filter(where)  # type: ignore[dict-item]
    return rows.with_columns(pl.coalesce("prompt_uid", "trajectory_uid").alias(GROUP))


def _increment_once(
    lake: Lake,
    spec: CurationSpec,
    at_hand: AtHand,
    everything: bool = False,
    share: GoldShare | None = None,
) -> GoldIncrement:
    share = share or GoldShare()
    pins = pin_gold(lake, spec)
    versions = source_versions(lake, at_hand.pinned, share.slot)
    increment = GoldIncrement(spec.name, versions)
    if versions[SILVER_STEPS] is None:
        return increment
    if share.slot is not None and versions["bronze/events"] is None:
        return increment  # the shard's silver has no run yet: nothing of its share to curate
    table = gold_dataset_table(spec.name)
    scope, frame, brings = _scope(lake, spec, versions, at_hand, everything)  # kept once it lands
    if share.slot is not None:
        view = at_hand.view_at(versions)
        if view is None or view.slot != share.slot:
            raise ValueError(f"gold {spec.name}: shard {share.slot}'s increment needs its view")
        if scope.groups is None:  # (a bounded view's candidates are all of silver's)
            if not view.complete:
                mine = share_trajectories(lake, share.slot, versions[SILVER_STEPS])
                frame = _of_trajectories(frame, mine)
            scope = _whole_share(lake, spec, pins, frame)
    increment.brings = brings
    increment.groups_curated = None if scope.groups is None else scope.groups.len()
    if scope.partitions == []:  # nothing changed
        return increment
    now, rejected = curated_and_rejected(lake, spec, versions, frame)
    now = with_units(now)
    increment.source_versions = versions | spec_sources(lake, spec)
    rejections = _rejections_to_write(lake, spec, pins, rejected, at_hand, scope)
    stored = with_units(
        lake.read(table, pins[table], columns=FINGERPRINTED.names, where=scope.where())
    )
    trees = _stored_trees(lake, spec, pins, at_hand, scope, stored)
    in_scope = scope.partitions
    if in_scope is None:  # everything: the partitions it holds
        in_scope = [int(v) for v in stored["policy_version"].unique()]
    judged = unit_fingerprints(now).join(
        _torn(unit_fingerprints(stored), trees.of(lake, spec, pins, in_scope).filter("segmented")),
        on=UNIT,
        how="full",
        coalesce=True,
        suffix="_stored",
    )
    changed = judged.filter(
        pl.col("fingerprint").ne_missing(pl.col("fingerprint_stored"))
        | pl.col("torn").fill_null(False)
    ).with_columns(key=pl.col("policy_version").cast(pl.String) + ":" + pl.col("unit"))
    increment.brings = brings
    if changed.is_empty() and rejections is None:
        return increment
    increment.added = changed.filter(pl.col("fingerprint_stored").is_null())["key"].to_list()
    increment.removed = changed.filter(pl.col("fingerprint").is_null())["key"].to_list()
    both = pl.col("fingerprint").is_not_null() & pl.col("fingerprint_stored").is_not_null()
    increment.rewritten = changed.filter(both)["key"].to_list()

    doomed = changed.select(
        "policy_version",
        trees=pl.concat_list(pl.col("trees").fill_null([]), pl.col("trees_stored").fill_null([])),
    )
    # a predicate listing more trees than delta-rs takes (it crashes between 20,000 and
    # 30,000) replaces the touched partitions whole: every unit of theirs is written again
    whole = doomed["trees"].list.len().sum() > lake_module.MAX_PREDICATE_KEYS
    whole = whole and share.slot is None  # a shard names its own trees, however many
    if whole and scope.groups is not None:  # some groups at hand only: curate everything
        return _increment_once(lake, spec, at_hand, everything=True, share=share)
    units = changed.select(UNIT)
    if whole:
        units = now.filter(pl.col("policy_version").is_in(units["policy_version"].unique()))
        units = units.select(UNIT).unique()
    writing = with_tokens(lake, now.join(units, on=UNIT), versions[SILVER_STEPS], at_hand.tokens)
    stats = trees.of(lake, spec, pins, [int(v) for v in changed["policy_version"].unique()])
    landed_at = datetime.now(UTC)
    clauses, dataset_parts, tree_parts, lineages = [], [], [], []
    replaced: list[tuple[int, list[str]]] = []  # per partition: the trees the write replaces
    for (version,), gone in doomed.group_by("policy_version"):
        version = int(version)
        doomed_trees = gone["trees"].explode().unique().drop_nulls().to_list()
        if whole:
            doomed_trees = stats.filter(pl.col("policy_version") == version)["tree_id"].to_list()
            clauses.append(f"(policy_version = {version})")
        else:
            listed = sql_strings(doomed_trees)
            clauses.append(f"(policy_version = {version} AND tree_id IN ({listed}))")
        replaced.append((version, doomed_trees))
        part = GoldPartition(
            spec.name, version, spec, increment.source_versions, reason=_reason(increment, version)
        )
        rows = writing.filter(pl.col("policy_version") == version)
        if rows.height:
            part.steps, part.forest = merge_trees(rows)
            dataset_parts.append(dataset_rows(part.steps, landed_at))
            tree_parts.append(tree_rows(version, part.steps, part.forest))
        kept = stats.filter(
            (pl.col("policy_version") == version) & ~pl.col("tree_id").is_in(doomed_trees)
        )
        totals = {
            "steps": kept["steps"].sum() + part.steps.height,
            "trees": kept.height + (part.steps["tree_id"].n_unique() if rows.height else 0),
            "raw_tokens": kept["raw_tokens"].sum() + part.raw_tokens,
            "tree_tokens": kept["tree_tokens"].sum() + part.tree_tokens,
        }
        part.lineage = lineage_row(spec, version, versions, totals, part.reason)
        lineages.append(part.lineage)
        increment.partitions[version] = part

    touched = set(increment.partitions) | set(rejections.versions if rejections else ())
    writers = tuple(share.writer(v) for v in sorted(touched))
    guard = Guard(writers, versions[SILVER_TRAJECTORIES] or 0, pins, share.fences)
    if rejections is not None:
        increment.rejected = rejections.versions
        where_rejected = rejections.where
        meta = {"spec_hash": spec.spec_hash, "source_versions": increment.source_versions}
        written = lake.overwrite(
            gold_rejection_spec(spec.name),
            rejections.rows,
            metadata=meta,
            where=where_rejected,
            guard=guard,
        )
        if rejections.fingerprints is None:
            at_hand.rejections.pop(spec.name, None)
        else:
            at_hand.rejections[spec.name] = (written, rejections.fingerprints)
    if changed.is_empty():
        return increment
    where = " OR ".join(clauses)
    meta = {"increment": increment.summary() | {"partitions": sorted(increment.partitions)}}
    meta |= {"spec_hash": spec.spec_hash, "source_versions": increment.source_versions}
    if share.slot is not None:
        meta["shard"] = str(share.slot)
    # only new units: their trees are disjoint from every stored one, so a plain (guarded)
    # append does what the predicate overwrite would, without scanning the stored files
    only_added = not increment.rewritten and not increment.removed and not whole

    def write(table: TableSpec, rows: pa.Table, metadata: dict[str, Any]) -> int:
        if only_added:
            return lake.append(table, rows, metadata=metadata, guard=guard)
        return lake.overwrite(table, rows, metadata=metadata, where=where, guard=guard)

    dataset_spec, tree_spec = gold_dataset_spec(spec.name), gold_tree_spec(spec.name)
    stacked_rows, stacked_segments = (
        _stack(dataset_parts, dataset_spec.schema),
        _stack(tree_parts, tree_spec.schema),
    )
    increment.dataset_version = write(dataset_spec, stacked_rows, meta)
    increment.trees_version = write(
        tree_spec,
        stacked_segments,
        meta | {"dataset_version": increment.dataset_version, "lineage": lineages},
    )
    gone = pl.DataFrame(
        {
            "policy_version": [v for v, listed in replaced for _ in listed],
            "tree_id": [t for _, listed in replaced for t in listed],
        },
        schema={"policy_version": pl.Int64, "tree_id": pl.String},
    )
    at_hand.trees[spec.name] = trees.replaced(
        gone, stacked_rows, stacked_segments, (increment.dataset_version, increment.trees_version)
    )
    rows = record_lineage(lake, lineages, increment.dataset_version, increment.trees_version)
    for part, row in zip(increment.partitions.values(), rows, strict=True):
        part.lineage = row
        part.dataset_version, part.trees_version = row["dataset_version"], row["trees_version"]
    return increment


@dataclass
class RejectionsWrite:
    """The rejections an increment writes: the policy versions whose set changed, their
    rows, and every version's fingerprint after the write."""

    versions: list[int]
    rows: pa.Table
    fingerprints: pl.DataFrame | None  # None: a write of some groups only
    where: str


def rejection_fingerprints(
    rows: pa.Table | pl.DataFrame, by: tuple[str, ...] = ("policy_version",)
) -> pl.DataFrame:
    """Per policy version (or per `by` key): a fingerprint of its `gold/rejections` rows
    (`landed_at` aside)."""
    frame = rows if isinstance(rows, pl.DataFrame) else _frame(rows)
    key = list(by)
    frame = frame.drop("landed_at", strict=False)
    return frame.group_by(key).agg(fingerprint=pl.struct(pl.exclude(key)).hash().sum())


def _rejections_to_write(
    lake: Lake,
    spec: CurationSpec,
    pins: dict[str, int],
    rejected: pl.DataFrame,
    at_hand: AtHand,
    scope: Scope,
) -> RejectionsWrite | None:
    """What the dataset's rejections table must be rewritten with (None: nothing changed):
    compared per policy version with the table at its pin (its fingerprints kept between
    increments while no one else writes it), or for a scope of some groups per group."""
    table = gold_rejection_table(spec.name)
    if scope.groups is not None:
        return _group_rejections_to_write(lake, table, pins, rejected, scope)
    cached = at_hand.rejections.get(spec.name)
    if cached is not None and cached[0] == pins[table]:
        stored = cached[1]
    else:
        stored = rejection_fingerprints(lake.read(table, pins[table]).to_arrow())
    rows = rejection_rows(rejected, datetime.now(UTC))
    now = rejection_fingerprints(rows)
    both = now.join(stored, on="policy_version", how="full", coalesce=True, suffix="_stored")
    differ = both.filter(pl.col("fingerprint").ne_missing(pl.col("fingerprint_stored")))
    if differ.is_empty():
        at_hand.rejections[spec.name] = (pins[table], stored)
        return None
    versions = sorted(int(v) for v in differ["policy_version"])
    chosen = pl.from_arrow(rows["policy_version"]).is_in(versions).to_arrow()
    where = f"policy_version IN ({', '.join(map(str, versions))})"
    return RejectionsWrite(versions, rows.filter(chosen), now, where)


def _group_rejections_to_write(
    lake: Lake, table: str, pins: dict[str, int], rejected: pl.DataFrame, scope: Scope
) -> RejectionsWrite | None:
    """`_rejections_to_write` for a scope of some groups: their rows, compared per (policy
    version, group) with the stored ones, and a predicate naming the groups that differ."""
    assert scope.groups is not None and scope.partitions is not None
    key = ["policy_version", "group_key"]
    where = pl.col("policy_version").is_in(scope.partitions) & pl.col("group_key").is_in(
        scope.groups.implode()
    )
    stored = lake.read(table, pins[table], where=where).drop("landed_at")
    rows = rejection_rows(rejected, datetime.now(UTC))
    now = pl.from_arrow(rows.drop_columns(["landed_at"]))
    assert isinstance(now, pl.DataFrame)

    by = tuple(key)
    both = rejection_fingerprints(now, by).join(
        rejection_fingerprints(stored.select(now.columns), by),
        on=key,
        how="full",
        coalesce=True,
        suffix="_s",
    )
    differ = both.filter(pl.col("fingerprint").ne_missing(pl.col("fingerprint_s")))
    if differ.is_empty():
        return None
    versions = sorted(int(v) for v in differ["policy_version"].unique())
    groups = differ["group_key"].unique()
    # the predicate names versions x groups: every row of that product is written again (a
    # group whose trajectory spans versions may differ in one version only)
    chosen = (
        pl.from_arrow(rows.select(key))
        .select(
            pl.col("policy_version").is_in(versions) & pl.col("group_key").is_in(groups.implode())
        )
        .to_series()
    )
    names = sql_strings(groups.to_list())
    where_sql = f"policy_version IN ({', '.join(map(str, versions))}) AND group_key IN ({names})"
    return RejectionsWrite(versions, rows.filter(chosen.to_arrow()), None, where_sql)


def _stack(parts: list[pa.Table], schema: pa.Schema) -> pa.Table:
    """Tables of rows conformed to one schema, stacked (empty: a delete)."""
    if not parts:
        return schema.empty_table()
    return pa.concat_tables([conform(part, schema) for part in parts])


def _stored_segments(
    lake: Lake, spec: CurationSpec, pins: dict[str, int], partitions: list[int] | None
) -> pl.DataFrame:
    """The depth range of every stored tree segment (the trees table at its pin), of the
    given policy-version partitions (None: all)."""
    trees_table = gold_tree_table(spec.name)
    where = None if partitions is None else pl.col("policy_version").is_in(partitions)
    return lake.read(
        trees_table,
        pins[trees_table],
        columns=["policy_version", "tree_id", "start_depth", "end_depth"],
        where=where,
    )


def _stored_trees(
    lake: Lake,
    spec: CurationSpec,
    pins: dict[str, int],
    at_hand: AtHand,
    scope: Scope,
    stored: pl.DataFrame,
) -> StoredTrees:
    """The dataset's stored trees at `pins`: kept from its last increment when the tables
    stand there; else, for a whole-dataset scope, from the rows at hand (it read them all)
    and every partition's segments; else none yet (partitions are read as they are asked)."""
    kept = at_hand.trees.get(spec.name)
    if kept is not None and kept.stands_at(lake, spec, pins):
        return kept
    table, trees_table = gold_dataset_table(spec.name), gold_tree_table(spec.name)
    fresh = StoredTrees(pins[table], pins[trees_table])
    if scope.groups is None:
        segments = _stored_segments(lake, spec, pins, None)
        everything = [int(v) for v in stored["policy_version"].unique()]
        fresh.put(everything, _stored_tree_stats(segments, stored))
    at_hand.trees[spec.name] = fresh
    return fresh


def _torn(stored_units: pl.DataFrame, segments: pl.DataFrame) -> pl.DataFrame:
    """Stored units, `torn` where a tree of theirs is missing from the trees table: a writer
    killed between its dataset commit and its trees commit left them so; they are written
    again (their rows replaced), so a killed follower converges."""
    present = segments.select("policy_version", "tree_id").unique()
    torn = (
        stored_units.select(*UNIT, "trees")
        .explode("trees")
        .rename({"trees": "tree_id"})
        .join(present, on=["policy_version", "tree_id"], how="anti")
        .select(UNIT)
        .unique()
        .with_columns(torn=pl.lit(True))
    )
    return stored_units.join(torn, on=UNIT, how="left")


def _stored_tree_stats(segments: pl.DataFrame, stored: pl.DataFrame) -> pl.DataFrame:
    """Per stored tree (policy_version, tree_id): steps, raw and tree tokens (`stored`: the
    dataset's rows at its pin, `segments`: the trees table's)."""
    per_tree = stored.group_by("policy_version", "tree_id").agg(
        steps=pl.len().cast(pl.Int64),
        raw_tokens=(pl.col("prompt_len") + pl.col("response_len")).sum(),
    )
    tree_tokens = segments.group_by("policy_version", "tree_id").agg(
        tree_tokens=(pl.col("end_depth") - pl.col("start_depth")).sum()
    )
    joined = per_tree.join(tree_tokens, on=["policy_version", "tree_id"], how="left")
    tokens = pl.col("tree_tokens")
    return joined.with_columns(segmented=tokens.is_not_null(), tree_tokens=tokens.fill_null(0))


def _reason(increment: GoldIncrement, version: int) -> str:
    """What the increment did to one partition, in words, naming a few units."""
    prefix = f"{version}:"
    parts = []
    for what, keys in (
        ("added", increment.added),
        ("rewrote (inputs changed: a late reward, feedback or trajectory)", increment.rewritten),
        ("removed (no longer kept)", increment.removed),
    ):
        mine = [k.removeprefix(prefix) for k in keys if k.startswith(prefix)]
        if mine:
            shown = ", ".join(mine[:SHOWN_UNITS]) + (", ..." if len(mine) > SHOWN_UNITS else "")
            parts.append(f"{what} {len(mine)} group(s): {shown}")
    return "increment: " + "; ".join(parts)
