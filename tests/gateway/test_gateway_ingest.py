"""Every ingestion route round-trips into bronze on a real gateway process."""

from __future__ import annotations

import datetime as dt
import json

import httpx
import polars as pl
import pytest

from tests.support.ingest import post, step
from tests.support.servers import bronze, wait_landed


def test_steps_land_in_bronze_with_typed_token_columns(gateway):
    steps = [
        step(step_index=0, metadata={"agent": "bash", "turn": 0}),
        step(step_index=1, reward=1.5, is_last=True, finish_reason="stop", model="m"),
    ]
    response = post(gateway, "/v1/steps", {"steps": steps})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["accepted"] == 2 and answer["duplicates"] == 0
    rows = wait_landed(gateway.lake, answer["event_ids"]).sort("step_index")

    assert rows["kind"].to_list() == ["step", "step"]
    assert rows["tenant"].to_list() == ["default", "default"]
    assert rows["token_source"].to_list() == ["client", "client"]
    assert rows["gateway_id"].unique().to_list() == ["gw-test"]
    assert rows["prompt_ids"].to_list() == [[101, 7, 8, 9]] * 2
    assert rows["response_ids"].to_list() == [[11, 12, 13]] * 2
    assert rows["response_mask"].to_list() == [[1, 1, 0]] * 2
    assert rows["rollout_log_probs"].to_list() == [[-0.5, -0.25, -1.5]] * 2
    assert rows["reward"].to_list() == [None, 1.5]
    assert rows["is_last"].to_list() == [False, True]
    assert rows["policy_version"].to_list() == [3, 3]
    assert rows["ingest_date"].to_list() == [dt.datetime.now(dt.UTC).date()] * 2
    assert rows.schema["prompt_ids"] == pl.List(pl.Int32)
    payload = json.loads(rows["payload"][0])
    assert payload["metadata"] == {"agent": "bash", "turn": 0}
    assert payload["event_id"] == rows["event_id"][0]
    assert "prompt_ids" not in payload  # lifted into the typed column of the same row


def test_feedback_events_and_completion_land(gateway):
    responses = [
        post(
            gateway,
            "/v1/feedback",
            {
                "target": {"step_key": "traj-1:1"},
                "kind": "reward",
                "value": 1,
                "source": "rule",
            },
        ),
        post(
            gateway,
            "/v1/feedback",
            {
                "target": {"trajectory_uid": "traj-1"},
                "kind": "label",
                "value": "helpful",
                "source": "human",
                "annotator": "ann-7",
                "created_at": "2026-11-29T10:00:00Z",
            },
        ),
        post(
            gateway,
            "/v1/events",
            {
                "type": "user_edit",
                "trajectory_uid": "traj-1",
                "payload": {"chars": 12},
            },
        ),
        post(gateway, "/v1/trajectories/traj-1/complete", {"reward": 0.5}),
        httpx.post(gateway.url + "/v1/trajectories/traj-2/complete", timeout=10),
    ]
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    ids = [r.json()["event_ids"][0] for r in responses]
    rows = wait_landed(gateway.lake, ids)
    by_id = {row["event_id"]: row for row in rows.iter_rows(named=True)}
    kinds = [by_id[i]["kind"] for i in ids]
    assert kinds == ["feedback", "feedback", "event", "trajectory_complete", "trajectory_complete"]
    reward_fact = json.loads(by_id[ids[0]]["payload"])
    assert reward_fact["value"] == 1.0 and reward_fact["target"] == {"step_key": "traj-1:1"}
    assert json.loads(by_id[ids[1]]["payload"])["annotator"] == "ann-7"
    assert json.loads(by_id[ids[2]]["payload"])["payload"] == {"chars": 12}
    completion = by_id[ids[3]]
    assert completion["trajectory_uid"] == "traj-1" and completion["reward"] == 0.5
    assert json.loads(by_id[ids[4]]["payload"])["status"] == "complete"


