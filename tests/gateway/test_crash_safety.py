"""A 2xx survives `kill -9`: a gateway under concurrent load is killed and restarted."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import httpx
import polars as pl
import pytest

from tests.support.crash_load import client
from tests.support.servers import GatewayProcess, bronze, wait_until

CLIENTS = 6
KILLS = 3


@pytest.mark.slow
def test_acknowledged_records_survive_sigkill_exactly_once(tmp_path):
    lake = tmp_path / "lake"
    server = GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="100").start()
    acked: list[str] = []

    async def scenario() -> int:
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(client(server.url, seed, acked, stop)) for seed in range(CLIENTS)
        ]
        rng = random.Random(1234)
        for _ in range(KILLS):
            await asyncio.sleep(rng.uniform(0.8, 2.0))
            before = len(acked)
            server.kill()
            await asyncio.to_thread(server.start)
            assert len(acked) > before or before > 0
        await asyncio.sleep(1.0)
        stop.set()
        return sum(await asyncio.gather(*tasks))

    retries = asyncio.run(scenario())
    server.stop()

    assert len(acked) > 100, "the load was too light to prove anything"
    assert retries > 0, "no request was in flight at a kill"
    frame = bronze(lake)
    counts = frame.group_by("event_id").len()
    duplicated = counts.filter(pl.col("len") > 1)
    assert duplicated.height == 0, duplicated
    stored = set(frame["event_id"].to_list())
    assert stored == set(acked), (len(stored - set(acked)), len(set(acked) - stored))
    assert not list((lake / "_wal" / "gw-test").glob("*.wal"))


@pytest.mark.slow
def test_wal_replay_lands_records_acknowledged_before_a_kill(tmp_path):
    """Kill right after the ack, before any flush: the restart lands it from the WAL."""
    lake = tmp_path / "lake"
    server = GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="60000").start()
    response = httpx.post(server.url + "/v1/events", json={"type": "durable", "event_id": "e-1"})
    assert response.status_code == 200
    assert bronze(lake).height == 0  # nothing flushed yet: only the WAL has it
    server.kill()
    server.start()
    rows = wait_until(lambda: bronze(lake) if bronze(lake).height else None, what="replay")
    assert rows["event_id"].to_list() == ["e-1"]
    again = httpx.post(server.url + "/v1/events", json={"type": "durable", "event_id": "e-1"})
    assert again.json()["duplicates"] == 1
    server.stop()
    assert bronze(lake)["event_id"].to_list() == ["e-1"]


def _helper_pids(parent: int, module: str) -> list[int]:
    """Pids of `python -m <module>` children of `parent`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat, open(f"/proc/{entry}/cmdline", "rb") as cmd:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
                argv = cmd.read().split(b"\0")
        except OSError:
            continue
        if ppid == parent and module.encode() in argv:
            found.append(int(entry))
    return found


def _posted(url: str, body: dict) -> httpx.Response | None:
    """The response when 200, else None (to retry)."""
    response = httpx.post(url, json=body, timeout=10)
    return response if response.status_code == 200 else None


def test_a_killed_syncer_is_replaced_and_nothing_acknowledged_is_lost(tmp_path):
    lake = tmp_path / "lake"
    server = GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="50").start()
    acked = []
    try:
        for i in range(5):
            body = {"type": "a", "event_id": f"a-{i}"}
            acked += httpx.post(server.url + "/v1/events", json=body).json()["event_ids"]
        (syncer,) = _helper_pids(server.proc.pid, "gateway.wal.syncer")
        os.kill(syncer, signal.SIGKILL)
        for i in range(5):  # like any client: retry a 503 with the same event id
            body = {"type": "b", "event_id": f"b-{i}"}
            reply = wait_until(lambda body=body: _posted(server.url + "/v1/events", body),
                               what="a write after the syncer restarted")  # fmt: skip
            acked += reply.json()["event_ids"]
        assert _helper_pids(server.proc.pid, "gateway.wal.syncer") not in ([], [syncer])
    finally:
        server.stop()
    assert sorted(bronze(lake)["event_id"].to_list()) == sorted(acked)
