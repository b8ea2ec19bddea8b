"""What a follower keeps of silver between runs, so that an increment costs what changed.

`SilverView` holds silver's small columns in memory, as of the table versions one completed
silver run left: every step's keys and curation columns (never its tokens), every fact, the
derived rows (step rewards, trajectories), the clock the idle timeout counts from, and a log
of which trajectories each run touched. A silver run whose view stands at the versions it
pins reads nothing else of silver: it looks the new rows up in memory, recomputes the derived
rows of the affected trajectories alone and writes only those. A gold increment asks the log
which trajectories changed since it last ran and curates their prompt groups alone.

The view is loaded from the lake (one read of those small columns) when it is cold, when
another writer moved silver, or after a repair; then the runs that use it keep it current.
Derived rows are kept in generations (`Keyed`): a key's newest row is its current one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import polars as pl

from claw_pipelines.contracts.tables import (
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TABLES,
    SILVER_TRAJECTORIES,
    TABLES,
)
from claw_pipelines.lake.delta import Lake, conform
from claw_pipelines.transforms.curation import (
    CALL_COLUMNS,
    CANDIDATE_STEP_COLUMNS,
    GROUP,
    candidates,
    with_call_columns,
)

# the silver/steps columns the view keeps (metadata only as the call columns drawn from it)
VIEW_STEP_COLUMNS = list(
    dict.fromkeys(
        [
            *CANDIDATE_STEP_COLUMNS,
            "model",
            "created_at",
            "event_id",
            "origin_step_key",
            "response_id",
            "is_last",
            "response_len",
            "sequence_hash",
            "partial_step_keys",
            "partial_event_ids",
        ]
    )
)
_STEP_LISTS = {  # the view's list columns and their types
    "policy_version_runs": pl.List(pl.Int64),
    "policy_run_lengths": pl.List(pl.Int64),
    "partial_step_keys": pl.List(pl.String),
    "partial_event_ids": pl.List(pl.String),
}
# the silver/trajectories columns the view keeps (curation and the idle clock read them)
VIEW_TRAJECTORY_COLUMNS = [
    "trajectory_uid",
    "status",
    "resolved_return",
    "first_seen_at",
    "last_seen_at",
]
# the silver/feedback columns the view keeps (what resolving rewards and statuses reads)
VIEW_FACT_COLUMNS = [
    "feedback_id",
    "step_key",
    "trajectory_uid",
    "kind",
    "value_number",
    "value_text",
    "source",
    "judge",
    "judge_version",
    "tenant",
    "created_at",
    "received_at",
]
# the silver/step_rewards columns the view keeps (curation reads them)
VIEW_REWARD_COLUMNS = ["step_key", "trajectory_uid", "reward", "reward_status", "rating", "labels"]
KEPT_LOG = 256  # runs the change log remembers (a dataset further behind is rebuilt)
RECHUNK_AT = 64  # appended generations before a frame is made contiguous again
MERGE_AT = 20_000  # rows appended before a HashIndex sorts them in
COMPACT_AT = 10_000  # superseded rows (and a quarter of the frame) before they are dropped
_US = 1_000_000


class HashIndex:
    """Where a column's values sit in a growing frame, found without scanning it: hashes
    sorted beside their positions (binary search) in two levels, a large one and a small
    one the rows appended since are merged into (MERGE_AT at a time; the small one merges
    into the large one when it reaches a quarter of it), and the newest rows scanned."""

    SEED = 0x636C6177

    def __init__(self) -> None:
        empty = (np.empty(0, np.uint64), np.empty(0, np.int64))
        self.levels = [empty, empty]  # (sorted hashes, positions): large, small
        self.upto = 0

    def snapshot(self) -> HashIndex:
        """A copy later merges leave as it is (the arrays are replaced, never written)."""
        twin = HashIndex()
        twin.levels, twin.upto = list(self.levels), self.upto
        return twin

    def positions(self, column: pl.Series, values: pl.Series) -> np.ndarray:
        """Sorted positions of the rows of `column` (the frame's, whole) holding one of
        `values`."""
        if column.len() - self.upto > MERGE_AT:
            self._extend(column)
        wanted = values.drop_nulls().unique()
        if wanted.is_empty():
            return np.empty(0, np.int64)
        found = wanted.hash(self.SEED).to_numpy()
        parts = [_search(hashes, rows, found) for hashes, rows in self.levels]
        tail = column.slice(self.upto).is_in(wanted.implode())
        parts.append(np.flatnonzero(tail.to_numpy()) + self.upto)
        rows = np.concatenate(parts)
        rows.sort()
        same = column.gather(rows).is_in(wanted.implode()).to_numpy()  # hash collisions out
        return rows[same]

    def _extend(self, column: pl.Series) -> None:
        """Merge the rows appended since into the small level (and that into the large one
        when it has grown): sorted runs merge in linear time."""
        added = column.slice(self.upto).hash(self.SEED)
        first = added.arg_sort().to_numpy()  # polars sorts on every core
        run = (added.to_numpy()[first], first.astype(np.int64) + self.upto)
        large, small = self.levels
        small = _merged(small, run)
        if len(small[0]) * 4 > len(large[0]):
            large, small = _merged(large, small), (small[0][:0], small[1][:0])
        self.levels, self.upto = [large, small], column.len()


def _search(hashes: np.ndarray, rows: np.ndarray, found: np.ndarray) -> np.ndarray:
    """The positions whose hash is one of `found` (`hashes` sorted, `rows` beside them)."""
    left = np.searchsorted(hashes, found, "left")
    counts = np.searchsorted(hashes, found, "right") - left
    starts = np.repeat(left - np.cumsum(counts) + counts, counts)
    return rows[starts + np.arange(counts.sum())]


def _merged(
    a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted (hashes, positions) runs as one (a stable sort merges runs linearly)."""
    if not len(a[0]):
        return b
    hashes, rows = np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]])
    order = np.argsort(hashes, kind="stable")
    return hashes[order], rows[order]


