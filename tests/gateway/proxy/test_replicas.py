"""Sticky routing across inference replicas: a gateway in front of two real `claw sim-llm`
processes; each trajectory's calls stay on one replica while it is healthy, new ones balance,
and when one replica is killed mid-run its trajectories move to the other, the move recorded on
the step, no call lost and every trajectory whole."""

from __future__ import annotations

import json
import threading
import uuid

import httpx
import openai
import polars as pl

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import build_silver
from tests.support.servers import GatewayProcess, bronze, wait_until
from tests.support.upstreams import SimProcess, proxy_env

KEY = "replica-test-key"
TENANT = "tenant-replicas"
MODEL = "claw-sim-llm"
AGENTS = 6
TURNS = 6


def conversation(client: openai.OpenAI, agent: int, turns: int, after_turn=None) -> list[str]:
    """One agent's multi-turn chat (the whole history resent each turn); its step keys."""
    messages = [{"role": "user", "content": f"What is {agent} + 7?"}]
    keys = []
    for turn in range(turns):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages)
        keys.append(raw.headers["x-claw-step-keys"])
        reply = raw.parse().choices[0].message.content
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"And {turn} more?"},
        ]
        if after_turn is not None:
            after_turn(agent, turn)
    return keys


def steps(lake, count: int) -> pl.DataFrame:
    def landed():
        frame = bronze(lake)
        if frame.is_empty() or "kind" not in frame.columns:
            return None
        found = frame.filter(pl.col("kind") == "chat_completion")
        return found if found.height >= count else None

    found = wait_until(landed, 30, interval=0.1, what=f"{count} steps")
    replica = found["payload"].map_elements(
        lambda p: json.dumps(json.loads(p)["metadata"].get("replica")), return_dtype=pl.String
    )
    return found.with_columns(replica=replica)


def test_trajectories_stick_to_a_replica_and_move_when_it_dies(tmp_path):
    with SimProcess(tmp_path, latency_ms=10) as one, SimProcess(tmp_path, latency_ms=10) as two:
        env = proxy_env(f"{one.url},{two.url}", KEY, TENANT)
        with GatewayProcess(tmp_path / "lake", **env) as gw:
            ready = httpx.get(gw.url + "/readyz").json()
            assert [r["url"] for r in ready["replicas"]] == [one.url, two.url]
            assert {r["state"] for r in ready["replicas"]} == {"up"}
            killed = threading.Event()
            lock = threading.Lock()

            def kill_midway(agent: int, turn: int) -> None:
                with lock:
                    if agent == 0 and turn == TURNS // 2 - 1 and not killed.is_set():
                        one.kill()  # mid-run: other agents are between turns
                        killed.set()

            clients = [
                openai.OpenAI(
                    base_url=f"{gw.url}/t/traj-{i}-{uuid.uuid4().hex[:6]}/g/g-{i}/v1",
                    api_key=KEY,
                    max_retries=0,
                )
                for i in range(AGENTS)
            ]
            errors: list[BaseException] = []

            def run(i: int) -> None:
                try:
                    conversation(clients[i], i, TURNS, kill_midway)
                except BaseException as exc:
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(AGENTS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            assert not errors, errors  # no call failed: the dead replica's calls moved
            assert killed.is_set()
            # one more turn each: under load the trajectories on the killed replica may all
            # have ended before the kill, and only a call finds a replica dead (no probes)
            for i, client in enumerate(clients):
                conversation(client, i, 1)
            states = {r["url"]: r for r in httpx.get(gw.url + "/readyz").json()["replicas"]}
            assert states[one.url]["state"] in ("down", "retrying")
            assert states[two.url]["state"] == "up"
            assert states[one.url]["last_error"]

            found = steps(gw.lake, AGENTS * (TURNS + 1))
    assert found.height == AGENTS * (TURNS + 1)  # every call recorded once
    rows = found.with_columns(
        url=pl.col("replica").str.json_path_match("$.url"),
        moved_from=pl.col("replica").str.json_path_match("$.moved_from"),
    ).sort("trajectory_uid", "step_index")
    assert set(rows["url"]) <= {one.url, two.url}
    on_both = 0
    for (_trajectory,), calls in rows.group_by("trajectory_uid"):
        urls = calls["url"].to_list()
        assert calls["step_index"].to_list() == list(range(TURNS + 1))
        # sticky: a trajectory changes replica at most once (off the killed one), and the
        # step where it moved says so
        changes = [i for i in range(1, TURNS + 1) if urls[i] != urls[i - 1]]
        assert len(changes) <= 1
        if changes:
            on_both += 1
            i = changes[0]
            assert urls[i - 1] == one.url and urls[i] == two.url
            assert calls["moved_from"][i] == one.url
    assert on_both >= 1  # some trajectories lived on the killed replica and moved
    # new trajectories balanced by load: both replicas served some before the kill
    assert rows.filter(pl.col("step_index") == 0)["url"].n_unique() == 2
    build_silver(Lake(str(tmp_path / "lake")))
    trajectories = pl.read_delta(str(tmp_path / "lake" / "silver" / "trajectories"))
    assert sorted(trajectories["num_steps"].to_list()) == [TURNS + 1] * AGENTS
