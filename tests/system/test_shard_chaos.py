"""Chaos (docs/DESIGN.md §19): shard followers under load, killed at random with SIGKILL, the
lake resharded once (2 -> 3), two trainer ranks pulling all along: every landed group is
delivered exactly once across the ranks, silver holds each key once, and the sharded lake
equals one follower's build of the same bronze."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.contracts.tables import SILVER_STEPS, gold_dataset_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import ShardLeases, ShardPlan
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import LIVE, group_of, land
from tests.support.servers import REPO, wait_until

TTL_S = 1.5  # the followers' lease: a killed one's shard is taken over this soon
GROUPS = 36


class Followers:
    """`claw materialize --follow --shard i/N` processes, restartable, their logs kept."""

    def __init__(self, lake: Lake, workdir: Path) -> None:
        self.lake, self.workdir = lake, workdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = 0
        self.env = {**os.environ, "CLAW_LAKE_URI": lake.uri, "CLAW_SHARD_LEASE_TTL_S": str(TTL_S)}
        self.env.pop("DAGSTER_HOME", None)

    def start(self, shard: str) -> None:
        self.started += 1
        log = (self.workdir / f"follower-{self.started}.log").open("w")
        command = [sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--follow"]
        command += ["--poll-s", "0.05", "--shard", shard]
        self.procs[shard] = subprocess.Popen(
            command, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def kill(self, shard: str) -> None:
        self.procs[shard].send_signal(signal.SIGKILL)
        self.procs[shard].wait(10)

    def running(self) -> list[str]:
        """The shards whose latest follower still runs."""
        return sorted(shard for shard, proc in self.procs.items() if proc.poll() is None)

    def stop_all(self) -> dict[str, int]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        return {shard: proc.wait(30) for shard, proc in self.procs.items()}

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.workdir.glob("follower-*.log")))


def pull(lake: Lake, rank: int, got: dict[int, list[str]], stop: threading.Event) -> None:
    """Trainer rank `rank` of 2: whole groups, one batch after another, until `stop`."""
    while not lake.exists(gold_dataset_table(LIVE.name)):  # the first groups build it
        if stop.wait(0.1):
            return
    dataset = Dataset(lake, LIVE.name)
    while not stop.is_set():
        batch = dataset.next_batch(4, consumer="chaos", rank=rank, world_size=2, timeout=0.5)
        if batch is not None:
            got[rank].extend(batch.groups)


@pytest.mark.soak  # in `make soak` (CI runs it): ~40 s of kills and a resharding
def test_shards_killed_and_resharded_under_load_deliver_each_group_once(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    ShardPlan.set(lake, 2)
    followers = Followers(lake, tmp_path)
    for shard in ("0/2", "1/2"):
        followers.start(shard)
    got: dict[int, list[str]] = {0: [], 1: []}
    stop = threading.Event()
    ranks = [threading.Thread(target=pull, args=(lake, r, got, stop)) for r in (0, 1)]
    for rank in ranks:
        rank.start()
    rng, kills, landed = random.Random(57), 0, []
    try:
        for n in range(GROUPS):
            land(lake, group_of(f"c{n:02d}", [n, 7, 7], [1.0, 0.0, 0.5], version=1, turns=2))
            landed.append(f"1:c{n:02d}")
            time.sleep(0.25)
            if n in (6, 14, 26, 31):  # a random shard's follower dies; another starts
                shard = rng.choice(followers.running())
                followers.kill(shard)
                followers.start(shard)
                kills += 1
            if n == 20:  # 2 -> 3: the 2-way followers stop on their own, 3 new ones start
                ShardPlan.set(lake, 3)
                for shard in ("0/3", "1/3", "2/3"):
                    followers.start(shard)
        wait_until(lambda: len(got[0]) + len(got[1]) >= GROUPS, 120, what="every group delivered")
    finally:
        stop.set()
        for rank in ranks:
            rank.join(30)
        codes = followers.stop_all()
    logs = followers.logs()
    delivered = got[0] + got[1]
    assert sorted(delivered) == sorted(landed), (len(delivered), len(landed))  # once each
    assert got[0] and got[1]  # both ranks took a share
    assert kills == 4 and logs.count("stopped: shard") >= 2  # the 2-way followers stood down
    assert "lease taken" in logs
    assert codes["0/3"] == 0 and codes["1/3"] == 0 and codes["2/3"] == 0
    leases = ShardLeases(lake, "reader").holders()
    assert leases.filter(pl.col("shard_count") == 3).height == 3
    keys = lake.read(SILVER_STEPS, columns=["step_key", "event_id"])
    assert keys["step_key"].is_unique().all() and keys["event_id"].is_unique().all()

    one = Lake(str(tmp_path / "one"))
    shutil.copytree(f"{lake.uri}/bronze", tmp_path / "one" / "bronze")
    build_silver(one)
    save_spec(one, LIVE)
    build_partition(one, LIVE, 1)
    for table, key in ((SILVER_STEPS, "step_key"), (gold_dataset_table(LIVE.name), "step_key")):
        mine = lake.read(table).drop("landed_at", strict=False).sort(key)
        theirs = one.read(table).drop("landed_at", strict=False).sort(key)
        assert mine.equals(theirs, null_equal=True), table