class Keyed:
    """Rows by key, appended in generations: the newest row of a key is its current one.
    Lookups by a column go through a `HashIndex` of it. The rows are held as a contiguous
    base and a small contiguous tail of the generations appended since (merged into the base
    every RECHUNK_AT generations): polars gathers rows from a frame of several chunks by
    first making its list columns contiguous, a copy of every row (11 ms at 2 M steps, per
    look-up), so a look-up gathers from each part apart."""

    def __init__(self, key: list[str], frame: pl.DataFrame, append_only: bool = False) -> None:
        self.key, self._appended, self._rows_put = key, 0, 0
        self._base, self._tail = frame.rechunk(), None  # (see the class doc)
        self.append_only = append_only  # no key is ever put twice: rows never move
        self._indexes: dict[str, HashIndex] = {}

    @property
    def frame(self) -> pl.DataFrame:
        """Every row, in the order put (a superseded row before its successor)."""
        if self._tail is None:
            return self._base
        return pl.concat([self._base, self._tail], how="vertical_relaxed", rechunk=False)

    def _replace(self, frame: pl.DataFrame) -> None:
        """Hold `frame` (contiguous) instead: positions moved, the indexes start again."""
        self._base, self._tail, self._appended = frame.rechunk(), None, 0
        self._indexes = {}

    def snapshot(self) -> Keyed:
        """A copy later `put`s leave as it is (frames are shared: none is changed in place)."""
        twin = copy.copy(self)
        twin._indexes = {column: index.snapshot() for column, index in self._indexes.items()}
        return twin

    def drop(self, column: str, values: pl.Series) -> None:
        """Remove the rows whose `column` is one of `values` (rare: positions move, so the
        frame is filtered once and its indexes are rebuilt on their next lookup)."""
        if values.is_empty():
            return
        self._replace(self.frame.filter(~pl.col(column).is_in(values.implode())))

    def current(self) -> pl.DataFrame:
        """Every key's current row (reads everything: for a full build)."""
        if not self._rows_put:
            return self.frame
        return self.frame.unique(self.key, keep="last", maintain_order=True)

    def rows_where(self, column: str, values: pl.Series) -> pl.DataFrame:
        """The current rows whose `column` is one of `values`."""
        index = self._indexes.setdefault(column, HashIndex())
        positions = index.positions(self.frame[column], values)
        at = int(np.searchsorted(positions, self._base.height))
        hit = self._base[positions[:at]]
        if self._tail is not None and at < len(positions):
            tail = self._tail[positions[at:] - self._base.height]
            hit = pl.concat([hit, tail], how="vertical_relaxed")
        return hit.unique(self.key, keep="last", maintain_order=True)

    def put(self, rows: pl.DataFrame) -> None:
        """Add rows (new keys, or newer rows of known ones)."""
        if rows.is_empty():
            return
        rows = rows.select(self._base.columns) if self._base.width else rows
        if not self._base.width:  # no columns yet: the first rows are the base
            self._base = rows.rechunk()
        elif self._tail is None:
            self._tail = rows.rechunk()
        else:
            self._tail = pl.concat([self._tail, rows], how="vertical_relaxed", rechunk=True)
        self._appended, self._rows_put = self._appended + 1, self._rows_put + rows.height
        superseded = 0 if self.append_only else self._rows_put
        if superseded > self.frame.height // 4 and superseded > COMPACT_AT:
            self._replace(self.current())  # drop superseded rows
            self._rows_put = 0
        elif self._appended >= RECHUNK_AT:
            self._base, self._tail, self._appended = self.frame.rechunk(), None, 0


