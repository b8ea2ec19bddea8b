"""Bad input gets a clear error naming the field, in the OpenAI envelope, and lands nothing."""

from __future__ import annotations

import subprocess
import sys

import httpx
import polars as pl
import pytest

from tests.support.ingest import post, step
from tests.support.servers import OTHER_KEY, REPO, TEST_KEY, GatewayProcess, bronze, wait_landed


def assert_error(response, status, param=None, words=()):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
        assert error["message"].startswith(param), error
    for word in words:
        assert word in error["message"], error
    return error


STEP_CASES = [
    ({"prompt_ids": [1.5]}, "steps[0].prompt_ids[0]", "integer"),
    ({"prompt_ids": [1, 2**31]}, "steps[0].prompt_ids[1]", "2147483647"),
    ({"response_ids": [-1]}, "steps[0].response_ids[0]", "greater than or equal to 0"),
    ({"prompt_ids": ["7"]}, "steps[0].prompt_ids[0]", "integer"),
    ({"prompt_ids": [True]}, "steps[0].prompt_ids[0]", "integer"),
    ({"prompt_ids": []}, "steps[0].prompt_ids", "at least 1"),
    ({"response_mask": [1, 1]}, "steps[0].response_mask", "match"),
    ({"response_mask": [1, 2, 0]}, "steps[0].response_mask[1]", "less than or equal to 1"),
    ({"rollout_log_probs": [-0.1]}, "steps[0].rollout_log_probs", "match"),
    ({"reward": 1e999}, "steps[0].reward", "finite"),
    ({"rollout_log_probs": [-1e999, 0.0, 0.0]}, "steps[0].rollout_log_probs[0]", "finite"),
    # finite, but past what the float32 column holds
    ({"rollout_log_probs": [0.0, -1e300, 0.0]}, "steps[0].rollout_log_probs[1]", "greater than"),
    ({"step_index": -1}, "steps[0].step_index", "greater than or equal to 0"),
    ({"trajectory_uid": "has space"}, "steps[0].trajectory_uid", "pattern"),
    ({"trajectory_uid": "x" * 300}, "steps[0].trajectory_uid", "at most 256"),
    ({"colour": "red"}, "steps[0].colour", "Extra inputs"),
    ({"tenant": "someone-else"}, "steps[0].tenant", "Extra inputs"),
    (
        {
            "metadata": {
                "a": {
                    "b": {
                        "c": {
                            "d": {
                                "e": {
                                    "f": {
                                        "g": {
                                            "h": {
                                                "i": {
                                                    "j": {
                                                        "k": {
                                                            "l": {
                                                                "m": {"n": {"o": {"p": {"q": 1}}}}
                                                            }
                                                        }
                                                    }
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        },
        "steps[0].metadata",
        "nested",
    ),
    ({"metadata": {"blob": "x" * 70_000}}, "steps[0].metadata", "bytes of JSON"),
]


@pytest.mark.parametrize(("change", "param", "words"), STEP_CASES)
def test_invalid_step_field_is_named(gateway, change, param, words):
    response = post(gateway, "/v1/steps", {"steps": [step(**change)]})
    assert_error(response, 422, param, [words])


def test_missing_field_and_empty_batch_are_named(gateway):
    body = step()
    del body["trajectory_uid"]
    assert_error(
        post(gateway, "/v1/steps", {"steps": [body]}), 422, "steps[0].trajectory_uid", ["required"]
    )
    assert_error(post(gateway, "/v1/steps", {"steps": []}), 422, "steps", ["at least 1"])
    assert_error(post(gateway, "/v1/steps", {}), 422, "steps", ["required"])


FEEDBACK = {"target": {"step_key": "t:0"}, "kind": "reward", "value": 1.0, "source": "rule"}


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"value": "high"}, "value", "number"),
        ({"value": True}, "value", "number"),
        ({"kind": "label", "value": 3}, "value", "string"),
        ({"kind": "vibes"}, "kind", "reward"),
        ({"target": {"step_key": "no-index"}}, "target", "pattern"),
        ({"target": {}}, "target", "required"),
        ({"source": ""}, "source", "at least 1"),
    ],
)
def test_invalid_feedback_field_is_named(gateway, change, param, words):
    response = post(gateway, "/v1/feedback", {**FEEDBACK, **change})
    error = assert_error(response, 422)
    assert error["param"].startswith(param) and words in error["message"], error


def test_path_and_header_fields_are_named(gateway):
    bad_path = httpx.post(gateway.url + "/v1/trajectories/bad%20uid/complete", timeout=5)
    assert_error(bad_path, 422, "trajectory_uid", ["pattern"])
    bad_key = post(gateway, "/v1/events", {"type": "x"}, **{"Idempotency-Key": "no spaces"})
    assert_error(bad_key, 422, "Idempotency-Key")
    bad_completion = post(gateway, "/v1/trajectories/t-1/complete", {"status": "exploded"})
    assert_error(bad_completion, 422, "status")


def test_malformed_json_and_wrong_content_type(gateway):
    raw = httpx.post(
        gateway.url + "/v1/steps",
        content=b'{"steps": [',
        timeout=5,
        headers={"content-type": "application/json"},
    )
    assert_error(raw, 400, words=["not valid JSON"])
    form = httpx.post(gateway.url + "/v1/steps", data={"steps": "1"}, timeout=5)
    assert_error(form, 415, "Content-Type")
    text = httpx.post(
        gateway.url + "/v1/events", content=b"{}", timeout=5, headers={"content-type": "text/plain"}
    )
    assert_error(text, 415, "Content-Type")


def test_batch_with_one_bad_step_is_rejected_whole(gateway):
    good = [step("whole-batch", i, event_id=f"whole-{i}") for i in range(3)]
    good[1]["response_mask"] = [1]
    assert_error(post(gateway, "/v1/steps", {"steps": good}), 422, "steps[1].response_mask")
    barrier = post(gateway, "/v1/steps", {"steps": [step("barrier", 0)]}).json()["event_ids"]
    wait_landed(gateway.lake, barrier)
    landed = bronze(gateway.lake).filter(pl.col("trajectory_uid") == "whole-batch")
    assert landed.height == 0


def test_server_survives_hostile_bodies(gateway):
    hostile = [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"steps": [' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"]}",
        b'{"steps": "\x00\xff"}',
        '{"steps": [{"trajectory_uid": "\ud800"}]}'.encode("utf-8", "surrogatepass"),
        b'{"steps": [{"prompt_ids": [' + b"9" * 5000 + b"]}]}",
        b'{"type": "' + b"\\u0000" * 10 + b'"}',
        b'{"steps": [' + b",".join([b"{}"] * 10_000) + b"]}",  # 10,000 elements
        b'{"steps": [{"trajectory_uid": "t", "step_index": 99999999999999999999999}]}',
    ]
    for body in hostile:
        response = httpx.post(
            gateway.url + "/v1/steps",
            content=body,
            timeout=10,
            headers={"content-type": "application/json"},
        )
        assert response.status_code in (400, 422), (body[:40], response.text[:200])
        assert "error" in response.json()
    assert httpx.get(gateway.url + "/healthz").status_code == 200


def test_auth_missing_and_wrong_keys_are_refused(secured_gateway):
    gw = secured_gateway
    body = {"type": "session_started"}
    assert_error(post(gw, "/v1/events", body), 401, words=["missing API key"])
    assert_error(
        post(gw, "/v1/events", body, Authorization="Bearer nope"), 401, words=["invalid API key"]
    )
    assert_error(post(gw, "/v1/events", body, **{"X-API-Key": "nope"}), 401)
    assert httpx.get(gw.url + "/healthz").status_code == 200


def test_tenant_comes_from_the_key_never_the_body(secured_gateway):
    gw = secured_gateway
    a = post(gw, "/v1/events", {"type": "ping"}, Authorization=f"Bearer {TEST_KEY}")
    b = post(gw, "/v1/events", {"type": "ping"}, **{"X-API-Key": OTHER_KEY})
    assert a.status_code == b.status_code == 200
    rows = wait_landed(gw.lake, a.json()["event_ids"] + b.json()["event_ids"])
    tenants = dict(zip(rows["event_id"], rows["tenant"], strict=True))
    assert tenants == {a.json()["event_ids"][0]: "tenant-a", b.json()["event_ids"][0]: "tenant-b"}
    spoof = post(
        gw, "/v1/steps", {"steps": [step(tenant="tenant-b")]}, Authorization=f"Bearer {TEST_KEY}"
    )
    assert_error(spoof, 422, "steps[0].tenant")


def test_body_limit_and_backlog_bound(tmp_path):
    limited = GatewayProcess(
        tmp_path / "lake",
        CLAW_MAX_BODY_BYTES="4096",
        CLAW_WAL_MAX_BACKLOG_BYTES="1",
        CLAW_FLUSH_INTERVAL_MS="60000",
    )
    with limited as gw:
        big = {"steps": [step(prompt_ids=list(range(3000)))]}
        assert_error(post(gw, "/v1/steps", big), 413, words=["4096"])

        def chunked():
            yield b'{"steps": [{"prompt_ids": ['
            for _ in range(3000):
                yield b"1,"
            yield b"1]}]}"

        streamed = httpx.post(
            gw.url + "/v1/steps",
            content=chunked(),
            timeout=10,
            headers={"content-type": "application/json"},
        )
        assert_error(streamed, 413)
        first = post(gw, "/v1/events", {"type": "a"})
        assert first.status_code == 200
        second = post(gw, "/v1/events", {"type": "b"})
        assert_error(second, 503, words=["backlog"])
        assert second.headers["retry-after"] == "2"
        assert httpx.get(gw.url + "/readyz").status_code == 503
        assert gw.stop() in (0, -15)  # uvicorn re-raises SIGTERM after its graceful exit
    rows = bronze(tmp_path / "lake")
    assert rows["event_id"].to_list() == first.json()["event_ids"]  # flushed at shutdown


def test_refuses_non_loopback_bind_without_keys(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "claw_pipelines.app.cli",
            "gateway",
            "--host",
            "0.0.0.0",
            "--lake",
            str(tmp_path / "lake"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "refusing to bind 0.0.0.0" in result.stderr


def test_invalid_setting_is_one_line_naming_the_variable(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", "gateway", "--lake", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "CLAW_FLUSH_INTERVAL_MS": "0"},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("claw: error: CLAW_FLUSH_INTERVAL_MS:")


def test_keys_created_by_the_cli_authenticate_their_tenant(tmp_path):
    keys_file = tmp_path / "keys"
    result = subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", "keys", "create", "--tenant", "team-x",
         "--file", str(keys_file)],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=True,
    )  # fmt: skip
    key = result.stdout.strip()
    assert key.startswith("claw-") and key not in keys_file.read_text()  # only the hash
    with GatewayProcess(tmp_path / "lake", CLAW_API_KEYS_FILE=str(keys_file)) as gw:
        ok = post(gw, "/v1/events", {"type": "ping"}, Authorization=f"Bearer {key}")
        assert ok.status_code == 200
        assert_error(post(gw, "/v1/events", {"type": "ping"}), 401)
        (row,) = wait_landed(gw.lake, ok.json()["event_ids"]).iter_rows(named=True)
        assert row["tenant"] == "team-x"
