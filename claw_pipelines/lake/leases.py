"""Shard leases with fencing tokens, kept in the lake (docs/DESIGN.md §19).

A materializer shard (`Slot`: index i of count N) is owned by one follower at a time under a
lease: a row of `ops/shard_leases` (one partition a shard) holding the owner, an expiry and a
fencing token. Acquiring, renewing and releasing are guarded Delta commits carrying the
transaction `claw.lease.<i>of<N>`: of two followers racing for a shard exactly one commits
(the other's commit conflicts, it reads again and finds the shard held). Every change of
owner takes the token one higher.

The lease alone cannot stop a follower that paused past its expiry (a long GC, a network
partition) and then commits: clocks decide expiry, not safety. The token does: a new owner
first records its token in every table the shard writes (`Lake.fence`), and every commit of
the shard carries `claw.shard.<i>of<N>` at its token (`Guard.fences`). A commit based on a
version where a larger token is recorded raises Fenced; one racing the new owner's fence
conflicts (the same application id committed since it read) and, read again, is Fenced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.errors import WriteConflict
from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.tables import SHARD_LEASES, TABLES
from claw_pipelines.lake.delta import Guard, Lake, empty_frame

LEASE_TTL_S = 30.0  # a lease not renewed for this long may be taken over


@dataclass(frozen=True)
class Lease:
    """A held lease: the slot, who holds it, its fencing token and until when."""

    slot: Slot
    owner: str
    token: int
    acquired_at: datetime
    expires_at: datetime

    def guard(self, guard: Guard) -> Guard:
        """`guard` with this lease's fence: its commits land only while no newer owner's
        token reached the table."""
        return replace(guard, fences={**guard.fences, self.slot.writer_app_id: self.token})


class LeaseLost(Exception):
    """The lease is another follower's now (it expired and was taken over)."""


class Resharded(LeaseLost):
    """The lake is split another number of ways now: this follower's shard is retired."""


PLAN = "ops/shard_plan.json"  # how many ways the lake is split (`claw shards --count N`)


@dataclass(frozen=True)
class ShardPlan:
    """How many followers split the lake now (`count`; 1: one follower, unsharded), the
    count before the last change, and when it was set."""

    count: int
    previous: int | None
    set_at: str

    @classmethod
    def read(cls, lake: Lake) -> ShardPlan | None:
        """The lake's plan (None: never set, any count may follow)."""
        text = lake.read_text(PLAN)
        if not text:
            return None
        data = json.loads(text)
        return cls(int(data["count"]), data.get("previous"), str(data.get("set_at", "")))

    @classmethod
    def set(cls, lake: Lake, count: int) -> ShardPlan:
        """Split the lake `count` ways from now on: followers of another count stop, those
        of this one take over once the old ones' leases are gone."""
        if count < 1:
            raise ValueError(f"shard count {count}: at least 1")
        before = cls.read(lake)
        previous = None if before is None else before.count
        if before is not None and before.count == count:
            previous = before.previous
        plan = cls(count, previous, datetime.now(UTC).isoformat(timespec="seconds"))
        lake.write_text(PLAN, json.dumps(dataclasses.asdict(plan)))
        return plan

    def slot_of(self, slot: Slot | None) -> str | None:
        """Why a follower of `slot` (None: unsharded) may not follow under this plan, or
        None when it may."""
        given = 1 if slot is None else slot.count
        if given == self.count:
            return None
        wanted = "one follower, unsharded" if self.count == 1 else f"--shard i/{self.count}"
        return f"the lake is split {self.count} way(s) now ({wanted})"


