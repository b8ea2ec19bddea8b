"""For half a minute, at the same time: clients write through the gateway, silver is materialized
over and over, and maintenance compacts, checkpoints and vacuums bronze and silver. No client
sees a failed commit, nothing is lost or doubled, and every retained version reads back."""

from __future__ import annotations

import asyncio
import threading
import time

import polars as pl
import pytest

from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import SILVER_TABLES, build_silver
from tests.support.crash_load import client
from tests.support.servers import GatewayProcess

DURATION_S = 30  # races between silver writers are in test_exactly_once and the stack soak


def _loop(work, stop: threading.Event, errors: list[BaseException], pause: float) -> None:
    while not stop.is_set():
        try:
            work()
        except BaseException as exc:  # collected; the test fails on any
            errors.append(exc)
        stop.wait(pause)


@pytest.mark.soak
def test_appends_silver_runs_and_maintenance_together_lose_and_double_nothing(tmp_path):
    lake_path = tmp_path / "lake"
    lake = Lake(str(lake_path))
    acked: list[str] = []
    errors: list[BaseException] = []
    runs = {"silver": 0, "maintenance": 0}

    def silver() -> None:
        if lake.exists(BRONZE_EVENTS):
            build_silver(lake)
            runs["silver"] += 1

    def maintenance() -> None:
        for table in (BRONZE_EVENTS, *SILVER_TABLES):
            if lake.exists(table):
                lake.maintain(table)
        runs["maintenance"] += 1

    with GatewayProcess(lake_path, CLAW_FLUSH_INTERVAL_MS="100") as server:
        stop_threads = threading.Event()
        threads = [
            threading.Thread(target=_loop, args=(silver, stop_threads, errors, 0.2)),
            threading.Thread(target=_loop, args=(maintenance, stop_threads, errors, 0.5)),
        ]
        for thread in threads:
            thread.start()

        async def load() -> int:
            stop = asyncio.Event()
            tasks = [asyncio.create_task(client(server.url, s, acked, stop)) for s in range(4)]
            await asyncio.sleep(DURATION_S)
            stop.set()
            return sum(await asyncio.gather(*tasks))

        started = time.monotonic()
        retries = asyncio.run(load())
        stop_threads.set()
        for thread in threads:
            thread.join(120)
    assert time.monotonic() - started >= DURATION_S
    assert not errors, errors[:3]
    assert runs["silver"] > 5 and runs["maintenance"] > 5
    assert retries == 0, "a client saw something other than 200"

    bronze = lake.read(BRONZE_EVENTS, columns=["event_id", "kind"])
    assert bronze["event_id"].n_unique() == bronze.height
    assert set(bronze["event_id"]) == set(acked)
    build_silver(lake)
    steps = lake.read("silver/steps", columns=["event_id"])["event_id"]
    facts = lake.read("silver/feedback", columns=["event_id"])["event_id"]
    in_silver = pl.concat([steps, facts])
    assert in_silver.n_unique() == in_silver.len()
    events = set(bronze.filter(pl.col("kind") == "event")["event_id"])
    assert lake.read("silver/step_conflicts").is_empty()  # every trajectory id is unique
    assert set(in_silver) == set(acked) - events

    newest = lake.version(BRONZE_EVENTS)
    sizes = [
        lake.read(BRONZE_EVENTS, version=v, columns=["event_id"]).height
        for v in range(1, newest + 1, max(1, newest // 12))
    ]
    assert sizes == sorted(sizes) and sizes[-1] <= bronze.height  # every retained version reads
