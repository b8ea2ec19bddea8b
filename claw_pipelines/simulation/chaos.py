"""Chaos for sharded materialization (docs/DESIGN.md §19): `claw materialize --follow --shard
i/N` processes under a stream of GRPO groups landing in bronze, followers killed with SIGKILL
at random (each restarted at once: it waits for the lease to lapse), the lake resharded
midway, trainer ranks pulling `next_batch` all along. What was landed and what each rank got
come back, for the soak test to assert and `benchmarks/shards.py` to report."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.contracts.errors import NotFound
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import ShardPlan
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.simulation.bulk import BulkShape, bronze_batch, group_rows

# complete GRPO groups of 4 rollouts x 2 turns, as trainers take them
CHAOS_SPEC = CurationSpec(
    name="chaos",
    reward_status=["final", "missing"],
    trajectory_status=["complete"],
    complete_groups_only=True,
    merge="prompt_group",
    advantage="grpo",
)
SHAPE = BulkShape(rollouts=4, turns=2, prompt_tokens=(50, 200), response_tokens=(5, 40))


@dataclass
class Chaos:
    """How the run goes: groups landed every `every_s`, a follower killed after the groups
    in `kills_at`, the split changed after the groups in `reshard_at` (group -> new count),
    `ranks` trainer ranks, leases of `ttl_s`."""

    groups: int = 36
    every_s: float = 0.25
    start_count: int = 2
    kills_at: tuple[int, ...] = (6, 14, 26, 31)
    reshard_at: dict[int, int] = field(default_factory=lambda: {20: 3})
    ranks: int = 2
    ttl_s: float = 1.5
    drain_s: float = 120.0
    seed: int = 57


@dataclass
class ChaosResult:
    """What landed and what each rank was given; kills, reshardings, followers' exits."""

    landed: list[str]
    delivered: dict[int, list[str]]
    kills: int
    reshardings: int
    exit_codes: dict[str, int]
    logs: str
    seconds: float

    @property
    def counts(self) -> Counter:
        """Group -> how many times a rank was given it."""
        return Counter(g for got in self.delivered.values() for g in got)

    def summary(self) -> dict[str, object]:
        """The figures: acknowledged groups, delivered once, lost, twice, kills, reshardings."""
        counts = self.counts
        return {
            "acknowledged_groups": len(self.landed),
            "delivered_once": sum(1 for g in self.landed if counts[g] == 1),
            "lost": sum(1 for g in self.landed if counts[g] == 0),
            "twice": sum(1 for n in counts.values() if n > 1),
            "unexpected": len(set(counts) - set(self.landed)),
            "per_rank": {str(r): len(got) for r, got in self.delivered.items()},
            "kills": self.kills,
            "reshardings": self.reshardings,
            "seconds": round(self.seconds, 1),
        }


class _Followers:
    """Shard followers as processes, restartable, their logs in `workdir`."""

    def __init__(self, lake: Lake, workdir: Path, ttl_s: float) -> None:
        self.workdir, self.started = workdir, 0
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = {**os.environ, "CLAW_LAKE_URI": lake.uri, "CLAW_SHARD_LEASE_TTL_S": str(ttl_s)}
        self.env["CLAW_FOLLOWER_STATE"] = str(workdir / "follower-state")
        self.env.pop("DAGSTER_HOME", None)

    def start(self, shard: str) -> None:
        self.started += 1
        log = (self.workdir / f"follower-{self.started}.log").open("w")
        command = [sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--follow"]
        self.procs[shard] = subprocess.Popen(
            [*command, "--poll-s", "0.05", "--shard", shard],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def running(self, count: int) -> list[str]:
        """The shards of a `count`-way split whose latest follower still runs."""
        return sorted(
            shard
            for shard, proc in self.procs.items()
            if proc.poll() is None and shard.endswith(f"/{count}")
        )

    def kill(self, shard: str) -> None:
        self.procs[shard].send_signal(signal.SIGKILL)
        self.procs[shard].wait(10)

    def stop_all(self) -> dict[str, int]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        return {shard: proc.wait(60) for shard, proc in self.procs.items()}

    def logs(self) -> str:
        return "\n".join(p.read_text() for p in sorted(self.workdir.glob("follower-*.log")))


def _pull(lake: Lake, rank: int, ranks: int, got: list[str], stop: threading.Event) -> None:
    """Trainer rank `rank`: whole groups, batch after batch, until `stop`."""
    dataset = None
    while dataset is None:  # until the first groups have built it (and its lineage)
        try:
            dataset = Dataset(lake, CHAOS_SPEC.name)
        except NotFound:
            if stop.wait(0.1):
                return
    while not stop.is_set():
        batch = dataset.next_batch(1, consumer="chaos", rank=rank, world_size=ranks, timeout=0.5)
        if batch is not None:
            got.extend(batch.groups)


def run_chaos(lake: Lake, workdir: Path, chaos: Chaos | None = None) -> ChaosResult:
    """Run the scenario on `lake` (empty), followers' logs in `workdir`."""
    chaos = chaos or Chaos()
    save_spec(lake, CHAOS_SPEC)
    ShardPlan.set(lake, chaos.start_count)
    followers = _Followers(lake, workdir, chaos.ttl_s)
    for index in range(chaos.start_count):
        followers.start(f"{index}/{chaos.start_count}")
    delivered: dict[int, list[str]] = {rank: [] for rank in range(chaos.ranks)}
    stop = threading.Event()
    pulling = [
        threading.Thread(target=_pull, args=(lake, r, chaos.ranks, delivered[r], stop))
        for r in range(chaos.ranks)
    ]
    for thread in pulling:
        thread.start()
    pick, rng = random.Random(chaos.seed), np.random.default_rng(chaos.seed)
    landed, kills, reshardings, count = [], 0, 0, chaos.start_count
    started = time.monotonic()
    try:
        for group in range(chaos.groups):
            rows = group_rows(group, SHAPE, rng)
            lake.append(BRONZE_EVENTS, bronze_batch(rows, group, rng))
            landed.append(f"{rows[0]['policy_version']}:{rows[0]['prompt_uid']}")
            time.sleep(chaos.every_s)
            if group in chaos.kills_at:  # a follower dies wherever it is; another starts
                shard = pick.choice(followers.running(count))
                followers.kill(shard)
                followers.start(shard)
                kills += 1
            if group in chaos.reshard_at:  # the old split stands down, the new one starts
                count = chaos.reshard_at[group]
                ShardPlan.set(lake, count)
                for index in range(count):
                    followers.start(f"{index}/{count}")
                reshardings += 1
        deadline = time.monotonic() + chaos.drain_s
        while time.monotonic() < deadline and sum(map(len, delivered.values())) < len(landed):
            time.sleep(0.1)
    finally:
        stop.set()
        for thread in pulling:
            thread.join(30)
        codes = followers.stop_all()
    return ChaosResult(
        landed, delivered, kills, reshardings, codes, followers.logs(), time.monotonic() - started
    )