def test_claw_r1_submit_steps_keeps_unknown_fields(gateway):
    body = {"steps": [step("r1-traj", 0, tool_name="bash", env_state={"cwd": "/tmp"})]}
    response = post(gateway, "/submit_steps", body)
    assert response.status_code == 200, response.text
    (row,) = wait_landed(gateway.lake, response.json()["event_ids"]).iter_rows(named=True)
    payload = json.loads(row["payload"])
    assert payload["tool_name"] == "bash" and payload["env_state"] == {"cwd": "/tmp"}
    assert row["prompt_ids"] == [101, 7, 8, 9]


def test_retry_with_same_event_id_is_acknowledged_and_stored_once(gateway):
    body = {"steps": [step("idem-traj", 0, event_id="client-evt-1")]}
    first, second = post(gateway, "/v1/steps", body), post(gateway, "/v1/steps", body)
    assert first.status_code == second.status_code == 200
    assert second.json() == {"accepted": 1, "duplicates": 1, "event_ids": ["client-evt-1"]}
    header = post(
        gateway,
        "/v1/steps",
        {"steps": [step("idem-traj", 1), step("idem-traj", 2)]},
        **{"Idempotency-Key": "batch-77"},
    )
    again = post(
        gateway,
        "/v1/steps",
        {"steps": [step("idem-traj", 1), step("idem-traj", 2)]},
        **{"Idempotency-Key": "batch-77"},
    )
    assert header.json()["event_ids"] == ["batch-77:0", "batch-77:1"]
    assert again.json()["duplicates"] == 2
    wait_landed(gateway.lake, ["client-evt-1", "batch-77:0", "batch-77:1"])
    counts = bronze(gateway.lake).filter(pl.col("trajectory_uid") == "idem-traj")["event_id"]
    assert sorted(counts.to_list()) == ["batch-77:0", "batch-77:1", "client-evt-1"]


def test_health_readiness_and_metrics(gateway):
    assert httpx.get(gateway.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(gateway.url + "/readyz").json()
    assert ready["status"] == "ready" and ready["gateway_id"] == "gw-test"
    post(gateway, "/v1/events", {"type": "ping"})
    text = httpx.get(gateway.url + "/metrics").text
    for name in (
        'claw_gateway_requests_total{route="/v1/events",status="200"}',
        'claw_gateway_records_total{kind="event"}',
        "claw_gateway_wal_backlog_bytes",
        "claw_gateway_wal_sync_seconds_bucket",
        "claw_gateway_wal_syncs_total",
        "claw_gateway_wal_group_records_bucket",
        "claw_flusher_up 1.0",
        "claw_flusher_last_flush_seconds",
        "claw_flusher_last_batch_records",
    ):
        assert name in text, name


def test_openapi_documents_every_route_and_its_errors(gateway):
    schema = httpx.get(gateway.url + "/openapi.json").json()
    paths = schema["paths"]
    for path in (
        "/v1/steps",
        "/v1/feedback",
        "/v1/events",
        "/v1/trajectories/{trajectory_uid}/complete",
        "/submit_steps",
    ):
        post_op = paths[path]["post"]
        assert {"200", "400", "401", "413", "415", "422", "503"} <= set(post_op["responses"])
        assert post_op["description"] or post_op["summary"]
    body = paths["/v1/steps"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/StepBatch"}
    assert "Step" in schema["components"]["schemas"]
    assert {"/healthz", "/readyz", "/metrics"} <= set(paths)


@pytest.mark.parametrize("path", ["/v1/steps", "/v1/feedback", "/v1/events", "/submit_steps"])
def test_unknown_route_and_method_use_the_envelope(gateway, path):
    response = httpx.get(gateway.url + path)
    assert response.status_code == 405
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    missing = httpx.post(gateway.url + "/v1/nothing-here", json={})
    assert missing.status_code == 404 and "no route" in missing.json()["error"]["message"]
