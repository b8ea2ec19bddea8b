"""Continuous materialization: silver and every spec's gold, up to date seconds after bronze.

`LiveMaterializer.step()` is one round: a silver run when bronze has a version silver has not
read (at most CATCH_UP_VERSIONS of them holding at most CATCH_UP_RECORDS records and
CATCH_UP_BYTES bytes beyond the first, so a backlog is taken in rounds of bounded memory),
then an increment of every valid spec's dataset when silver, the specs or the published
policy version moved. Between rounds it keeps a view of silver's small columns
(`silver_view`) and what each dataset was brought up to (also in its heartbeat, so a restart
resumes there): a round costs what changed, not what the lake holds. Datasets a trainer
pulls from live (`next_batch`) go first and every round; while there are such, the others
follow at most every BACKGROUND_S, beside the rounds: in a worker thread (with its own
handles and a snapshot of the view), so a trainer's dataset is never held up by the others
(or by compaction, which then goes there too). It uses the same guarded transforms as the Dagster
assets, so it may run beside them and beside itself; a killed materializer converges on
restart. Every COMPACT_EVERY_S it compacts the tables its rounds append to (a small file per
round, table and partition touched), one per round, so a round's commits and reads stay as
cheap as after the maintenance schedule's last run, with or without one. It leaves a
heartbeat in the lake (`_live/materializer.json`), and while that is fresh the Dagster
sensors leave routine runs to it (Dagster's jobs stay for backfills, spec changes made from
the UI and full rebuilds). A dataset whose increment fails (a re-admission source that does
not exist, a cycle, a build that raises) fails alone: the round reports it in one line
naming its spec file, the others go on, and it is tried again after RETRY_FIRST_S, doubling
up to RETRY_MAX_S while it keeps failing (the heartbeat lists it under `failing`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl

from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_CONSUMPTION,
    GOLD_LINEAGE,
    GOLD_POLICY_VERSIONS,
    LIVE_DELIVERY,
    SILVER_STEP_REWARDS,
    SILVER_TABLES,
    SILVER_TRAJECTORIES,
    TABLES,
    TableSpec,
    gold_dataset_spec,
    gold_dataset_table,
    gold_rejection_spec,
    gold_rejection_table,
    gold_tree_spec,
    gold_tree_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import (
    LEASE_TTL_S,
    Lease,
    Resharded,
    ShardLeases,
    ShardPlan,
    follower_id,
)
from claw_pipelines.lake.specs import SpecError, read_specs, spec_path
from claw_pipelines.materialize.gold import SILVER_REFERENCE, TOKEN_COLUMNS
from claw_pipelines.materialize.history import History
from claw_pipelines.materialize.increments import AtHand, Brought, GoldIncrement, update_dataset
from claw_pipelines.materialize.silver import (
    SilverOptions,
    SilverRun,
    build_silver,
    earliest_marker,
    ensure_silver,
    share_view,
    silver_state,
)
from claw_pipelines.materialize.silver_view import SilverView
from claw_pipelines.settings import ClawSettings
from claw_pipelines.transforms.shards import buckets_of

log = logging.getLogger(__name__)

HEARTBEAT = "_live/materializer.json"
GOLD_SPECS_OF_DATASET = (gold_dataset_spec, gold_tree_spec, gold_rejection_spec)


def heartbeat_of(slot: Slot | None) -> str:
    """Where a follower leaves its heartbeat: a shard's beside the others'."""
    return HEARTBEAT if slot is None else f"_live/materializer.{slot.index}of{slot.count}.json"


HEARTBEAT_S = 5.0  # the heartbeat is rewritten at least this often
STALE_AFTER_S = 30.0  # a heartbeat older than this: no materializer is running
SPECS_EVERY_S = 2.0  # spec files are listed again at most this often
PULLS_EVERY_S = 10.0  # which datasets trainers pull from is read again at most this often
PULLING_S = 600.0  # a dataset pulled from live within this long has a trainer waiting
BACKGROUND_S = 15.0  # while trainers wait on some datasets, the others follow this often
RECENT_S = 300.0  # how much data time of new steps' tokens a follower keeps at hand
RECENT_STEPS = 50_000  # and at most how many steps' (the rest is read from silver)
PLAN_EVERY_S = 2.0  # the lake's shard plan is read again at most this often
CATCH_UP_VERSIONS = 64  # bronze versions (gateway flushes) one round takes at most,
CATCH_UP_RECORDS = 50_000  # and the records and bytes of files they added (beyond the
CATCH_UP_BYTES = 32 << 20  # first): a backlog is taken in rounds of bounded memory
RETRY_FIRST_S = 1.0  # a dataset whose increment failed is tried again after this long,
RETRY_MAX_S = 60.0  # doubling with each failure in a row up to this
COMPACT_EVERY_S = 60.0  # the tables rounds append to are compacted this often
# into files of this size: the rounds' small files merge; files already this big (the
# maintenance schedule's, a take-in's, an earlier minute's) are left alone, so each pass
# rewrites about the minute's data (at 8 MB a partition's growing file was rewritten
# every minute; rewriting a 2 M-step table's files stalled a round 8 s)
COMPACT_BYTES = 1 << 20
# the tables the rounds compact themselves, also while the worker runs: those a silver run
# overwrites with a predicate (small: a row per step or trajectory, no tokens)
ROUNDS_COMPACT = (SILVER_STEP_REWARDS, SILVER_TRAJECTORIES)


@dataclass
class Round:
    """What one round did: the silver run (when one ran) and the increments that wrote."""

    silver: SilverRun | None = None
    gold: list[GoldIncrement] = field(default_factory=list)
    spec_errors: dict[str, SpecError] = field(default_factory=dict)
    seconds: float = 0.0
    silver_seconds: float = 0.0  # of which the silver run
    compacted: dict[str, int] = field(default_factory=dict)  # per table: files replaced
    compact_seconds: float = 0.0  # of which the compaction
    aside: list[str] = field(default_factory=list)  # datasets still being brought up beside
    waiting: bool = False  # a shard's follower whose lease another holds: nothing done
    failed: dict[str, Failing] = field(default_factory=dict)  # datasets whose increment failed
    beside: list[str] = field(default_factory=list)  # of `gold`, those the worker brought up

    @property
    def changed(self) -> bool:
        """Whether anything was written (by the round, or beside it since the last)."""
        wrote_silver = self.silver is not None and self.silver.bronze_rows > 0
        return wrote_silver or any(g.changed for g in self.gold)


@dataclass
class Failing:
    """A dataset whose increments fail: the last error (one line naming its spec file), the
    failures in a row, and when it is tried again (monotonic)."""

    error: str
    attempts: int
    retry_at: float
    since: str  # ISO time of the first failure in the row

    def to_json(self) -> dict[str, object]:
        """As the heartbeat shows it."""
        next_try = datetime.now(UTC) + timedelta(seconds=max(0.0, self.retry_at - time.monotonic()))
        return {
            "error": self.error,
            "attempts": self.attempts,
            "since": self.since,
            "next_try": next_try.isoformat(timespec="seconds"),
        }


@dataclass
class _Aside:
    """Work running beside the rounds: some datasets' increments, then maybe a compaction."""

    future: Future
    inputs: dict[str, tuple]  # per dataset: the inputs it is being brought to


