"""Anthropic's Messages API through the gateway, driven with the official `anthropic` client's
`messages.create` in front of a real `claw sim-llm`: answers are the model's, bronze holds one
step per model call with its exact ids, a scoped tool conversation's turns nest (token-in),
and errors (the gateway's and the upstream's) are in Anthropic's shape."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import polars as pl
import pytest

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.tokenization import encode_chat
from tests.support.ingest import nests, rows, trajectory_rows
from tests.support.servers import GatewayProcess, bronze
from tests.support.upstreams import SimProcess, proxy_env

KEY = "messages-test-key"
TENANT = "tenant-messages"
MODEL = "claw-sim-llm"
CALCULATOR = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "input_schema": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with SimProcess(tmp_path_factory.mktemp("sim"), latency_ms=20) as server:
        yield server


@pytest.fixture(scope="module")
def gw(sim, tmp_path_factory):
    lake = tmp_path_factory.mktemp("messages") / "lake"
    with GatewayProcess(lake, **proxy_env(sim.url, KEY, TENANT, CLAW_TOKEN_IN="auto")) as server:
        yield server


def agent(gw, base: str = "", api_key: str = KEY) -> anthropic.Anthropic:
    """The SDK as Claude-Code-style agents use it: `x-api-key` and `anthropic-version`."""
    return anthropic.Anthropic(base_url=gw.url + base, api_key=api_key, max_retries=0)


def key() -> str:
    return f"k-{uuid.uuid4().hex}"


def sampled(sim, messages) -> dict:
    body = {"model": MODEL, "messages": messages, "return_token_ids": True, "logprobs": True}
    answer = httpx.post(sim.url + "/chat/completions", json=body | {"max_tokens": 256}, timeout=30)
    answer.raise_for_status()
    return answer.json()


def test_a_message_is_the_models_answer_and_bronze_holds_its_exact_ids(gw, sim):
    event_id = key()
    body = {
        "model": MODEL,
        "max_tokens": 256,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "What is 12 + 7?"}],
    }
    answer = agent(gw).messages.create(**body, extra_headers={"Idempotency-Key": event_id})
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 + 7?"},
    ]
    direct = sampled(sim, chat)
    assert answer.id.startswith("msg_") and answer.type == "message"
    assert answer.content[0].text == direct["choices"][0]["message"]["content"]
    assert answer.stop_reason == "end_turn"
    assert answer.usage.input_tokens == direct["usage"]["prompt_tokens"]
    assert answer.usage.output_tokens == direct["usage"]["completion_tokens"]

    (row,) = rows(gw, [event_id])
    assert row["kind"] == "chat_completion" and row["token_source"] == "upstream"
    assert row["tenant"] == TENANT  # the key came as x-api-key
    assert row["prompt_ids"] == direct["prompt_token_ids"] == encode_chat(chat)
    assert row["response_ids"] == direct["choices"][0]["token_ids"]
    logprobs = [t["logprob"] for t in direct["choices"][0]["logprobs"]["content"]]
    assert row["rollout_log_probs"] == pytest.approx(logprobs, abs=1e-5)
    payload = row["payload"]
    assert payload["request"] == body
    assert payload["response"]["id"] == answer.id
    assert payload["metadata"]["protocol"] == "messages"
    assert payload["metadata"]["anthropic_version"]  # the SDK sends anthropic-version


def test_a_streamed_message_sends_anthropics_events_and_records_the_step(gw, sim):
    event_id = key()
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    with agent(gw).messages.stream(
        model=MODEL,
        max_tokens=256,
        messages=question,
        extra_headers={"Idempotency-Key": event_id},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    direct = sampled(sim, question)
    assert final.content[0].text == direct["choices"][0]["message"]["content"]
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == direct["usage"]["completion_tokens"]
    (row,) = rows(gw, [event_id])
    assert row["response_ids"] == direct["choices"][0]["token_ids"]
    assert row["payload"]["response"]["id"] == final.id
    assert row["payload"]["metadata"]["stream"] is True


def test_a_tool_conversation_is_one_trajectory_whose_turns_nest(gw):
    for attempt in range(20):  # tool_choice auto (token-in cannot force a call): until one
        trajectory = f"msg-tools-{uuid.uuid4().hex[:8]}"
        client = agent(gw, f"/t/{trajectory}/g/group-1")
        messages = [{"role": "user", "content": f"What is 12 + {attempt}?"}]
        first = client.messages.create(
            model=MODEL, max_tokens=256, messages=messages, tools=[CALCULATOR]
        )
        if first.stop_reason == "tool_use":
            break
    (use,) = first.content
    assert use.type == "tool_use" and use.input == {"expression": f"12 + {attempt}"}
    messages += [
        {"role": "assistant", "content": [block.model_dump() for block in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "19"}],
        },
    ]
    with client.messages.stream(
        model=MODEL, max_tokens=256, messages=messages, tools=[CALCULATOR]
    ) as stream:
        second = stream.get_final_message()
    assert "19" in second.content[0].text
    messages += [
        {"role": "assistant", "content": second.content[0].text},
        {"role": "user", "content": "And what is 2 + 2?"},
    ]
    client.messages.create(model=MODEL, max_tokens=256, messages=messages, tools=[CALCULATOR])

    steps = trajectory_rows(gw, trajectory, 3)
    assert [s["step_index"] for s in steps] == [0, 1, 2]
    modes = [s["payload"]["metadata"]["token_in"]["mode"] for s in steps]
    assert modes == ["start", "extend", "extend"]
    assert nests(steps[0], steps[1]) and nests(steps[1], steps[2])
    assert all(s["token_source"] == "upstream" for s in steps)
    build_silver(Lake(str(gw.lake)))
    silver = pl.read_delta(str(gw.lake / "silver" / "steps")).filter(
        pl.col("trajectory_uid") == trajectory
    )
    assert sorted(silver["step_index"].to_list()) == [0, 1, 2]


def test_errors_are_in_anthropics_shape_name_the_field_and_land_nothing(gw):
    before = bronze(gw.lake).height
    cases = [
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {
                "max_tokens": 16,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                    }
                ],
            },
            "messages[0].content[0].type",
        ),
        ({"max_tokens": 16, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ]
    for fields, param in cases:
        with pytest.raises(anthropic.BadRequestError) as refused:
            agent(gw).messages.create(model=MODEL, **fields)
        body = refused.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith(param)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        agent(gw, api_key="wrong").messages.create(
            model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.body["error"]["type"] == "authentication_error"
    answer = httpx.post(
        gw.url + "/v1/messages",
        content=b"{not json",
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    assert answer.status_code == 400 and answer.json()["type"] == "error"
    assert bronze(gw.lake).height == before
    assert json.loads(httpx.get(gw.url + "/readyz").text)["status"] == "ready"
