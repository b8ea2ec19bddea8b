"""The proxy in front of a misbehaving upstream: timeouts are 504, 5xx are 502 (recorded as
events), 4xx pass through unchanged, and an upstream without token ids is tokenized locally."""

from __future__ import annotations

import json
import uuid

import httpx
import polars as pl
import pytest

from claw_pipelines.tokenization import IM_END, encode, encode_chat
from tests.servers import GatewayProcess, bronze, wait_landed, wait_until
from tests.upstreams import ScriptedUpstream, openai_answer, proxy_env

KEY = "failures-test-key"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def upstream():
    with ScriptedUpstream() as server:
        yield server


@pytest.fixture(scope="module")
def gw(upstream, tmp_path_factory):
    lake = tmp_path_factory.mktemp("failures") / "lake"
    env = proxy_env(upstream.url, KEY, "tenant-f", CLAW_UPSTREAM_TIMEOUT_S="0.5")
    with GatewayProcess(lake, **env) as server:
        yield server


def call(gw, model: str, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    body = {"model": model, "messages": MESSAGES, **extra}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def upstream_errors(gw, count: int) -> list[dict]:
    def landed():
        events = bronze(gw.lake).filter(pl.col("kind") == "event")
        payloads = [json.loads(p) for p in events["payload"]]
        found = [p for p in payloads if p["type"] == "upstream_error"]
        return found if len(found) >= count else None

    return wait_until(landed, 20, interval=0.1, what="upstream_error events")


def test_timeout_is_504_and_5xx_is_502_recorded_as_events_not_steps(gw):
    slow = call(gw, "hang")
    assert slow.status_code == 504
    assert slow.json()["error"] == {
        "message": slow.json()["error"]["message"],
        "type": "upstream_error",
        "param": None,
        "code": "upstream_timeout",
    }
    broken = call(gw, "boom")
    assert broken.status_code == 502
    assert "the GPU caught fire" in broken.json()["error"]["message"]
    broken_stream = call(gw, "boom", stream=True)
    assert broken_stream.status_code == 502
    events = upstream_errors(gw, 3)
    codes = sorted(e["payload"]["code"] for e in events)
    assert codes == ["upstream_error", "upstream_error", "upstream_timeout"]
    assert {e["payload"]["upstream_status"] for e in events} == {None, 500}
    steps = bronze(gw.lake).filter(pl.col("kind") == "chat_completion")
    assert not steps.filter(pl.col("model").is_in(["hang", "boom"])).height
    assert httpx.get(gw.url + "/healthz").status_code == 200


def test_upstream_4xx_passes_through_unchanged(gw, upstream):
    refused = call(gw, "bad")
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {"message": "model 'bad' does not exist", "type": "invalid_request_error"}
    }
    limited = call(gw, "busy")
    assert limited.status_code == 429 and limited.headers["retry-after"] == "7"
    assert limited.json()["error"]["message"] == "slow down"


def test_without_upstream_ids_tokens_are_computed_locally(gw, upstream):
    answer = call(gw, "plain")
    assert answer.status_code == 200
    assert answer.json() == openai_answer()  # nothing added, nothing removed
    event_id = answer.request.headers["Idempotency-Key"]
    row = wait_landed(gw.lake, [event_id]).row(0, named=True)
    assert row["token_source"] == "local"
    assert row["prompt_ids"] == encode_chat(MESSAGES)
    assert row["response_ids"] == encode(
        openai_answer()["choices"][0]["message"]["content"] + IM_END
    )
    assert row["rollout_log_probs"] is None


def test_an_upstream_refusing_return_token_ids_is_retried_without_it(gw, upstream):
    answer = call(gw, "strict")
    assert answer.status_code == 200
    event_id = answer.request.headers["Idempotency-Key"]
    assert wait_landed(gw.lake, [event_id]).row(0, named=True)["token_source"] == "local"
    sent = [r for r in upstream.requests if r["body"]["model"] == "strict"]
    assert "return_token_ids" in sent[0]["body"] and "return_token_ids" not in sent[-1]["body"]


def test_the_callers_key_never_goes_upstream(gw, upstream):
    assert call(gw, "plain").status_code == 200
    for request in upstream.requests:
        names = {name.lower() for name in request["headers"]}
        assert "authorization" not in names and "x-api-key" not in names
