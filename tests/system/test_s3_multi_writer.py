"""Soak on object storage: three gateway replicas (distinct CLAW_GATEWAY_IDs) append to one
bronze table on a local S3 server that enforces conditional writes (SeaweedFS), while
`claw materialize --follow` keeps silver and gold current and a maintenance process compacts,
checkpoints and vacuums every table, for 90 s (`CLAW_SOAK_S`) of SIGKILLs of random replicas
and of the materializer. Clients retry each write (same event ids) until acknowledged: on another
replica when theirs could not be reached or is not ready (nothing was sent, or it refused);
on the same one when the request went out and no answer came (it may have made the write
durable before dying: its WAL and dedup index know the ids when it is back).

Afterwards: every acknowledged event id is in bronze exactly once, and nothing else is;
silver holds every acknowledged step and fact exactly once; gold equals a from-scratch
rebuild."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import httpx
import polars as pl
import pytest

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    SILVER_FEEDBACK,
    SILVER_STEPS,
    gold_dataset_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.live import LiveMaterializer
from claw_pipelines.materialize.silver import build_silver
from tests.support.crash_load import make_request
from tests.support.s3 import s3_options, seaweed_server
from tests.support.servers import REPO, GatewayProcess

CHAOS_S = float(os.environ.get("CLAW_SOAK_S", "90"))
REPLICAS = ("gw-a", "gw-b", "gw-c")
SPEC = CurationSpec(name="soak", reward_status=["pending", "missing", "final"])
MAINTAINED = (BRONZE_EVENTS, SILVER_STEPS, SILVER_FEEDBACK, "silver/trajectories")
MAINTENANCE = """
import sys, time
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.live import LiveMaterializer
from claw_pipelines.settings import ClawSettings
lake = Lake.from_settings(ClawSettings())
rounds = 0
while True:
    for table in sys.argv[1:]:
        if lake.exists(table):
            lake.maintain(table, retention_hours=168)
    rounds += 1
    print(f"maintenance round {rounds}", flush=True)
    time.sleep(2)
