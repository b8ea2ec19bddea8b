"""deploy/compose.yaml starts, without a container runtime: every service's command runs as a
local process with its environment, volumes and ports mapped (tests/support/compose_local.py), in
dependency order. Then chat calls go through each gateway replica with the official OpenAI
client and a key from the mounted keys file; one replica is killed with SIGKILL mid-traffic
and restarted on its WAL volume; every acknowledged step reaches silver and a gold dataset
(the continuous materializer), whose increments the Dagster UI shows (the shared Dagster
storage volume); the Dagster webserver (and its read-only twin) answers with its daemon
healthy, and the dashboard loads. Every process reaches the lake with its own S3 identity, laid
out at the first start by the one-shot `lake-secrets` (docs/DESIGN.md §17)."""

from __future__ import annotations

import time
import uuid

import httpx
import openai
import polars as pl
import pytest

from claw_pipelines.app.up import daemons_healthy
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import SILVER_STEPS, gold_dataset_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import save_spec
from gateway.auth import create_key
from tests.support.compose_local import LocalCompose
from tests.support.servers import wait_until

SPEC = CurationSpec(name="compose", reward_status=["pending", "missing", "final"])
CALLS_PER_REPLICA = 6  # before the kill, and again after the restart
MATERIALIZED = """
{ assetOrError(assetKey: {path: ["silver", "steps"]}) {
    ... on Asset { assetMaterializations(limit: 50) {
      metadataEntries { label ... on TextMetadataEntry { text } } } } } }
"""


def chat(gateway_url: str, key: str, acked: list[str], calls: int) -> None:
    """`calls` turns of one trajectory through a gateway; each acknowledged step's event id
    (its Idempotency-Key) is recorded."""
    trajectory = f"traj-{uuid.uuid4().hex[:10]}"
    base = f"{gateway_url}/t/{trajectory}/g/group-{trajectory[-2:]}/v1"
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    with openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30) as agent:
        for _ in range(calls):
            idempotency = f"compose-{uuid.uuid4().hex}"
            answer = agent.chat.completions.create(
                model="claw-sim-llm",
                messages=messages,
                extra_headers={"Idempotency-Key": idempotency},
            )
            acked.append(idempotency)  # a step's event id: the key (`key:i` for n > 1)
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": "And times 2?"},
            ]


def reported_by_the_materializer(dagster_url: str) -> bool:
    """The Dagster UI lists a silver/steps materialization reported by `--follow`."""
    try:
        answer = httpx.post(dagster_url + "/graphql", json={"query": MATERIALIZED}, timeout=10)
        events = answer.json()["data"]["assetOrError"]["assetMaterializations"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return False
    return any(
        entry.get("text") == "claw materialize --follow"
        for event in events
        for entry in event["metadataEntries"]
    )


@pytest.mark.soak
@pytest.mark.timeout(420)
def test_the_compose_file_starts_as_local_processes_and_carries_traffic(tmp_path):
    key, line = create_key("compose-tenant")
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(line + "\n")
    started = time.monotonic()
    with LocalCompose(
        tmp_path / "compose", binds={"./api-keys": keys_file}, host_env={"CLAW_GATEWAY_KEY": key}
    ) as stack:
        order = stack.up(timeout=240)
        assert order.index("lake-secrets") < order.index("s3") < order.index("bucket")
        assert order.index("bucket") < order.index("gateway-1") < order.index("dashboard")
        assert order.index("dagster-code") < order.index("dagster-webserver")
        gateways = [n for n, s in stack.services.items() if s.argv[1:2] == ["gateway"]]
        assert len(gateways) == 3
        for name in gateways:
            wait_until(lambda n=name: stack.answers(n, "/readyz"), 120, what=f"{name} ready")
        env = stack.services["materializer"].env
        assert "AWS_SECRET_ACCESS_KEY" not in env["CLAW_STORAGE_OPTIONS"]  # in its volume
        lake = Lake(env["CLAW_LAKE_URI"], stack.storage_options("materializer"))
        save_spec(lake, SPEC)
        up_s = time.monotonic() - started

        acked: list[str] = []
        for name in gateways:
            chat(stack.services[name].url(), key, acked, CALLS_PER_REPLICA)
        victim = gateways[1]
        stack.kill(victim)  # SIGKILL; compose's `restart: unless-stopped` starts it again
        chat(stack.services[gateways[0]].url(), key, acked, CALLS_PER_REPLICA)
        stack.start(victim)
        wait_until(lambda: stack.answers(victim, "/readyz"), 120, what=f"{victim} back")
        for name in gateways:
            chat(stack.services[name].url(), key, acked, CALLS_PER_REPLICA)
        assert len(set(acked)) == len(acked) == 7 * CALLS_PER_REPLICA

        def in_silver() -> pl.DataFrame | None:
            try:
                steps = lake.read(SILVER_STEPS, columns=["event_id", "step_key"])
            except Exception:  # not created yet
                return None
            got = steps.filter(pl.col("event_id").is_in(acked))
            return got if got.height == len(acked) else None

        steps = wait_until(in_silver, 120, interval=1, what="every acknowledged step in silver")
        assert steps["event_id"].n_unique() == len(acked)

        def in_gold() -> bool:
            try:
                gold = lake.read(gold_dataset_table(SPEC.name), columns=["step_key"])
            except Exception:  # not built yet
                return False
            return set(steps["step_key"]) <= set(gold["step_key"])

        wait_until(in_gold, 120, interval=1, what="every acknowledged step in gold")

        dagster = stack.services["dagster-webserver"].url()
        assert stack.answers("dagster-webserver", "/server_info")
        assert stack.answers("dagster-webserver-read-only", "/server_info")
        wait_until(lambda: daemons_healthy(dagster), 60, interval=1, what="Dagster daemons")
        wait_until(
            lambda: reported_by_the_materializer(dagster),
            60,
            interval=1,
            what="the materializer's increments in the Dagster UI",
        )
        wait_until(lambda: stack.answers("dashboard", "/_stcore/health"), 60, what="dashboard")
        assert stack.answers("dashboard", "/")
        jobs = {  # one-shots (the secrets, the bucket, Dagster's storage): others wait for them
            needed
            for service in stack.services.values()
            for needed, condition in service.depends.items()
            if condition == "service_completed_successfully"
        }
        assert jobs == {"lake-secrets", "bucket", "dagster-storage"}, jobs
        for name, service in stack.services.items():
            if name not in jobs:
                assert service.running, f"{name} exited: {stack.tail(name)}"
    print(f"compose up in {up_s:.0f} s; whole test {time.monotonic() - started:.0f} s")
