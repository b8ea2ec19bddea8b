"""Soak: a gateway under mixed load (white-box steps, feedback, proxied chat calls) is killed
with SIGKILL five times; afterwards every acknowledged record is in silver exactly once. And
a silver run killed mid-materialization converges, on rerun, to the uninterrupted result."""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid

import httpx
import polars as pl
import pytest

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import SILVER_TABLES, build_silver, watermark
from tests.support.crash_load import client as white_box_client
from tests.support.lakes import group_of, land
from tests.support.servers import REPO, GatewayProcess
from tests.support.upstreams import SimProcess, proxy_env

KEY, TENANT = "soak-key", "tenant-soak"
KILLS = 5


async def proxy_client(url: str, seed: int, acked: list[str], stop: asyncio.Event) -> int:
    """Chat calls through the proxy, each retried under one Idempotency-Key until answered."""
    rng = random.Random(seed)
    retries = 0
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=10, headers=headers) as http:
        while not stop.is_set():
            key = f"soak-{uuid.uuid4().hex}"
            body = {
                "model": "claw-sim-llm",
                "messages": [{"role": "user", "content": f"What is {rng.randrange(99)} + 1?"}],
            }
            while True:
                try:
                    answer = await http.post(
                        url + "/v1/chat/completions", json=body, headers={"Idempotency-Key": key}
                    )
                    if answer.status_code == 200:
                        acked.append(key)
                        break
                    assert answer.status_code in (502, 503, 504), answer.text
                except httpx.TransportError:
                    pass
                retries += 1
                await asyncio.sleep(0.05)
    return retries


@pytest.mark.soak  # in `make soak` (CI runs it): kill loops, ~10 s each
def test_five_sigkills_under_mixed_load_then_silver_holds_each_acknowledged_record_once(tmp_path):
    lake_path = tmp_path / "lake"
    with SimProcess(tmp_path) as sim:
        env = proxy_env(sim.url, KEY, TENANT, CLAW_FLUSH_INTERVAL_MS="100")
        server = GatewayProcess(lake_path, **env).start()
        acked: list[str] = []

        async def scenario() -> int:
            stop = asyncio.Event()
            auth = {"Authorization": f"Bearer {KEY}"}
            tasks = [
                asyncio.create_task(white_box_client(server.url, s, acked, stop, auth))
                for s in range(3)
            ]
            tasks += [
                asyncio.create_task(proxy_client(server.url, 100 + s, acked, stop))
                for s in range(3)
            ]
            rng = random.Random(99)
            for _ in range(KILLS):
                await asyncio.sleep(rng.uniform(0.5, 1.5))
                server.kill()
                await asyncio.to_thread(server.start)
            await asyncio.sleep(1.0)
            stop.set()
            return sum(await asyncio.gather(*tasks))

        retries = asyncio.run(scenario())
        server.stop()
    assert len(acked) > 100 and retries > 0

    lake = Lake(str(lake_path))
    build_silver(lake)
    steps = lake.read("silver/steps", columns=["event_id"])["event_id"]
    facts = lake.read("silver/feedback", columns=["event_id"])["event_id"]
    assert lake.read("silver/step_conflicts").is_empty()  # every trajectory id is unique
    stored = pl.concat([steps, facts]).to_list()
    assert len(stored) == len(set(stored)), "a record is in silver twice"
    events = set(
        lake.read("bronze/events", columns=["event_id", "kind"]).filter(pl.col("kind") == "event")[
            "event_id"
        ]
    )
    assert set(acked) - events <= set(stored), "an acknowledged record is missing from silver"
    assert set(stored) <= set(acked), "silver holds a record nobody was acknowledged for"


def _silver_frames(lake: Lake) -> dict[str, pl.DataFrame]:
    frames = {}
    for table in SILVER_TABLES:
        frame = lake.read(table)
        keys = ("step_key", "feedback_id", "trajectory_uid", "event_id")
        key = next(c for c in keys if c in frame.columns)
        frames[table] = frame.sort(key)
    return frames


@pytest.mark.soak  # in `make soak` (CI runs it): kill loops, ~10 s each
def test_a_silver_run_killed_midway_converges_to_the_uninterrupted_result(tmp_path):
    source = Lake(str(tmp_path / "source"))
    for batch in range(6):  # a bronze of many commits: the run takes a moment
        rows = []
        for g in range(20):
            rows += group_of(f"b{batch}g{g}", [batch, g, 1, 2, 3] * 40, [1.0, 0.0, 0.5], turns=3)
        land(source, rows)
    shutil.copytree(source.uri, tmp_path / "killed")
    shutil.copytree(source.uri, tmp_path / "clean")
    killed, clean = Lake(str(tmp_path / "killed")), Lake(str(tmp_path / "clean"))
    build_silver(clean)

    script = (
        "import sys; from claw_pipelines.lake.delta import Lake; "
        "from claw_pipelines.materialize.silver import build_silver; "
        "build_silver(Lake(sys.argv[1]))"
    )
    interrupted = 0
    for delay in (0.4, 0.8, 1.2, 1.6, 2.0, 2.4):
        proc = subprocess.Popen([sys.executable, "-c", script, killed.uri], cwd=REPO)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.returncode == -signal.SIGKILL and watermark(killed) is None:
            interrupted += 1
    assert interrupted >= 1, "no run was killed before it finished"
    build_silver(killed)
    assert watermark(killed) == watermark(clean)
    got, want = _silver_frames(killed), _silver_frames(clean)
    for table in SILVER_TABLES:
        assert got[table].equals(want[table], null_equal=True), table
