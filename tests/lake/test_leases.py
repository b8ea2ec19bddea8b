"""Shard leases and fencing tokens on a real lake: one owner a shard, takeovers after expiry
or a kill, and a follower presumed dead refused at its next commit."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest

from claw_pipelines.contracts.errors import Fenced
from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.tables import SHARD_LEASES, SILVER_FEEDBACK, TABLES
from claw_pipelines.lake.delta import Guard, Lake
from claw_pipelines.lake.leases import Lease, LeaseLost, ShardLeases
from tests.support.racing import BarrierLake

REPO = Path(__file__).resolve().parents[2]


class Clock:
    """A clock the test moves (lease expiry is decided on the follower's clock)."""

    def __init__(self) -> None:
        self.now = datetime(2026, 12, 7, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def feedback_rows(feedback_id: str) -> pa.Table:
    """One silver/feedback row (any table a shard writes would do)."""
    spec = TABLES[SILVER_FEEDBACK]
    row = {name: [None] for name in spec.schema.names}
    row |= {"feedback_id": [feedback_id], "kind": ["reward"], "tenant": ["t"]}
    row["received_at"] = [datetime(2026, 12, 7, tzinfo=UTC)]
    return pa.Table.from_pydict(row, schema=spec.schema.remove_metadata())


def shard_append(lake: Lake, lease: Lease, feedback_id: str, read: int | None = None) -> int:
    """A commit of the shard's writer under `lease` (based on version `read`, default now)."""
    version = lake.version(SILVER_FEEDBACK) if read is None else read
    guard = lease.guard(Guard((), 0, {SILVER_FEEDBACK: version}))
    return lake.append(SILVER_FEEDBACK, feedback_rows(feedback_id), guard=guard)


def test_slots_parse_and_name_the_field():
    assert Slot.parse("1/3") == Slot(1, 3)
    assert str(Slot.parse(" 0 / 2 ")) == "0/2"
    for bad in ("3/3", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(ValueError, match="shard"):
            Slot.parse(bad)


def test_a_held_shard_is_refused_until_its_lease_expires_then_taken_with_a_larger_token(tmp_path):
    lake, clock = Lake(str(tmp_path / "lake")), Clock()
    first = ShardLeases(lake, "follower-a", ttl_s=30, clock=clock)
    second = ShardLeases(lake, "follower-b", ttl_s=30, clock=clock)
    slot = Slot(0, 2)

    lease = first.acquire(slot)
    assert lease is not None and lease.token == 1 and lease.owner == "follower-a"
    assert second.acquire(slot) is None  # held, not expired
    assert second.acquire(Slot(1, 2)).token == 1  # another shard is free

    clock.advance(20)
    renewed = first.renew(lease)  # the owner keeps it: same token, later expiry
    assert renewed.token == 1 and renewed.expires_at == clock.now + timedelta(seconds=30)
    clock.advance(20)
    assert second.acquire(slot) is None  # renewed 20 s ago: still held

    clock.advance(11)  # 31 s since the renewal: expired
    taken = second.acquire(slot)
    assert taken is not None and taken.owner == "follower-b" and taken.token == 2
    with pytest.raises(LeaseLost, match="follower-b"):
        first.renew(renewed)

    holders = second.holders().filter(pl.col("shard_count") == 2)
    assert holders.select("shard_index", "owner", "token", "expired").rows() == [
        (0, "follower-b", 2, False),
        (1, "follower-b", 1, True),  # taken 51 s ago, never renewed
    ]


def test_a_released_shard_is_taken_at_once(tmp_path):
    lake, clock = Lake(str(tmp_path / "lake")), Clock()
    first = ShardLeases(lake, "follower-a", clock=clock)
    second = ShardLeases(lake, "follower-b", clock=clock)
    lease = first.acquire(Slot(0, 1))
    first.release(lease)
    taken = second.acquire(Slot(0, 1))
    assert taken is not None and taken.token == 2
    first.release(lease)  # released again by the old owner: the new owner's lease stays
    assert second.holders()["owner"].to_list() == ["follower-b"]
    assert second.holders()["expired"].to_list() == [False]


def _race(uri: str, owner: str, barrier, results) -> None:
    """A follower process taking shard 0/1 once its first commit is held at the barrier."""
    lease = ShardLeases(BarrierLake(uri, barrier), owner).acquire(Slot(0, 1))
    results.put((owner, None if lease is None else lease.token))


def test_of_followers_racing_for_a_shard_exactly_one_gets_it(tmp_path):
    uri = str(tmp_path / "lake")
    Lake(uri).ensure(TABLES[SHARD_LEASES])  # (each racer would create it otherwise)
    context = multiprocessing.get_context("spawn")
    racers = 3
    barrier, results = context.Barrier(racers), context.Queue()
    processes = [
        context.Process(target=_race, args=(uri, f"follower-{i}", barrier, results))
        for i in range(racers)
    ]
    for process in processes:
        process.start()
    got = dict(results.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    winners = {owner: token for owner, token in got.items() if token is not None}
    assert len(winners) == 1 and list(winners.values()) == [1], got
    assert ShardLeases(Lake(uri), "reader").holders()["owner"].to_list() == list(winners)


def test_a_follower_presumed_dead_cannot_commit_once_another_owns_its_shard(tmp_path):
    lake, clock = Lake(str(tmp_path / "lake")), Clock()
    old = ShardLeases(lake, "follower-a", clock=clock)
    new = ShardLeases(lake, "follower-b", clock=clock)
    slot = Slot(1, 2)
    lake.ensure(TABLES[SILVER_FEEDBACK])
    stale = old.acquire(slot)
    shard_append(lake, stale, "f-1")  # lands while it owns the shard
    before_takeover = lake.version(SILVER_FEEDBACK)  # what the old owner read, then paused

    clock.advance(31)  # its lease lapsed while it paused
    lease = new.acquire(slot)
    assert lease.token == stale.token + 1
    new.fence(lease, [SILVER_FEEDBACK])

    # it comes back with a write computed before the takeover: the new owner's commit of
    # the same application id came since, so Delta refuses it, and read again the larger
    # token is there: refused for good
    with pytest.raises(Fenced, match=r"claw\.shard\.1of2 is owned under token 2"):
        shard_append(lake, stale, "f-2", read=before_takeover)
    with pytest.raises(Fenced):  # and computed on the newest state
        shard_append(lake, stale, "f-2")
    shard_append(lake, lease, "f-3")  # the new owner's commits land
    ids = lake.read(SILVER_FEEDBACK, columns=["feedback_id"])["feedback_id"].to_list()
    assert sorted(ids) == ["f-1", "f-3"]
    # another shard's writer is not fenced by this one's token
    other = new.acquire(Slot(0, 2))
    shard_append(lake, other, "f-4")
    with pytest.raises(Fenced):  # and fencing twice with an older token is refused
        lake.fence(SILVER_FEEDBACK, slot.writer_app_id, stale.token)


HOLDER = """
import sys, time
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import ShardLeases, Slot
leases = ShardLeases(Lake(sys.argv[1]), "holder", ttl_s=float(sys.argv[2]))
lease = leases.acquire(Slot(0, 1))
print(lease.token, flush=True)
while True:  # renews until killed
    time.sleep(0.2)
    lease = leases.renew(lease)
"""


def test_a_killed_holders_shard_is_taken_over_after_its_lease_lapses(tmp_path):
    uri, ttl = str(tmp_path / "lake"), 1.5
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, uri, str(ttl)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "1"
        follower = ShardLeases(Lake(uri), "follower", ttl_s=ttl)
        time.sleep(ttl + 0.5)
        assert follower.acquire(Slot(0, 1)) is None  # alive: it keeps renewing
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        killed_at = time.monotonic()
        lease = None
        while lease is None and time.monotonic() - killed_at < 10 * ttl:
            lease = follower.acquire(Slot(0, 1))
            time.sleep(0.1)
        assert lease is not None and lease.token == 2
        assert time.monotonic() - killed_at >= ttl - 0.5  # not before its lease lapsed
    finally:
        if holder.poll() is None:
            holder.kill()
