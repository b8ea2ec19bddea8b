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

A follower's view is bounded (`SilverView.open` with a `History`): it holds in memory only
the open window, the trajectories not yet closed and those touched lately (whole: every
step, fact and derived row of theirs), at most about `hot_steps` steps of them. Every row it
takes is also written to the history on the follower's disk, one segment per run with the
versions it brings the view to; a lookup that needs a trajectory the window let go (a late
reward, a duplicate event, an old group, stitching) reads it back from there first. A
restarted follower opens its history and starts with an empty window: it reads nothing of
silver unless the history is missing or behind the lake, then it is rebuilt from the lake.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import logging
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.tables import (
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TABLES,
    SILVER_TRAJECTORIES,
    TABLES,
)
from claw_pipelines.lake.delta import Lake, conform, empty_frame
from claw_pipelines.materialize.history import History, fact_addresses
from claw_pipelines.transforms.curation import (
    CALL_COLUMNS,
    CANDIDATE_STEP_COLUMNS,
    GROUP,
    candidates,
    with_call_columns,
)
from claw_pipelines.transforms.shards import owned, stored_step_shard_keys

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
log = logging.getLogger(__name__)
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
    # bounded (a follower's): the history on disk, the window in memory and its bound
    history: History | None = None
    hot: dict[str, int] = field(default_factory=dict)  # uid -> the run that last touched it
    hot_steps: int = 0  # the window's bound in steps (0: unbounded)
    steps_total: int = 0  # steps in silver (the window holds some of them)
    runs: int = 0
    read_back: int = 0  # trajectories read back from the history (the window had let go)
    _upto: int | None = None  # a snapshot reads the history's segments before this one
    _pending: dict[str, list[pl.DataFrame]] = field(default_factory=dict)  # the run's rows
    # a shard's view (docs/DESIGN.md §19): its slot, and the versions of its writer's
    # transaction in each silver table when the view was last brought up to date
    slot: Slot | None = None
    own_writes: dict[str, int | None] = field(default_factory=dict)

    @classmethod
    def load(
        cls, lake: Lake, versions: dict[str, int | None], slot: Slot | None = None
    ) -> SilverView:
        """Read the view from the lake at `versions` (silver table -> version). A shard's
        (`slot`): the steps, step rewards and trajectories of its buckets, every fact, and
        the clocks of every shard's steps."""

        def read(table: str, columns: list[str] | None = None) -> pl.DataFrame:
            if versions.get(table) is None or not lake.exists(table):
                schema = TABLES[table].schema
                return empty_frame(schema).select(columns or schema.names)
            return lake.read(table, versions[table], columns=columns)

        every = _steps_frame(read(SILVER_STEPS, VIEW_STEP_COLUMNS))
        facts = read(SILVER_FEEDBACK, VIEW_FACT_COLUMNS)
        rewards = read(SILVER_STEP_REWARDS, VIEW_REWARD_COLUMNS)
        trajectories = read(SILVER_TRAJECTORIES, VIEW_TRAJECTORY_COLUMNS)
        steps = every
        if slot is not None:
            steps = every.filter(pl.Series(owned(slot, stored_step_shard_keys(every))))
            mine = steps["trajectory_uid"].unique().implode()
            rewards = rewards.filter(pl.col("trajectory_uid").is_in(mine))
            trajectories = trajectories.filter(pl.col("trajectory_uid").is_in(mine))
        view = cls(
            versions=dict(versions),
            steps=Keyed(["step_key"], steps, append_only=True),
            facts=Keyed(["feedback_id"], facts, append_only=True),
            rewards=Keyed(["step_key"], rewards),
            trajectories=Keyed(["trajectory_uid"], trajectories),
            partials=Keyed(["event_id"], _partials_frame(steps)),
            slot=slot,
        )
        view._advance_clock(every, facts)
        view.steps_total = steps.height
        view._start_log()
        return view

    @classmethod
    def open(
        cls,
        lake: Lake,
        versions: dict[str, int | None],
        history: History,
        hot_steps: int,
        slot: Slot | None = None,
    ) -> SilverView:
        """A bounded view at `versions` over `history` (a follower's; a shard's: its share):
        as the history left it when it stands there (nothing read from the lake), else the
        history is rebuilt from the lake first."""
        if not history.stands_for(lake.uri) or not catch_up_history(lake, versions, history, slot):
            rebuild_history(lake, versions, history, slot)
        meta = history.meta
        view = cls.empty(versions)
        view.slot = slot
        view.history, view.hot_steps = history, hot_steps
        view.clock_us, view.newest_policy = int(meta["clock_us"]), int(meta["newest_policy"])
        last_seen = meta.get("last_seen")
        view.last_seen = None if last_seen is None else datetime.fromisoformat(last_seen)
        view.steps_total = int(meta.get("steps_total", 0))
        view._start_log()
        return view

    @classmethod
    def empty(cls, versions: dict[str, int | None]) -> SilverView:
        """A view holding no rows (yet), at `versions`."""

        def nothing(table: str, columns: list[str]) -> pl.DataFrame:
            return empty_frame(TABLES[table].schema).select(columns)

        steps = _steps_frame(nothing(SILVER_STEPS, VIEW_STEP_COLUMNS))
        return cls(
            versions=dict(versions),
            steps=Keyed(["step_key"], steps, append_only=True),
            facts=Keyed(["feedback_id"], nothing(SILVER_FEEDBACK, VIEW_FACT_COLUMNS), True),
            rewards=Keyed(["step_key"], nothing(SILVER_STEP_REWARDS, VIEW_REWARD_COLUMNS)),
            trajectories=Keyed(
                ["trajectory_uid"], nothing(SILVER_TRAJECTORIES, VIEW_TRAJECTORY_COLUMNS)
            ),
            partials=Keyed(["event_id"], _partials_frame(steps)),
        )

    def _start_log(self) -> None:
        marker = self.versions.get(SILVER_TRAJECTORIES)
        if marker is not None:  # what changed after this marker, the view will know
            self.log = [(marker, pl.Series("trajectory_uid", [], pl.String))]

    @property
    def complete(self) -> bool:
        """Whether the view holds all of silver (not a bounded follower's window)."""
        return self.history is None

    def snapshot(self) -> SilverView:
        """The view as it stands now, for a reader in another thread: later `add`s and
        `derived`s of this view leave the copy alone (it shares the frames, which they
        replace rather than change, and reads the history only as it stands now)."""
        twin = copy.copy(self)
        twin.versions, twin.log, twin.hot = dict(self.versions), list(self.log), dict(self.hot)
        twin._pending = {}
        if self.history is not None:
            twin._upto = self.history.segments
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

    def saw(self, records: pl.DataFrame) -> None:
        """Advance the clocks by step records another shard takes (`received_at`,
        `policy_version`): a shard's silver clock counts every shard's steps, as one
        follower's does."""
        if records.height:
            steps = records.select(created_at="received_at", policy_version="policy_version")
            self._advance_clock(steps, self.facts.frame.head(0))

    def _advance_clock(self, steps: pl.DataFrame, facts: pl.DataFrame) -> None:
        newest = [steps["created_at"].max(), facts["received_at"].max()]
        present = [int(t.timestamp() * _US) for t in newest if t is not None]
        self.clock_us = max([self.clock_us, *present])
        seen = steps["created_at"].max()
        if seen is not None and (self.last_seen is None or seen > self.last_seen):
            self.last_seen = seen
        top = steps["policy_version"].max()
        self.newest_policy = max(self.newest_policy, 0 if top is None else int(top))

    # -- the window --------------------------------------------------------------------------
    def _ensure(self, uids: pl.Series) -> None:
        """Bring the trajectories `uids` into the window (whole) from the history, when the
        window let them go: every lookup of a trajectory goes through here first."""
        if self.history is None:
            return
        wanted = uids.drop_nulls().unique()
        missing = [uid for uid in wanted.to_list() if uid not in self.hot]
        if missing:
            self._load(missing)
        for uid in wanted.to_list():  # (only once loaded: a failed load leaves them out)
            self.hot[uid] = self.runs

    def _load(self, missing: list[str]) -> None:
        """Put the rows the history holds of the trajectories `missing` in the window."""
        assert self.history is not None
        found = self.history.rows_of(pl.Series(missing, dtype=pl.String), self._upto)
        removed = found.get("removed")
        steps = found.get("steps")
        if steps is not None and steps.height:
            self.read_back += steps["trajectory_uid"].n_unique()
            if removed is not None and removed.height:
                steps = steps.filter(~pl.col("step_key").is_in(removed["step_key"].implode()))
            steps = steps.unique("step_key", keep="last", maintain_order=True)
            steps = _new_keys(steps, self.steps, "step_key")
            self.steps.put(steps)
            self.partials.put(_partials_frame(steps))
        facts = found.get("facts")
        if facts is not None and facts.height:
            facts = facts.drop("addresses").unique("feedback_id", keep="last", maintain_order=True)
            self.facts.put(_new_keys(facts, self.facts, "feedback_id"))
        for name, key in (("rewards", "step_key"), ("trajectories", "trajectory_uid")):
            rows = found.get(name)
            if rows is not None and rows.height:
                rows = rows.unique(key, keep="last", maintain_order=True)
                keyed: Keyed = getattr(self, name)
                keyed.put(_new_keys(rows, keyed, key))

    def _file(self, table: str, rows: pl.DataFrame) -> None:
        """Keep `rows` for the history segment the run writes when it completes."""
        if self.history is not None and rows.height:
            self._pending.setdefault(table, []).append(rows)

    def _write_history(self) -> None:
        """The run's rows and the state it brings the view to, as one history segment."""
        if self.history is None or self._upto is not None:
            return
        frames = {
            table: pl.concat(parts, how="vertical_relaxed")
            for table, parts in self._pending.items()
        }
        if "facts" in frames:
            facts = frames["facts"]
            frames["facts"] = facts.with_columns(addresses=fact_addresses(facts))
        self._pending = {}
        self.history.write(frames, self._state())

    def _state(self) -> dict[str, object]:
        """What a restarted follower's view starts from (kept beside the history)."""
        return {
            "versions": self.versions,
            "clock_us": self.clock_us,
            "newest_policy": self.newest_policy,
            "last_seen": None if self.last_seen is None else self.last_seen.isoformat(),
            "steps_total": self.steps_total,
        }

    def trim(self) -> None:
        """Let closed trajectories go down to the bound, those this run touched included (a
        follower's round ends so: its increments read some back)."""
        self._evict(since=self.runs + 1)

    def _evict(self, since: int | None = None) -> None:
        """Let the least lately touched closed trajectories (those not touched by run `since`
        or later; default: this one) go when the window holds more than `hot_steps` steps
        (down to half of it): the history holds them."""
        if self.history is None or not self.hot_steps or self.steps.frame.height <= self.hot_steps:
            return
        per_uid = self.steps.frame.group_by("trajectory_uid").len()
        touched = pl.DataFrame(
            {"trajectory_uid": list(self.hot), "run": list(self.hot.values())},
            schema={"trajectory_uid": pl.String, "run": pl.Int64},
        )
        open_now = self.trajectories.current().filter(pl.col("status") == "open")
        order = (
            touched.join(per_uid, on="trajectory_uid", how="left")
            .join(open_now.select("trajectory_uid"), on="trajectory_uid", how="anti")
            .filter(pl.col("run") < (self.runs - 1 if since is None else since))
            .with_columns(pl.col("len").fill_null(0))
            .sort("run", maintain_order=True)
        )
        excess = self.steps.frame.height - self.hot_steps // 2
        going = order.filter(pl.col("len").cum_sum().shift(1, fill_value=0) < excess)
        if going.is_empty():
            return
        gone = going["trajectory_uid"]
        for uid in gone.to_list():
            del self.hot[uid]
        self.steps.drop("trajectory_uid", gone)
        self.rewards.drop("trajectory_uid", gone)
        self.trajectories.drop("trajectory_uid", gone)
        of_step = pl.col("step_key").str.replace(r":[0-9]+$", "")
        partials = self.partials.frame
        self.partials._replace(partials.filter(~of_step.is_in(gone.implode())))
        facts = self.facts.frame
        still = pl.Series(list(self.hot), dtype=pl.String)
        held = fact_addresses(facts).list.eval(pl.element().is_in(still)).list.any()
        self.facts._replace(facts.filter(held))
        self._stitched = (0, np.empty(0, np.int64), np.empty(0))

    # -- a run's rows ------------------------------------------------------------------------
    def add(self, steps: pl.DataFrame, facts: pl.DataFrame) -> None:
        """Take a run's new steps (silver rows, with `metadata`) and facts."""
        if steps.height:
            steps = _shaped(steps, SILVER_STEPS)
            frame = _steps_frame(steps)
            self._ensure(frame["trajectory_uid"])
            self.steps.put(frame)
            self.partials.put(_partials_frame(steps))
            self._file("steps", frame)
            self.steps_total += frame.height
            self._advance_clock(steps, facts.head(0))
        if facts.height:
            facts = _shaped(facts, SILVER_FEEDBACK).select(VIEW_FACT_COLUMNS)
            self._ensure(fact_addresses(facts).explode())
            self.facts.put(facts)
            self._file("facts", facts)
            self._advance_clock(self.steps.frame.head(0), facts)

    def drop_steps(self, keys: pl.Series) -> None:
        """Leave out steps a run removed from silver (partials joined into a continuation)."""
        if keys.is_empty():
            return
        gone = self.steps.rows_where("step_key", keys).select("step_key", "trajectory_uid")
        self.steps.drop("step_key", keys)
        self.steps_total -= gone.height
        self._file("removed", gone)
        self._stitched = (0, np.empty(0, np.int64), np.empty(0))

    def known_event_ids(self, event_ids: pl.Series) -> pl.Series:
        """Which of `event_ids` silver holds: as a step's, or as a partial joined into one."""
        held = self.steps.rows_where("event_id", event_ids)["event_id"]
        joined = self.partials.rows_where("event_id", event_ids)["event_id"]
        known = pl.concat([held, joined])
        if self.history is None:
            return known
        rest = event_ids.filter(~event_ids.is_in(known.implode()))
        return pl.concat([known, self.history.known(b"e", rest).cast(pl.String)])

    def known_fact_ids(self, feedback_ids: pl.Series) -> pl.Series:
        """Which of `feedback_ids` silver holds."""
        held = self.facts.rows_where("feedback_id", feedback_ids)["feedback_id"]
        if self.history is None:
            return held
        rest = feedback_ids.filter(~feedback_ids.is_in(held.implode()))
        return pl.concat([held, self.history.known(b"f", rest).cast(pl.String)])

    def steps_by_key(self, keys: pl.Series) -> pl.DataFrame:
        """The view's rows of the steps keyed `keys`."""
        self._ensure(keys.str.replace(r":[0-9]+$", ""))
        return self.steps.rows_where("step_key", keys)

    def derived(
        self,
        marker: int | None,
        versions: dict[str, int | None],
        rewards: pl.DataFrame,
        trajectories: pl.DataFrame,
    ) -> None:
        """Take a run's derived rows (of the trajectories it touched), its versions and the
        version of its marker; a bounded view files the run in its history."""
        rewards = _shaped(rewards, SILVER_STEP_REWARDS)
        trajectories = _shaped(trajectories, SILVER_TRAJECTORIES)
        self._file("rewards", rewards.select(VIEW_REWARD_COLUMNS))
        self._file("trajectories", trajectories.select(VIEW_TRAJECTORY_COLUMNS))
        touched = trajectories["trajectory_uid"].unique()  # (the window's or not)
        if self.history is not None:  # rows of trajectories outside the window: history only
            inside = pl.Series(list(self.hot), dtype=pl.String).implode()
            rewards = rewards.filter(pl.col("trajectory_uid").is_in(inside))
            trajectories = trajectories.filter(pl.col("trajectory_uid").is_in(inside))
        self.rewards.put(rewards)
        self.trajectories.put(trajectories)
        self.versions = dict(versions)
        if marker is not None:
            self.log = [*self.log, (marker, touched)][-KEPT_LOG:]
        self._write_history()
        self.runs += 1
        self._evict()

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
        if self.history is not None:
            self._ensure(self.history.stitched_since(since_us))
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
        if self.history is not None:
            opened = self.history.open_trajectories()
            self._ensure(opened.filter(pl.col("last_seen_us") < before_us)["trajectory_uid"])
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
        if self.history is not None:
            self._ensure(
                pl.concat(
                    [
                        by_step.str.replace(r":[0-9]+$", ""),
                        by_trajectory,
                        self.history.owners(b"o", by_step),
                        self.history.members(b"p", by_trajectory),
                    ]
                )
            )
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
        self._ensure(trajectories)
        return self.steps.rows_where("trajectory_uid", trajectories)

    def trajectory_rows(self, trajectories: pl.Series) -> pl.DataFrame:
        """The view's silver/trajectories rows of `trajectories`."""
        self._ensure(trajectories)
        return self.trajectories.rows_where("trajectory_uid", trajectories)

    def facts_of(self, steps: pl.DataFrame) -> pl.DataFrame:
        """Every fact that may address one of `steps` (by key, trajectory, or the keys the
        gateway gave them before stitching)."""
        if "origin_step_key" not in steps.columns:  # candidates: the view's rows of them
            steps = self.steps_of(steps["trajectory_uid"].unique())
        step_aliases = pl.concat([steps["step_key"], steps["origin_step_key"].drop_nulls()])
        trajectory_aliases = pl.concat(
            [steps["trajectory_uid"], steps["origin_trajectory"].drop_nulls()]
        )
        self._ensure(trajectory_aliases)
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

    def _steps_of_groups(self, groups: pl.Series) -> pl.DataFrame:
        if self.history is not None:
            self._ensure(self.history.members(b"g", groups))
        return self.steps.rows_where(GROUP, groups)

    def candidates_of(self, groups: pl.Series) -> pl.DataFrame:
        """`candidates` of every step of `groups` (and of any group sharing a trajectory
        with them, so whole trajectories and whole groups are curated together)."""
        steps = self._steps_of_groups(groups)
        for _ in range(3):  # a trajectory spanning groups pulls the other groups in
            wider = self._steps_of_groups(steps.select(GROUP).to_series().unique())
            wider = pl.concat([wider, self.steps_of(wider["trajectory_uid"].unique())])
            wider = wider.unique("step_key", keep="last", maintain_order=True)
            if wider.height == steps.height:
                break
            steps = wider
        return self._candidates(steps)

    def all_candidates(self) -> pl.DataFrame:
        """`candidates` of every step in silver (what `gold.candidate_steps` reads); only a
        complete view holds them all."""
        assert self.complete, "a bounded view holds the open window only: read the lake"
        return self._candidates(self.steps.current())

    def _candidates(self, steps: pl.DataFrame) -> pl.DataFrame:
        uids = steps["trajectory_uid"].unique()
        self._ensure(uids)
        rewards = self.rewards.rows_where("trajectory_uid", uids)
        trajectories = self.trajectories.rows_where("trajectory_uid", uids)
        dropped = {GROUP, "is_last", "sequence_hash", "origin_step_key", "origin_trajectory"}
        dropped |= {"partial_step_keys", "partial_event_ids"}
        keep = [c for c in steps.columns if c not in {*dropped, "response_id"}]
        frame = candidates(steps.select(keep), rewards, trajectories)
        return frame.drop([c for c in CALL_COLUMNS if c in frame.columns])