class LiveMaterializer:
    """Brings silver and gold up to date, one `step()` at a time (see the module doc)."""

    def __init__(
        self,
        lake: Lake,
        options: SilverOptions | None = None,
        datasets: Sequence[str] | None = None,
        history: Path | None = None,
        hot_steps: int = 0,
        slot: Slot | None = None,
        lease_ttl_s: float = LEASE_TTL_S,
    ) -> None:
        self.lake, self.options = lake, options or SilverOptions()
        # one shard's (docs/DESIGN.md §19): under its lease, its view whole (no history yet)
        self.slot = slot
        self.leases = ShardLeases(lake, follower_id(), lease_ttl_s)
        self.lease: Lease | None = None
        self._renewed_at = 0.0
        self._fenced: set[str] = set()  # tables the tokens below are recorded in
        self._tokens: dict[str, int] = {}  # its writer's token, and retired shards' (+1)
        self._plan: tuple[float, ShardPlan | None] = (-1e9, None)
        self._start_after: int | None = None  # a new shard: silver starts after this
        if slot is not None and history is not None:  # a history of its own share
            history = history / f"shard-{slot.index}of{slot.count}"
        # bounded (`history` and `hot_steps` given): the view holds the open window only
        self.history_path, self.hot_steps = history, hot_steps
        self._history: History | None = None
        # the datasets kept up to date (None: every spec's)
        self.datasets = None if datasets is None else frozenset(datasets)
        self._gold_inputs: dict[str, tuple] = {}  # per dataset: what it was last brought to
        self._specs: tuple[float, dict[str, CurationSpec], dict[str, SpecError]] = (-1e9, {}, {})
        self._beat_at = -1e9
        self.at_hand = AtHand()  # silver inputs kept between increments
        self._recovered: set[str] = set()
        self._pulled: set[str] = set()  # datasets trainers pull from live lately
        self._pulls: tuple[float, dict[str, str]] = (-1e9, {})  # when read, last pull per dataset
        self._brought_at: dict[str, float] = {}  # per dataset: its last increment (monotonic)
        self.rounds = 0
        self._compacted_at = time.monotonic()
        self._compacting: list[str] = []  # tables still to compact, one per round
        self.reported_errors: set[str] = set()  # spec errors already shown
        self.failing: dict[str, Failing] = {}  # datasets whose increments fail, retried later
        self.at_hand.brought = brought_before(lake, slot)  # a restart resumes where it was
        self._aside: _Aside | None = None  # work running beside the rounds
        self._worker: tuple[ThreadPoolExecutor, Lake] | None = None  # its thread, its handles

    @classmethod
    def from_settings(
        cls,
        lake: Lake,
        settings: ClawSettings,
        datasets: Sequence[str] | None = None,
        slot: Slot | None = None,
    ) -> LiveMaterializer:
        """The follower `claw materialize --follow [--shard i/N]` runs: the silver options,
        its history (`CLAW_FOLLOWER_STATE`), window (`CLAW_FOLLOWER_HOT_STEPS`) and lease
        (`CLAW_SHARD_LEASE_TTL_S`) of `settings`."""
        return cls(
            lake,
            SilverOptions.from_settings(settings),
            datasets,
            history=settings.resolved_follower_state,
            hot_steps=settings.follower_hot_steps,
            slot=slot,
            lease_ttl_s=settings.shard_lease_ttl_s,
        )

    def hold(self) -> bool:
        """A shard's follower: take its lease when free (fencing its silver tables), or renew
        it when a third of its TTL has passed; False while another follower holds it.
        LeaseLost when it was taken over (the follower must stop)."""
        now = time.monotonic()
        plan = self._current_plan(now)
        if plan is None and self.slot is not None:  # the first shard follower records the split
            plan = ShardPlan.set(self.lake, self.slot.count)
            self._plan = (now, plan)
        if plan is not None and (why := plan.slot_of(self.slot)) is not None:
            who = "this follower" if self.slot is None else f"shard {self.slot}"
            raise Resharded(f"{who}: {why}")
        if self.slot is None:  # one follower: after a split, once the shards' leases are gone
            if plan is None or plan.previous in (None, 1) or self._fenced:
                return True
            if self.leases.held_by_others(1).height:
                return False
            self._tokens = self.leases.retired(1)
            self._fence([TABLES[t] for t in SILVER_TABLES])
            return True
        if self.lease is None:
            if plan is not None and self.leases.held_by_others(self.slot.count).height:
                return False  # a resharding: the earlier split's followers still hold leases
            self.lease = self.leases.acquire(self.slot)
            if self.lease is None:
                return False
            self._renewed_at, self._fenced = now, set()
            self._tokens = {self.slot.writer_app_id: self.lease.token}
            self._tokens |= self.leases.retired(self.slot.count)
            self._fence([TABLES[t] for t in SILVER_TABLES])
            previous = None if plan is None else plan.previous
            self._start_after = None if previous is None else earliest_marker(self.lake, previous)
            if previous is not None:  # the split changed: its share is curated whole once
                self.at_hand.brought = {}
        elif now - self._renewed_at >= self.leases.ttl.total_seconds() / 3:
            self.lease = self.leases.renew(self.lease)
            self._renewed_at = now
        return True

    def _current_plan(self, now: float) -> ShardPlan | None:
        """The lake's shard plan (read again at most every PLAN_EVERY_S)."""
        if now - self._plan[0] >= PLAN_EVERY_S:
            self._plan = (now, ShardPlan.read(self.lake))
        return self._plan[1]

    def _fence(self, tables: Sequence[TableSpec]) -> None:
        """Record the lease's token (and one past each retired shard's) in `tables` not
        fenced yet under it."""
        for table in tables:
            if table.name not in self._fenced:
                for app_id, token in self._tokens.items():
                    self.lake.fence(table, app_id, token)
                self._fenced.add(table.name)

    @property
    def fences(self) -> dict[str, int]:
        """The fences a shard's commits carry (none unsharded)."""
        if self.lease is None:
            return {}
        return {self.lease.slot.writer_app_id: self.lease.token}

    def step(self) -> Round:
        """One round: silver if bronze moved, then the datasets whose inputs moved (a shard's
        follower: nothing while another holds its lease)."""
        started = time.perf_counter()
        done = Round()
        if not self.hold():
            done.waiting = True
            self.beat(done)
            return done
        bronze = self.lake.version(BRONZE_EVENTS)
        state = silver_state(self.lake, slot=self.slot)
        bounded = self.history_path is not None and self.hot_steps > 0
        view = self.at_hand.silver
        if view is None and (bounded or state.bronze_version is not None):
            if state.bronze_version is None:  # a new lake: its tables made before the view
                ensure_silver(self.lake)  # (which would go stale at their creation)
                state = silver_state(self.lake, slot=self.slot)
            self.at_hand.silver = self._open_view(state.versions)  # a (re)start
        elif (
            bounded
            and self.slot is None  # a shard's: kept while its own writer moved it alone
            and view is not None
            and not view.stands_at(state.versions, self.lake)
        ):
            self.at_hand.silver = self._open_view(state.versions)  # another writer moved silver
        start = state.bronze_version
        if start is None and self.slot is not None:  # a new shard: after the earlier split's
            start = self._start_after
        if bronze is not None and (start is None or bronze > start):
            read = -1 if start is None else start
            upto = min(bronze, read + CATCH_UP_VERSIONS)
            if upto > read + 1:  # a backlog (large commits: a bulk import, an outage)
                upto = self.lake.versions_within(
                    BRONZE_EVENTS, read, upto, CATCH_UP_RECORDS, CATCH_UP_BYTES
                )
            done.silver = build_silver(
                self.lake,
                self.options,
                upto,
                view=self.at_hand.silver,
                slot=self.slot,
                fences=self.fences,
                start_after=self._start_after,
            )
            done.silver_seconds = time.perf_counter() - started
            self.at_hand.silver = done.silver.view
            state = silver_state(self.lake, slot=self.slot)
            self._remember(done.silver)
        self._collect_aside(done)
        specs, done.spec_errors = self._current_specs()
        for gone in set(self.failing) - set(specs):  # its spec was removed or broke
            del self.failing[gone]
        published = self.lake.version(GOLD_POLICY_VERSIONS)
        aside: dict[str, tuple] = {}  # datasets for the worker: no trainer waits on them
        for name, spec in specs.items():
            inputs = (state.versions, spec.spec_hash, published)
            if self._gold_inputs.get(name) == inputs or not self._due(name):
                continue
            if name in self.failing and time.monotonic() < self.failing[name].retry_at:
                continue  # failed lately: tried again after its backoff
            if self._aside is not None and name in self._aside.inputs:
                continue  # the worker is bringing it up
            if self._pulled and name not in self._pulled:
                aside[name] = inputs
                continue
            increment = self._increment(self.lake, spec, self.at_hand)
            self._settle(name, increment, inputs, done)
        if done.changed or aside:
            self._queue_compaction(list(specs))
        if self._compacting:
            began = time.perf_counter()
            done.compacted |= self._compact(self.lake, self._next_to_compact(aside=False))
            done.compact_seconds += time.perf_counter() - began
        if self._pulled and self._aside is None:
            compact = self._next_to_compact(aside=True)
            if aside or compact:
                self._send_aside({n: (specs[n], i) for n, i in aside.items()}, compact)
        if self._aside is not None:
            done.aside = sorted(self._aside.inputs)
        if self.at_hand.silver is not None:  # what the increments read back goes again
            self.at_hand.silver.trim()
        done.seconds = time.perf_counter() - started
        self.rounds += 1
        self.beat(done)
        return done

    def _open_view(self, versions: dict[str, int | None]) -> SilverView:
        """The silver view a (re)started follower begins with: read from the lake, or when
        bounded its history opened (rebuilt from the lake when missing or behind)."""
        bounded = self.history_path is not None and self.hot_steps > 0
        if bounded and self._history is None:
            assert self.history_path is not None
            self._history = open_history(self.history_path)
        if self.slot is not None:
            history = self._history if bounded else None
            return share_view(
                self.lake, versions, self.slot, self._start_after, history, self.hot_steps
            )
        if not bounded:
            return SilverView.load(self.lake, versions)
        assert self._history is not None
        return SilverView.open(self.lake, versions, self._history, self.hot_steps)

    def _increment(
        self, lake: Lake, spec: CurationSpec, at_hand: AtHand
    ) -> GoldIncrement | Exception:
        """One increment of `spec`'s dataset, timed (the first of each dataset recovers
        lineage a killed writer left out), or the error it failed with: one dataset's
        failure (a missing re-admission source, a cycle, a build that raises) stops only
        that dataset."""
        began = time.perf_counter()
        try:
            if self._tokens:
                self._fence([table(spec.name) for table in GOLD_SPECS_OF_DATASET])
            increment = update_dataset(
                lake,
                spec,
                at_hand,
                recover=spec.name not in self._recovered,
                slot=self.slot,
                fences=self.fences,
            )
        except Exception as exc:  # this dataset's alone: reported, tried again with backoff
            return exc
        finally:
            self._brought_at[spec.name] = time.monotonic()
        self._recovered.add(spec.name)
        increment.seconds = time.perf_counter() - began
        return increment

    def _settle(
        self, name: str, increment: GoldIncrement | Exception, inputs: tuple, done: Round
    ) -> None:
        """Take an increment's outcome into the round: its writes, or its failure (tried
        again after RETRY_FIRST_S, doubling up to RETRY_MAX_S while it keeps failing)."""
        if isinstance(increment, Exception):
            before = self.failing.get(name)
            attempts = 1 if before is None else before.attempts + 1
            delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (attempts - 1))
            first_line = (str(increment).splitlines() or [""])[0]
            error = f"{spec_path(name)}: {type(increment).__name__}: {first_line}"
            since = before.since if before else datetime.now(UTC).isoformat()
            done.failed[name] = Failing(error, attempts, time.monotonic() + delay, since)
            self.failing[name] = done.failed[name]
            return
        self.failing.pop(name, None)
        done.gold.append(increment)
        self._gold_inputs[name] = inputs

    def _queue_compaction(self, datasets: list[str]) -> None:
        """Every COMPACT_EVERY_S, queue the tables rounds append to for compaction (a small
        file per round, table and partition touched; each commit and read costs what a
        table's file count is), between the maintenance schedule's runs or without one."""
        if not self._compacting and time.monotonic() - self._compacted_at >= COMPACT_EVERY_S:
            per_dataset = (gold_dataset_table, gold_tree_table, gold_rejection_table)
            tables = [BRONZE_EVENTS, *SILVER_TABLES, GOLD_LINEAGE, GOLD_CONSUMPTION]
            tables += [table(name) for name in datasets for table in per_dataset]
            if self.slot is not None:  # the shards share the tables: each compacts some
                owned = self.slot.owns(buckets_of(pl.Series(tables, dtype=pl.String)))
                tables = [t for t, mine in zip(tables, owned.tolist(), strict=True) if mine]
            self._compacting = tables
            self._compacted_at = time.monotonic()

    def _next_to_compact(self, aside: bool) -> str | None:
        """Take the next queued table the rounds compact (`aside` False) or the worker does.
        While trainers pull, the worker compacts every table but silver's derived ones
        (`ROUNDS_COMPACT`): a compaction committed between a predicate overwrite's read and
        its commit makes that write start again, and a silver run that starts again loads
        its view anew (seconds at millions of steps); appends are not disturbed, and a
        gold increment that starts again costs little."""
        mine = [
            n for n in self._compacting if aside == (bool(self._pulled) and n not in ROUNDS_COMPACT)
        ]
        for name in mine:
            self._compacting.remove(name)
            if self.lake.exists(name):
                return name
        return None

    @staticmethod
    def _compact(lake: Lake, name: str | None) -> dict[str, int]:
        """Compact table `name` (if any); the files it replaced, per table."""
        return {} if name is None else {name: lake.compact(name, COMPACT_BYTES)}

    # -- beside the rounds --------------------------------------------------------------------
    def _send_aside(
        self, datasets: dict[str, tuple[CurationSpec, tuple]], compact: str | None
    ) -> None:
        """Start the worker on `datasets` (no trainer waits on them), then on compacting
        table `compact`. It reads a snapshot of the view pinned to the silver run it stands
        at, through its own handles, and shares only what each dataset was brought to."""
        if self._worker is None:
            pool = ThreadPoolExecutor(1, thread_name_prefix="claw-aside")
            self._worker = pool, Lake(self.lake.uri, self.lake.storage_options)
        pool, lake = self._worker
        at_hand = self.at_hand.aside()

        def work() -> tuple[dict[str, GoldIncrement | Exception], dict[str, int], float]:
            increments = {
                n: self._increment(lake, spec, at_hand) for n, (spec, _) in datasets.items()
            }
            began = time.perf_counter()
            compacted = self._compact(lake, compact)
            return increments, compacted, time.perf_counter() - began

        inputs = {name: given for name, (_, given) in datasets.items()}
        self._aside = _Aside(pool.submit(work), inputs)

    def _collect_aside(self, done: Round) -> None:
        """Take what the worker finished into this round (its failure fails the round; the
        datasets it did not bring up are due again)."""
        aside = self._aside
        if aside is None or not aside.future.done():
            return
        self._aside = None
        increments, done.compacted, done.compact_seconds = aside.future.result()
        for name, increment in increments.items():
            self._settle(name, increment, aside.inputs[name], done)
        done.beside = [name for name in increments if name not in done.failed]

    def close(self) -> None:
        """Wait for the work beside the rounds to finish and stop its thread; a shard's
        follower gives its lease up (another may take the shard at once)."""
        if self._worker is not None:
            self._worker[0].shutdown(wait=True)
            self._worker = None
        if self.lease is not None:
            self.leases.release(self.lease)
            self.lease = None
        if self._history is not None:  # its lock: a restarted follower opens it again
            self._history.close()
            self._history = None

    def _remember(self, run: SilverRun) -> None:
        """Keep the token columns of the steps silver just took (for RECENT_S of data time):
        a group becomes ready soon after its last steps land, and its increment then reads
        their tokens from here instead of from silver."""
        if run.new_steps.is_empty():
            return
        fresh = run.new_steps.select(*TOKEN_COLUMNS, *SILVER_REFERENCE, "created_at")
        kept = self.at_hand.tokens
        recent = pl.concat([kept, fresh], how="vertical_relaxed") if kept is not None else fresh
        horizon = recent["created_at"].max() - timedelta(seconds=RECENT_S)
        if recent["created_at"].min() < horizon:  # (a filter copies every token column)
            recent = recent.filter(pl.col("created_at") >= horizon)
        # at most RECENT_STEPS of them: a backlog lands much in little data time
        self.at_hand.tokens = recent.tail(RECENT_STEPS)

    def _due(self, name: str) -> bool:
        """Whether dataset `name` is brought up to date this round: every round while no
        trainer pulls live or one pulls from it; otherwise at most every BACKGROUND_S."""
        if not self._pulled or name in self._pulled:
            return True
        return time.monotonic() - self._brought_at.get(name, -1e9) >= BACKGROUND_S

    def _current_specs(self) -> tuple[dict[str, CurationSpec], dict[str, SpecError]]:
        """The valid specs and the errors of the others (of `datasets` only, when given),
        listed at most every SPECS_EVERY_S; datasets a trainer pulled from live come first (in
        order of their last pull, read at most every PULLS_EVERY_S: the consumption table
        grows with a run)."""
        read_at, specs, errors = self._specs
        if time.monotonic() - read_at >= SPECS_EVERY_S:
            shelf = read_specs(self.lake)
            pulls_at, pulled = self._pulls
            if time.monotonic() - pulls_at >= PULLS_EVERY_S:
                pulled = live_consumed(self.lake, within_s=PULLING_S)
                self._pulls = (time.monotonic(), pulled)
            self._pulled = set(pulled)
            first = sorted(shelf.specs, key=lambda n: pulled.get(n, ""), reverse=True)
            specs, errors = {n: shelf.specs[n] for n in first}, shelf.errors
            if self.datasets is not None:
                specs = {n: spec for n, spec in specs.items() if n in self.datasets}
                errors = {n: error for n, error in errors.items() if n in self.datasets}
            self._specs = (time.monotonic(), specs, errors)
        return specs, errors

    def beat(self, done: Round | None = None) -> None:
        """Rewrite the heartbeat when a round wrote something, or every HEARTBEAT_S."""
        now = time.monotonic()
        if (done is None or not done.changed) and now - self._beat_at < HEARTBEAT_S:
            return
        self._beat_at = now
        beat = {"pid": os.getpid(), "updated_at": datetime.now(UTC).isoformat()}
        if self.slot is not None:
            held = self.lease
            beat["shard"] = {
                "slot": str(self.slot),
                "owner": self.leases.owner,
                "token": None if held is None else held.token,
                "expires_at": None if held is None else held.expires_at.isoformat(),
                "waiting": held is None,
            }
        beat |= {"rounds": self.rounds, "last_round_s": done.seconds if done else None}
        brought = dict(self.at_hand.brought)  # the worker may add to it meanwhile
        beat["brought"] = {name: b.to_json() for name, b in brought.items()}
        beat["failing"] = {name: f.to_json() for name, f in self.failing.items()}
        view = self.at_hand.silver
        if view is not None:  # what it holds of silver: all, or the window of a bounded view
            beat["silver"] = {
                "steps": view.steps_total,
                "in_memory": view.steps.frame.height,
                "history": None if view.history is None else str(view.history.path),
                "read_back": view.read_back,
            }
        self.lake.write_text(heartbeat_of(self.slot), json.dumps(beat))


