"""Policy versions: a trainer publishes them (API and CLI), they only go up, the gateway
stamps the newest on steps that name none (white-box and proxied), and staleness counts
from it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import openai
import polars as pl
import pytest

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import publish_policy_version, published_version
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import group_of, land
from tests.support.servers import REPO, GatewayProcess, wait_landed, wait_until
from tests.support.upstreams import SimProcess, proxy_env

KEY, TENANT = "policy-test-key", "tenant-policy"


def test_versions_only_go_up_and_the_cli_shows_them(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    assert published_version(lake) is None
    publish_policy_version(lake, 3, by="trainer-a")
    with pytest.raises(ValueError, match="policy_version: 3 is not newer than the published 3"):
        publish_policy_version(lake, 3)
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "policy"]
    done = subprocess.run(
        [*command, "publish", "5", "--lake", lake.uri, "--note", "after step 100"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    refused = subprocess.run(
        [*command, "publish", "4", "--lake", lake.uri], cwd=REPO, capture_output=True, text=True
    )
    assert refused.returncode == 1
    assert refused.stderr.strip() == (
        "claw: error: policy_version: 4 is not newer than the published 5"
    )
    shown = subprocess.run(
        [*command, "show", "--lake", lake.uri], cwd=REPO, capture_output=True, text=True
    )
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("v3 ") and lines[0].endswith("by trainer-a")
    assert lines[1].startswith("v5 ") and lines[1].endswith(": after step 100")
    assert published_version(lake) == 5


def test_staleness_counts_from_the_published_version(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    land(lake, [*group_of("old", [1], [1.0, 0.0], version=1), *group_of("new", [2], [1.0], 2)])
    build_silver(lake)
    spec = CurationSpec(name="fresh", reward_status=["final", "missing"], max_policy_staleness=1)
    assert build_partition(lake, spec, 1).steps.height > 0  # newest in silver: 2
    publish_policy_version(lake, 3)
    assert build_partition(lake, spec, 1).steps.height == 0  # 3 - 1 > 1: too stale now
    assert build_partition(lake, spec, 2).steps.height > 0


@pytest.fixture
def stack(tmp_path):
    with SimProcess(tmp_path) as sim:
        lake = tmp_path / "lake"
        with GatewayProcess(lake, **proxy_env(sim.url, KEY, TENANT)) as gateway:
            yield gateway


def test_the_gateway_stamps_the_published_version_unless_the_agent_names_one(stack):
    lake = Lake(str(stack.lake))
    publish_policy_version(lake, 7, by="trainer")

    def ready_version():
        return httpx.get(stack.url + "/readyz", timeout=5).json()["policy_version"]

    wait_until(lambda: ready_version() == 7, 20, interval=0.2, what="the gateway to see v7")
    auth = {"Authorization": f"Bearer {KEY}"}
    steps = [
        {"trajectory_uid": "own", "step_index": 0, "prompt_ids": [1], "response_ids": [2]},
        {"trajectory_uid": "named", "step_index": 0, "prompt_ids": [1], "response_ids": [2]}
        | {"policy_version": 2},
    ]
    answer = httpx.post(stack.url + "/v1/steps", json={"steps": steps}, headers=auth, timeout=10)
    assert answer.status_code == 200, answer.text
    client = openai.OpenAI(base_url=stack.url + "/t/chat-1/g/grp/v1", api_key=KEY)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    headed = openai.OpenAI(
        base_url=stack.url + "/t/chat-2/g/grp/v1",
        api_key=KEY,
        default_headers={"X-Claw-Policy-Version": "6"},
    )
    headed.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    ids = answer.json()["event_ids"]
    rows = wait_landed(stack.lake, ids)
    by_trajectory = dict(zip(rows["trajectory_uid"], rows["policy_version"], strict=True))
    assert by_trajectory == {"own": 7, "named": 2}
    stamped = rows.filter(pl.col("trajectory_uid") == "own")["payload"][0]
    assert '"policy_version_via":"published"' in stamped

    def proxied():
        frame = pl.read_delta(str(stack.lake / "bronze" / "events"))
        frame = frame.filter(pl.col("trajectory_uid").is_in(["chat-1", "chat-2"]))
        return frame if frame.height == 2 else None

    calls = wait_until(proxied, 20, what="the proxied steps")
    assert dict(zip(calls["trajectory_uid"], calls["policy_version"], strict=True)) == {
        "chat-1": 7,
        "chat-2": 6,
    }


def test_a_proxied_step_carries_the_version_in_force_when_it_was_sent(tmp_path):
    """A version published while a call (plain, streamed, scoped or not) is upstream does not
    reach that call's steps: they carry the version of their dispatch; later calls the new."""
    lake = Lake(str(tmp_path / "lake"))
    publish_policy_version(lake, 7)
    with (
        SimProcess(tmp_path, latency_ms=6000) as sim,
        GatewayProcess(tmp_path / "lake", **proxy_env(sim.url, KEY, TENANT)) as gateway,
    ):

        def ready_version():
            return httpx.get(gateway.url + "/readyz", timeout=5).json()["policy_version"]

        wait_until(lambda: ready_version() == 7, 20, interval=0.2, what="the gateway to see v7")

        def call(trajectory: str, stream: bool) -> None:
            client = openai.OpenAI(base_url=f"{gateway.url}/t/{trajectory}/g/grp/v1", api_key=KEY)
            messages = [{"role": "user", "content": "hi"}]
            answer = client.chat.completions.create(model="m", messages=messages, stream=stream)
            if stream:  # read to its end: the call stays in flight for the sim's latency
                assert any(chunk.choices for chunk in list(answer))

        in_flight = [
            threading.Thread(target=call, args=(name, stream))
            for name, stream in (("sent-plain", False), ("sent-stream", True))
        ]
        for thread in in_flight:
            thread.start()
        time.sleep(0.5)  # both are upstream now
        publish_policy_version(lake, 8)
        wait_until(lambda: ready_version() == 8, 20, interval=0.1, what="the gateway to see v8")
        assert all(thread.is_alive() for thread in in_flight)  # the version moved mid-call
        after = threading.Thread(target=call, args=("after", False))
        after.start()
        for thread in [*in_flight, after]:
            thread.join(30)

        def proxied():
            frame = pl.read_delta(str(tmp_path / "lake" / "bronze" / "events"))
            frame = frame.filter(pl.col("kind") != "policy_version")
            return frame if frame.height >= 3 else None

        rows = wait_until(proxied, 20, interval=0.2, what="three proxied steps in bronze")
    by_trajectory = dict(zip(rows["trajectory_uid"], rows["policy_version"], strict=True))
    assert by_trajectory == {"sent-plain": 7, "sent-stream": 7, "after": 8}