def _new_keys(rows: pl.DataFrame, keyed: Keyed, key: str) -> pl.DataFrame:
    """`rows` whose `key` the window does not hold yet (what it holds is at least as new)."""
    held = keyed.rows_where(key, rows[key])[key]
    if held.is_empty():
        return rows
    return rows.filter(~pl.col(key).is_in(held.implode()))


# per silver table: the history's name of it and the view's columns of it
_SHAPES = {
    SILVER_STEPS: ("steps", VIEW_STEP_COLUMNS),
    SILVER_FEEDBACK: ("facts", VIEW_FACT_COLUMNS),
    SILVER_STEP_REWARDS: ("rewards", VIEW_REWARD_COLUMNS),
    SILVER_TRAJECTORIES: ("trajectories", VIEW_TRAJECTORY_COLUMNS),
}


def catch_up_history(
    lake: Lake, versions: dict[str, int | None], history: History, slot: Slot | None = None
) -> bool:
    """Bring `history` to `versions` by filing what silver's commits since the versions it
    stands at wrote (their change feed: a follower killed between a silver commit and its
    history write, another writer; a shard's: the rows of its share); False when a feed does
    not reach back (rebuild it)."""
    kept = history.meta.get("versions", {})
    frames: dict[str, pl.DataFrame] = {}
    clock = SilverView.empty(versions)
    mine = pl.Series("trajectory_uid", [], pl.String)  # a shard's trajectories in the feed
    for table, (name, columns) in _SHAPES.items():
        after, until = kept.get(table), versions.get(table)
        if after == until or lake.only_maintenance(table, after, until):
            continue
        if until is None or (after is not None and until < after):
            log.info("follower history: %s at %s, silver at %s: rebuilt", table, after, until)
            return False
        if after is None:  # a table silver created since (by this run): all of it is new
            changes = lake.read(table, until, columns).with_columns(_change_type=pl.lit("insert"))
        else:
            feed = lake.change_feed(table, after, until, columns)
            if feed is None:
                log.info("follower history: %s's change feed misses %s..%s", table, after, until)
                return False
            changes = pl.from_arrow(feed)
            assert isinstance(changes, pl.DataFrame)
            changes = changes.sort("_commit_version", maintain_order=True)
        written = changes.filter(pl.col("_change_type").is_in(["insert", "update_postimage"]))
        rows = _shaped(written, table).select(columns)
        if name == "steps":
            gone = changes.filter(pl.col("_change_type") == "delete")
            gone = gone.filter(~pl.col("step_key").is_in(rows["step_key"].implode()))
            frames["removed"] = gone.select("step_key", "trajectory_uid")
            rows = _steps_frame(rows)
            clock._advance_clock(rows, clock.facts.frame.head(0))  # every shard's steps
            if slot is not None:
                rows = rows.filter(pl.Series(owned(slot, stored_step_shard_keys(rows))))
                mine = rows["trajectory_uid"].unique()
                frames["removed"] = _of_share(frames["removed"], mine, history)
        elif name == "facts":
            clock._advance_clock(clock.steps.frame.head(0), rows)
            rows = rows.with_columns(addresses=fact_addresses(rows))
        elif slot is not None:  # rewards, trajectories: of the share's trajectories only
            rows = _of_share(rows, mine, history)
        frames[name] = rows
    added = (
        frames.get("steps", pl.DataFrame()).height - frames.get("removed", pl.DataFrame()).height
    )
    last_seen = history.meta.get("last_seen")
    if clock.last_seen is not None and (
        last_seen is None or clock.last_seen.isoformat() > last_seen
    ):
        last_seen = clock.last_seen.isoformat()
    history.write(
        frames,
        {
            "versions": dict(versions),
            "clock_us": max(int(history.meta.get("clock_us", 0)), clock.clock_us),
            "newest_policy": max(int(history.meta.get("newest_policy", 0)), clock.newest_policy),
            "last_seen": last_seen,
            "steps_total": int(history.meta.get("steps_total", 0)) + added,
            "caught_up": int(history.meta.get("caught_up", 0)) + 1,
        },
    )
    return True