def follower_id() -> str:
    """A name for this follower process: host, pid and a random suffix (unique across
    restarts: a restarted follower never mistakes an old lease for its own)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class ShardLeases:
    """The shard leases of a lake, as seen by follower `owner`."""

    def __init__(
        self,
        lake: Lake,
        owner: str,
        ttl_s: float = LEASE_TTL_S,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.lake = lake
        self.owner = owner
        self.ttl = timedelta(seconds=ttl_s)
        self.clock = clock

    def holders(self) -> pl.DataFrame:
        """Every shard's lease row (`ops/shard_leases`), with `expired` as of now."""
        if self.lake.exists(SHARD_LEASES):
            rows = self.lake.read(SHARD_LEASES)
        else:
            rows = empty_frame(TABLES[SHARD_LEASES].schema)
        now = self.clock()
        return rows.with_columns(
            expired=pl.col("released_at").is_not_null() | (pl.col("expires_at") <= now)
        ).sort("shard_count", "shard_index")

    def acquire(self, slot: Slot) -> Lease | None:
        """Take `slot` if nobody holds it (never held, released, or expired), with the next
        token; None when another follower holds it."""
        for _ in range(20):
            version, row = self._row(slot)
            now = self.clock()
            held = row is not None and row["released_at"] is None and row["expires_at"] > now
            if held and row["owner"] != self.owner:
                return None
            try:
                if held:  # ours already (e.g. asked again after a restart of this object)
                    return self._renewed(slot, version, row)
                token = (row["token"] if row is not None else 0) + 1
                lease = Lease(slot, self.owner, token, now, now + self.ttl)
                self._write(lease, version, renewed_at=now, released_at=None)
                return lease
            except WriteConflict:  # another follower committed for this slot: look again
                continue
        return None

    def renew(self, lease: Lease) -> Lease:
        """Extend `lease` by the TTL; LeaseLost when another follower took it over."""
        for _ in range(20):
            version, row = self._row(lease.slot)
            if row is None or row["owner"] != self.owner or row["token"] != lease.token:
                raise LeaseLost(f"shard {lease.slot}: held by {row and row['owner']} now")
            if row["released_at"] is not None:
                raise LeaseLost(f"shard {lease.slot}: released")
            try:
                return self._renewed(lease.slot, version, row)
            except WriteConflict:
                continue
        raise LeaseLost(f"shard {lease.slot}: could not renew (concurrent commits)")

    def release(self, lease: Lease) -> None:
        """Give the lease up now (another follower may take it at once); a lease another
        follower holds already is left alone."""
        for _ in range(20):
            version, row = self._row(lease.slot)
            if row is None or row["owner"] != self.owner or row["token"] != lease.token:
                return
            now = self.clock()
            released = replace(lease, expires_at=now)
            try:
                self._write(released, version, renewed_at=now, released_at=now)
                return
            except WriteConflict:
                continue

    def held_by_others(self, count: int) -> pl.DataFrame:
        """The leases of shards of another count than `count` still held (a resharding
        waits for them to be released or to lapse)."""
        rows = self.holders()
        return rows.filter((pl.col("shard_count") != count) & ~pl.col("expired"))

    def retired(self, count: int) -> dict[str, int]:
        """The writers of shards of other counts than `count`, each at one past its last
        token: fencing them stops a follower of an earlier split that wakes up late."""
        rows = self.holders().filter(pl.col("shard_count") != count)
        return {
            Slot(int(i), int(n)).writer_app_id: int(token) + 1
            for n, i, token in rows.select("shard_count", "shard_index", "token").iter_rows()
        }

    def fence(self, lease: Lease, tables: Iterable[str]) -> None:
        """Record the lease's token in `tables` (the shard writes them): an earlier owner's
        commits to them raise Fenced from then on."""
        for table in tables:
            self.lake.fence(table, lease.slot.writer_app_id, lease.token)

    # -- rows ---------------------------------------------------------------------------------
    def _row(self, slot: Slot) -> tuple[int | None, dict | None]:
        """(the leases table's version, the slot's row then, or None)."""
        self.lake.ensure(TABLES[SHARD_LEASES])
        version = self.lake.version(SHARD_LEASES)
        where = (pl.col("shard_count") == slot.count) & (pl.col("shard_index") == slot.index)
        rows = self.lake.read(SHARD_LEASES, version, where=where)
        return version, (rows.row(0, named=True) if rows.height else None)

    def _renewed(self, slot: Slot, version: int | None, row: dict) -> Lease:
        now = self.clock()
        lease = Lease(slot, self.owner, row["token"], row["acquired_at"], now + self.ttl)
        self._write(lease, version, renewed_at=now, released_at=None)
        return lease

    def _write(
        self, lease: Lease, version: int | None, renewed_at: datetime, released_at: datetime | None
    ) -> None:
        """Replace the slot's row, based on `version` (WriteConflict if the slot's lease
        changed since)."""
        slot = lease.slot
        row = {
            "shard_count": [slot.count],
            "shard_index": [slot.index],
            "owner": [lease.owner],
            "token": [lease.token],
            "acquired_at": [lease.acquired_at],
            "renewed_at": [renewed_at],
            "expires_at": [lease.expires_at],
            "released_at": [released_at],
        }
        spec = TABLES[SHARD_LEASES]
        data = pa.Table.from_pydict(row, schema=spec.schema)
        guard = Guard((slot.lease_app_id,), lease.token, {SHARD_LEASES: version or 0})
        where = f"shard_count = {slot.count} AND shard_index = {slot.index}"
        self.lake.overwrite(spec, data, where=where, guard=guard)