"""


class Ledger:
    """What the clients were acknowledged for, and how they got there."""

    def __init__(self) -> None:
        self.acked: list[str] = []
        self.failovers = 0  # retries on another replica
        self.unanswered = 0  # retries on the same replica after a lost answer


async def failover_client(urls: list[str], seed: int, ledger: Ledger, stop: asyncio.Event):
    """Random writes, each retried with the same event ids until acknowledged: on the next
    replica when nothing was sent or it refused, on the same one when an answer was lost."""
    rng = random.Random(seed)
    at = seed % len(urls)
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            path, body, ids = make_request(rng)
            pinned = False  # once sent without an answer, only that replica may take it
            while True:
                try:
                    response = await http.post(urls[at] + path, json=body)
                    if response.status_code == 200:
                        ledger.acked.extend(ids)
                        break
                    assert response.status_code == 503, response.text
                except (httpx.ConnectError, httpx.ConnectTimeout):
                    pass  # not reached: another replica may take it, unless pinned
                except httpx.TransportError:
                    ledger.unanswered += 1
                    pinned = True
                if pinned:
                    await asyncio.sleep(0.1)  # until it is back: its WAL knows the ids
                    continue
                at = (at + 1) % len(urls)
                ledger.failovers += 1
                await asyncio.sleep(0.05)


def started(command: list[str], env: dict[str, str], log) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _rows(frame: pl.DataFrame) -> list[tuple]:
    return sorted(
        frame.select("step_key", "prompt_ids", "response_ids").iter_rows(), key=lambda r: r[0]
    )


@pytest.mark.soak
def test_three_replicas_materializer_and_maintenance_on_s3_through_sigkills(tmp_path):
    with seaweed_server(tmp_path / "s3") as s3:
        uri, options = "s3://claw-lake/soak", s3_options(s3)
        lake = Lake(uri, options)
        save_spec(lake, SPEC)
        env = {
            **os.environ,
            "CLAW_LAKE_URI": uri,
            "CLAW_STORAGE_OPTIONS": json.dumps(options),
            "CLAW_WAL_DIR": str(tmp_path / "wal"),
            "CLAW_FLUSH_INTERVAL_MS": "500",
        }
        gateways = [
            GatewayProcess(
                tmp_path / name,
                CLAW_GATEWAY_ID=name,
                **{k: v for k, v in env.items() if k.startswith("CLAW_")},
            ).start()
            for name in REPLICAS
        ]
        log = (tmp_path / "workers.log").open("ab")
        claw = [sys.executable, "-m", "claw_pipelines.app.cli"]
        follow = [*claw, "materialize", "--follow", "--poll-s", "0.5"]
        materializer = started(follow, env, log)
        maintenance = started([sys.executable, "-c", MAINTENANCE, *MAINTAINED], env, log)
        ledger = Ledger()
        kills = {"replica": 0, "materializer": 0}

        async def scenario() -> None:
            nonlocal materializer
            stop = asyncio.Event()
            urls = [g.url for g in gateways]
            clients = [
                asyncio.create_task(failover_client(urls, seed, ledger, stop)) for seed in range(6)
            ]
            rng = random.Random(20)
            deadline = time.monotonic() + CHAOS_S
            next_materializer_kill = time.monotonic() + rng.uniform(20, 35)
            while time.monotonic() < deadline:
                await asyncio.sleep(rng.uniform(6, 12))
                victim = rng.choice(gateways)
                victim.kill()
                kills["replica"] += 1
                await asyncio.sleep(rng.uniform(0.5, 2.0))
                await asyncio.to_thread(victim.start)
                if time.monotonic() >= next_materializer_kill:
                    materializer.send_signal(signal.SIGKILL)
                    materializer.wait(10)
                    kills["materializer"] += 1
                    materializer = started(follow, env, log)
                    next_materializer_kill = time.monotonic() + rng.uniform(20, 35)
            stop.set()
            await asyncio.gather(*clients)

        try:
            asyncio.run(scenario())
        finally:
            for gateway in gateways:
                gateway.stop()  # drains its WAL into bronze
            for worker in (materializer, maintenance):
                worker.terminate()
                worker.wait(60)
            log.close()
        print(
            f"kills {kills}, acknowledged {len(ledger.acked)}, failovers {ledger.failovers}, "
            f"unanswered retries {ledger.unanswered}"
        )
        assert kills["replica"] >= CHAOS_S // 15 and kills["materializer"] >= CHAOS_S // 60, kills
        assert len(ledger.acked) > 500 and ledger.failovers > 0

        # bronze: every acknowledged id exactly once, nothing else
        bronze = lake.read(BRONZE_EVENTS, columns=["event_id", "kind", "gateway_id"])
        acked = set(ledger.acked)
        assert len(ledger.acked) == len(acked)
        assert set(bronze["event_id"]) == acked, "bronze and the acknowledgements differ"
        assert bronze["event_id"].n_unique() == bronze.height, "a record is in bronze twice"
        assert set(bronze["gateway_id"]) == set(REPLICAS)

        # silver and gold as the materializer left them, caught up by one more round
        LiveMaterializer(lake).step()
        stored = pl.concat(
            [
                lake.read(SILVER_STEPS, columns=["event_id"])["event_id"],
                lake.read(SILVER_FEEDBACK, columns=["event_id"])["event_id"],
            ]
        )
        assert stored.n_unique() == stored.len(), "a record is in silver twice"
        events = set(bronze.filter(pl.col("kind") == "event")["event_id"])
        assert set(stored) == acked - events
        assert lake.read("silver/step_conflicts").is_empty()

        # gold, built in increments while everything above happened, equals a rebuild
        live = read_steps(lake, gold_dataset_table(SPEC.name)).filter(
            pl.col("policy_version") == 0
        )  # whole prompts (docs/DESIGN.md §18)
        fresh = Lake(str(tmp_path / "rebuilt"))
        fresh.append(BRONZE_EVENTS, lake.read(BRONZE_EVENTS).to_arrow())
        build_silver(fresh)
        rebuilt = build_partition(fresh, SPEC, 0)
        assert _rows(live) == _rows(rebuilt.steps)
        assert live.height == lake.read(SILVER_STEPS).height