def _of_share(rows: pl.DataFrame, mine: pl.Series, history: History) -> pl.DataFrame:
    """`rows` of a shard's trajectories: those among `mine` (its steps in this feed) or
    filed in its `history` already."""
    uids = rows["trajectory_uid"].unique()
    held = pl.concat([mine, history.holds(uids.filter(~uids.is_in(mine.implode())))])
    return rows.filter(pl.col("trajectory_uid").is_in(held.implode()))


def release_memory() -> None:
    """Hand memory freed by a large read back to the system: Arrow's pool and glibc keep
    freed pages for reuse, which a follower's resident memory would count for good."""
    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def rebuild_history(
    lake: Lake, versions: dict[str, int | None], history: History, slot: Slot | None = None
) -> None:
    """File silver as of `versions` in `history` afresh, read a batch at a time (the view's
    columns only): a follower's history that was lost or fell behind the lake (a shard's:
    its share, every fact, the clocks of every shard's steps)."""
    # a rebuild of a history this lake's follower kept (a fresh folder is a first build)
    rebuilds = int(history.meta.get("rebuilds", 0)) + 1 if history.stands_for(lake.uri) else 0
    history.clear(lake.uri)
    clock = SilverView.empty(versions)
    steps_total = 0
    mine = pl.Series("trajectory_uid", [], pl.String)  # a shard's trajectories
    for table, (name, columns) in _SHAPES.items():
        version = versions.get(table)
        if version is None or not lake.exists(table):
            continue
        for batch in lake.batches(table, version, columns):
            rows = _shaped(batch, table).select(columns)
            if name == "steps":
                rows = _steps_frame(rows)
                clock._advance_clock(rows, clock.facts.frame.head(0))
                if slot is not None:
                    rows = rows.filter(pl.Series(owned(slot, stored_step_shard_keys(rows))))
                    mine = pl.concat([mine, rows["trajectory_uid"]]).unique()
                steps_total += rows.height
            elif name == "facts":
                clock._advance_clock(clock.steps.frame.head(0), rows)
                rows = rows.with_columns(addresses=fact_addresses(rows))
            elif slot is not None:
                rows = rows.filter(pl.col("trajectory_uid").is_in(mine.implode()))
            history.write({name: rows})
    clock.steps_total = steps_total
    history.write({}, {**clock._state(), "rebuilds": rebuilds})
    release_memory()  # what the batches took goes back to the system, not to the allocators