def open_history(path: Path) -> History:
    """The follower's history at `path`, or, when another follower holds that one (RocksDB
    locks it), a folder of this process's own beside it (built from the lake)."""
    try:
        return History(path)
    except Exception as exc:  # rocksdict raises a plain Exception naming the lock
        if "lock" not in str(exc).lower():
            raise
        own = path.with_name(f"{path.name}-{os.getpid()}")
        log.warning("%s is held by another follower (%s): using %s", path, exc, own)
        shutil.rmtree(own, ignore_errors=True)
        return History(own)


def brought_before(lake: Lake, slot: Slot | None = None) -> dict[str, Brought]:
    """What the last follower's heartbeat (a shard's: its own) says it brought each dataset
    up to (nothing when it says nothing readable): a restarted follower's increments start
    from there."""
    try:
        text = lake.read_text(heartbeat_of(slot))
        saved = json.loads(text).get("brought", {}) if text else {}
        return {name: Brought.from_json(data) for name, data in saved.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def live_consumed(lake: Lake, within_s: float | None = None) -> dict[str, str]:
    """Per dataset, when a trainer last pulled a live batch from it (ISO time), counting
    pulls of the last `within_s` seconds when given."""
    if not lake.exists(GOLD_CONSUMPTION):
        return {}
    pulls = pl.col("kind") == LIVE_DELIVERY
    if within_s is not None:
        pulls = pulls & (pl.col("consumed_at") >= datetime.now(UTC) - timedelta(seconds=within_s))
    last = (
        lake.read(GOLD_CONSUMPTION, columns=["dataset", "consumed_at"], where=pulls)
        .group_by("dataset")
        .agg(pl.col("consumed_at").max())
    )
    return {d: t.isoformat() for d, t in last.iter_rows() if t is not None}


def materializer_running(
    lake: Lake, within_s: float = STALE_AFTER_S, slot: Slot | None = None
) -> bool:
    """Whether a live materializer's heartbeat is fresher than `within_s` seconds: the
    follower of `slot` when given, else any follower (unsharded, or a shard's)."""
    if slot is not None:
        names = [heartbeat_of(slot)]
    else:
        names = [HEARTBEAT]
        with contextlib.suppress(OSError):
            names += [n for n in lake.list_files("_live", ".json") if _SHARD_BEAT.search(n)]
    return any(_fresh(lake, name, within_s) for name in names)


_SHARD_BEAT = re.compile(r"materializer\.\d+of\d+\.json$")


def _fresh(lake: Lake, name: str, within_s: float) -> bool:
    """Whether heartbeat `name` was written within `within_s` seconds."""
    try:
        text = lake.read_text(name)
        updated = datetime.fromisoformat(json.loads(text)["updated_at"]) if text else None
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return updated is not None and (datetime.now(UTC) - updated).total_seconds() < within_s
