"""The proxy in front of a misbehaving upstream: timeouts are 504, 5xx are 502 (recorded as
events), 4xx pass through (in OpenAI's envelope, whatever shape the server used), and an
upstream without token ids is tokenized locally (`CLAW_TOKENIZER=bundled` here) and checked
against its counts."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import polars as pl
import pytest

from claw_pipelines.tokenization import IM_END, encode, encode_chat
from tests.support.servers import GatewayProcess, bronze, wait_landed, wait_until
from tests.support.upstreams import FOREIGN_ERRORS, ScriptedUpstream, openai_answer, proxy_env

KEY = "failures-test-key"
MESSAGES = [{"role": "user", "content": "Say hello."}]
REPLY = openai_answer()["choices"][0]["message"]["content"]
# what the scripted upstream reports in `usage`: the bundled tokenizer's counts of the call
COUNTS = (len(encode_chat(MESSAGES)), len(encode(REPLY + IM_END)))


@pytest.fixture(scope="module")
def upstream():
    # its start-up test call fails: the gateway learns what it returns from real calls
    with ScriptedUpstream(usage=COUNTS, probe_status=503) as server:
        yield server


@pytest.fixture(scope="module")
def gw(upstream, tmp_path_factory):
    lake = tmp_path_factory.mktemp("failures") / "lake"
    env = proxy_env(
        upstream.url, KEY, "tenant-f", CLAW_UPSTREAM_TIMEOUT_S="0.5", CLAW_TOKENIZER="bundled"
    )
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


@pytest.mark.parametrize("model", sorted(FOREIGN_ERRORS))
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_errors_in_any_shape_reach_the_client_in_openais_envelope(gw, model, stream):
    status, _, _ = FOREIGN_ERRORS[model]
    refused = call(gw, model, stream=stream)
    assert refused.status_code == status
    assert refused.headers["content-type"].startswith("application/json")
    error = refused.json()["error"]
    assert error["code"] == "upstream_error" and error["message"].startswith(
        f"upstream answered {status}: "
    )
    expected = {
        "detail": "Server is pinned to 'm'; requested 'detail'.",
        "detail-list": "max_tokens: Input should be a valid integer",
        "flat": "prompt is too long",
        "text": "Not Found",
        "html": "403 Forbidden",
    }[model]
    assert error["message"].endswith(expected)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=model, messages=MESSAGES, stream=stream)
    assert raised.value.status_code == status and expected in str(raised.value)


def test_without_upstream_ids_tokens_are_computed_locally(gw, upstream):
    answer = call(gw, "plain")
    assert answer.status_code == 200
    assert answer.json() == openai_answer(usage=COUNTS)  # nothing added, nothing removed
    event_id = answer.request.headers["Idempotency-Key"]
    row = wait_landed(gw.lake, [event_id]).row(0, named=True)
    assert row["token_source"] == "local"  # computed here, the server's counts agree
    assert row["prompt_ids"] == encode_chat(MESSAGES)
    assert row["response_ids"] == encode(REPLY + IM_END)
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