def _shaped(rows: pl.DataFrame, table: str) -> pl.DataFrame:
    """Rows conformed to a silver table's schema (as a read of it gives them)."""
    frame = pl.from_arrow(conform(rows.to_arrow(), TABLES[table].schema))
    assert isinstance(frame, pl.DataFrame)
    return frame


def _partials_frame(steps: pl.DataFrame) -> pl.DataFrame:
    """(event_id, step_key) of the partials silver steps absorbed (`partial_event_ids`)."""
    joined = steps.select("step_key", event_id="partial_event_ids").filter(
        pl.col("event_id").list.len() > 0
    )
    return joined.explode("event_id").select("event_id", "step_key")


def _steps_frame(steps: pl.DataFrame) -> pl.DataFrame:
    """Silver step rows (with `metadata`) in the view's shape: call columns, group key (list
    columns typed: a version written before they were declared reads them as nulls)."""
    lists = {c: t for c, t in _STEP_LISTS.items() if c in steps.columns}
    frame = with_call_columns(steps.select(VIEW_STEP_COLUMNS).cast(lists))  # type: ignore[arg-type]
    return frame.with_columns(
        pl.coalesce("prompt_uid", "trajectory_uid").alias(GROUP),
        origin_trajectory=pl.col("origin_step_key").str.replace(r":[0-9]+$", ""),
    )


@dataclass
class SilverView:
    """Silver's small columns as of `versions` (see the module doc)."""

    versions: dict[str, int | None]
    steps: Keyed
    facts: Keyed
    rewards: Keyed
    trajectories: Keyed
    partials: Keyed  # event ids of the partials joined into a step (event_id, step_key)
    clock_us: int = 0
    newest_policy: int = 0  # the newest policy version among silver's steps
    last_seen: datetime | None = None  # the newest step: the clock of curation deadlines
    log: list[tuple[int, pl.Series]] = field(default_factory=list)  # (marker version, touched)
    # stitched steps (an origin key): their positions in `steps` and times, taken in lazily
    _stitched: tuple[int, np.ndarray, np.ndarray] = (0, np.empty(0, np.int64), np.empty(0))

    @classmethod
    def load(cls, lake: Lake, versions: dict[str, int | None]) -> SilverView:
        """Read the view from the lake at `versions` (silver table -> version)."""

        def read(table: str, columns: list[str] | None = None) -> pl.DataFrame:
            if versions.get(table) is None or not lake.exists(table):
                schema = TABLES[table].schema
                return pl.from_arrow(schema.empty_table()).select(columns or schema.names)
            return lake.read(table, versions[table], columns=columns)

        steps = _steps_frame(read(SILVER_STEPS, VIEW_STEP_COLUMNS))
        facts = read(SILVER_FEEDBACK, VIEW_FACT_COLUMNS)
        view = cls(
            versions=dict(versions),
            steps=Keyed(["step_key"], steps, append_only=True),
            facts=Keyed(["feedback_id"], facts, append_only=True),
            rewards=Keyed(["step_key"], read(SILVER_STEP_REWARDS, VIEW_REWARD_COLUMNS)),
            trajectories=Keyed(
                ["trajectory_uid"], read(SILVER_TRAJECTORIES, VIEW_TRAJECTORY_COLUMNS)
            ),
            partials=Keyed(["event_id"], _partials_frame(steps)),
        )
        view._advance_clock(steps, facts)
        marker = versions.get(SILVER_TRAJECTORIES)
        if marker is not None:  # what changed after this marker, the view will know
            view.log = [(marker, pl.Series("trajectory_uid", [], pl.String))]
        return view

    def snapshot(self) -> SilverView:
        """The view as it stands now, for a reader in another thread: later `add`s and
        `derived`s of this view leave the copy alone (it shares the frames, which they
        replace rather than change)."""
        twin = copy.copy(self)
        twin.versions, twin.log = dict(self.versions), list(self.log)
        for name in ("steps", "facts", "rewards", "trajectories", "partials"):
            setattr(twin, name, getattr(self, name).snapshot())
        return twin

    def stands_at(self, versions: dict[str, int | None], lake: Lake | None = None) -> bool:
        """Whether the view holds silver as of `versions`: the versions it was taken at, or
        (asking `lake`) later ones that only compacted its tables (then it moves to them)."""
        if not self.versions:
            return False
        moved = [t for t in SILVER_TABLES if self.versions.get(t) != versions.get(t)]
        if moved and (
            lake is None
            or not all(
                lake.only_maintenance(t, self.versions.get(t), versions.get(t)) for t in moved
            )
        ):
            return False
        self.versions = {**self.versions, **{t: versions[t] for t in moved}}
        return True

    def _advance_clock(self, steps: pl.DataFrame, facts: pl.DataFrame) -> None:
        newest = [steps["created_at"].max(), facts["received_at"].max()]
        present = [int(t.timestamp() * _US) for t in newest if t is not None]
        self.clock_us = max([self.clock_us, *present])
        seen = steps["created_at"].max()
        if seen is not None and (self.last_seen is None or seen > self.last_seen):
            self.last_seen = seen
        top = steps["policy_version"].max()
        self.newest_policy = max(self.newest_policy, 0 if top is None else int(top))

    def add(self, steps: pl.DataFrame, facts: pl.DataFrame) -> None:
        """Take a run's new steps (silver rows, with `metadata`) and facts."""
        if steps.height:
            steps = _shaped(steps, SILVER_STEPS)
            self.steps.put(_steps_frame(steps))
            self.partials.put(_partials_frame(steps))
            self._advance_clock(steps, facts.head(0))
        if facts.height:
            facts = _shaped(facts, SILVER_FEEDBACK).select(VIEW_FACT_COLUMNS)
            self.facts.put(facts)
            self._advance_clock(self.steps.frame.head(0), facts)

    def drop_steps(self, keys: pl.Series) -> None:
        """Leave out steps a run removed from silver (partials joined into a continuation)."""
        if keys.is_empty():
            return
        self.steps.drop("step_key", keys)
        self._stitched = (0, np.empty(0, np.int64), np.empty(0))

    def known_event_ids(self, event_ids: pl.Series) -> pl.Series:
        """Which of `event_ids` silver holds: as a step's, or as a partial joined into one."""
        held = self.steps.rows_where("event_id", event_ids)["event_id"]
        joined = self.partials.rows_where("event_id", event_ids)["event_id"]
        return pl.concat([held, joined])

    def derived(
        self,
        marker: int | None,
        versions: dict[str, int | None],
        rewards: pl.DataFrame,
        trajectories: pl.DataFrame,
    ) -> None:
        """Take a run's derived rows (of the trajectories it touched), its versions and the
        version of its marker."""
        self.rewards.put(_shaped(rewards, SILVER_STEP_REWARDS))
        self.trajectories.put(_shaped(trajectories, SILVER_TRAJECTORIES))
        self.versions = dict(versions)
        if marker is not None:
            touched = trajectories["trajectory_uid"].unique()
            self.log = [*self.log, (marker, touched)][-KEPT_LOG:]

    # -- what changed ------------------------------------------------------------------------
    def touched_since(self, marker: int | None, lake: Lake | None = None) -> pl.Series | None:
        """The trajectories silver runs after marker version `marker` touched: from the log,
        and for runs before it (another process's) from silver/trajectories' change feed
        when `lake` is given. None: neither reaches back that far."""
        if marker is None or not self.log:
            return None
        versions = [version for version, _ in self.log]
        if marker in versions:
            parts = [uids for _, uids in self.log[versions.index(marker) + 1 :]]
        elif lake is not None and marker < versions[0]:
            before = lake.changed_values(SILVER_TRAJECTORIES, marker, versions[0], "trajectory_uid")
            if before is None:
                return None
            parts = [before, *(uids for _, uids in self.log[1:])]
        else:
            return None
        empty = pl.Series("trajectory_uid", [], pl.String)
        return pl.concat([empty, *parts]).unique()

    def stitched_since(self, since_us: int) -> pl.DataFrame:
        """Steps of unscoped calls (those with an origin key) created at or after
        `since_us`: what new unscoped calls may continue (found without scanning silver)."""
        upto, rows, times = self._stitched
        frame = self.steps.frame
        if frame.height > upto:
            added = frame.slice(upto).select(
                pl.col("origin_step_key").is_not_null(), pl.col("created_at").dt.epoch("us")
            )
            mask = added["origin_step_key"].to_numpy()
            rows = np.concatenate([rows, np.flatnonzero(mask) + upto])
            times = np.concatenate([times, added["created_at"].to_numpy()[mask]])
            self._stitched = upto, rows, times = frame.height, rows, times
        return frame[rows[times >= since_us]]

    def idle_since(self, before_us: int) -> pl.Series:
        """Open trajectories last seen before `before_us`: the idle timeout ends them."""
        before = pl.lit(before_us).cast(pl.Datetime("us", "UTC"))
        idle = (pl.col("status") == "open") & (pl.col("last_seen_at") < before)
        maybe = self.trajectories.frame.filter(idle)["trajectory_uid"].unique()
        if maybe.is_empty():
            return maybe
        now = self.trajectories.rows_where("trajectory_uid", maybe).filter(idle)
        return now["trajectory_uid"]

    def trajectories_of_facts(self, facts: pl.DataFrame) -> pl.Series:
        """The trajectories facts address (directly, or through the keys the gateway gave
        unscoped calls before they were stitched)."""
        by_step = facts["step_key"].drop_nulls()
        by_trajectory = facts.filter(pl.col("step_key").is_null())["trajectory_uid"].drop_nulls()
        hits = [
            self.steps.rows_where(column, keys)["trajectory_uid"]
            for column, keys in (
                ("step_key", by_step),
                ("origin_step_key", by_step),
                ("trajectory_uid", by_trajectory),
                ("origin_trajectory", by_trajectory),
            )
            if keys.len()
        ]
        return pl.concat(hits).unique() if hits else pl.Series("trajectory_uid", [], pl.String)

    # -- rows of some trajectories or groups --------------------------------------------------
    def steps_of(self, trajectories: pl.Series) -> pl.DataFrame:
        """The view's rows of the steps of `trajectories`."""
        return self.steps.rows_where("trajectory_uid", trajectories)

    def facts_of(self, steps: pl.DataFrame) -> pl.DataFrame:
        """Every fact that may address one of `steps` (by key, trajectory, or the keys the
        gateway gave them before stitching)."""
        if "origin_step_key" not in steps.columns:  # candidates: the view's rows of them
            steps = self.steps_of(steps["trajectory_uid"].unique())
        step_aliases = pl.concat([steps["step_key"], steps["origin_step_key"].drop_nulls()])
        trajectory_aliases = pl.concat(
            [steps["trajectory_uid"], steps["origin_trajectory"].drop_nulls()]
        )
        hit = pl.concat(
            [
                self.facts.rows_where("step_key", step_aliases.unique()),
                self.facts.rows_where("trajectory_uid", trajectory_aliases.unique()),
            ]
        )
        return hit.unique("feedback_id", keep="last", maintain_order=True)

    def groups_of(self, trajectories: pl.Series) -> pl.Series:
        """The prompt groups the steps of `trajectories` belong to."""
        return self.steps_of(trajectories)[GROUP].unique()

    def candidates_of(self, groups: pl.Series) -> pl.DataFrame:
        """`candidates` of every step of `groups` (and of any group sharing a trajectory
        with them, so whole trajectories and whole groups are curated together)."""
        steps = self.steps.rows_where(GROUP, groups)
        for _ in range(3):  # a trajectory spanning groups pulls the other groups in
            wider = self.steps.rows_where(GROUP, steps.select(GROUP).to_series().unique())
            wider = pl.concat([wider, self.steps_of(wider["trajectory_uid"].unique())])
            wider = wider.unique("step_key", keep="last", maintain_order=True)
            if wider.height == steps.height:
                break
            steps = wider
        return self._candidates(steps)

    def all_candidates(self) -> pl.DataFrame:
        """`candidates` of every step in silver (what `gold.candidate_steps` reads)."""
        return self._candidates(self.steps.current())

    def _candidates(self, steps: pl.DataFrame) -> pl.DataFrame:
        uids = steps["trajectory_uid"].unique()
        rewards = self.rewards.rows_where("trajectory_uid", uids)
        trajectories = self.trajectories.rows_where("trajectory_uid", uids)
        dropped = {GROUP, "is_last", "sequence_hash", "origin_step_key", "origin_trajectory"}
        dropped |= {"partial_step_keys", "partial_event_ids"}
        keep = [c for c in steps.columns if c not in {*dropped, "response_id"}]
        frame = candidates(steps.select(keep), rewards, trajectories)
        return frame.drop([c for c in CALL_COLUMNS if c in frame.columns])
