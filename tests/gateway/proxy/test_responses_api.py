"""OpenAI's Responses API through the gateway, driven with the official `openai` client's
`responses.create` in front of a real `claw sim-llm`: answers are the model's, bronze holds one
step per model call with its exact ids, a `previous_response_id` chain is one trajectory whose
turns nest (token-in), and the chain survives a gateway restart."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import polars as pl
import pytest

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.tokenization import encode_chat
from tests.support.ingest import nests, rows, trajectory_rows
from tests.support.servers import GatewayProcess, bronze
from tests.support.upstreams import SimProcess, proxy_env

KEY = "responses-test-key"
TENANT = "tenant-responses"
MODEL = "claw-sim-llm"
CALCULATOR = {
    "type": "function",
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}
CHAT_CALCULATOR = {
    "type": "function",
    "function": {k: v for k, v in CALCULATOR.items() if k != "type"},
}


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with SimProcess(tmp_path_factory.mktemp("sim"), latency_ms=20) as server:
        yield server


@pytest.fixture(scope="module")
def gw(sim, tmp_path_factory):
    lake = tmp_path_factory.mktemp("responses") / "lake"
    with GatewayProcess(lake, **proxy_env(sim.url, KEY, TENANT, CLAW_TOKEN_IN="auto")) as server:
        yield server


def agent(gw, base: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + base, api_key=KEY, max_retries=0)


def key() -> str:
    return f"k-{uuid.uuid4().hex}"


def sampled(sim, messages, tools=None) -> dict:
    """The sim's own chat answer with ids and log-probs: what the model samples for them."""
    body = {"model": MODEL, "messages": messages, "return_token_ids": True, "logprobs": True}
    if tools:
        body["tools"] = tools
    answer = httpx.post(sim.url + "/chat/completions", json=body, timeout=30)
    answer.raise_for_status()
    return answer.json()


def test_a_response_is_the_models_answer_and_bronze_holds_its_exact_ids(gw, sim):
    event_id = key()
    body = {"model": MODEL, "input": "What is 12 + 7?", "instructions": "Be brief."}
    answer = agent(gw).responses.create(**body, extra_headers={"Idempotency-Key": event_id})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": body["input"]},
    ]
    direct = sampled(sim, messages)
    assert answer.id.startswith("resp_") and answer.status == "completed"
    assert answer.output_text == direct["choices"][0]["message"]["content"]
    assert answer.usage.input_tokens == direct["usage"]["prompt_tokens"]
    assert answer.usage.output_tokens == direct["usage"]["completion_tokens"]
    assert answer.output[0].content[0].logprobs == []  # the gateway's ask, not the agent's

    (row,) = rows(gw, [event_id])
    assert row["kind"] == "chat_completion" and row["token_source"] == "upstream"
    assert row["prompt_ids"] == direct["prompt_token_ids"] == encode_chat(messages)
    assert row["response_ids"] == direct["choices"][0]["token_ids"]
    logprobs = [t["logprob"] for t in direct["choices"][0]["logprobs"]["content"]]
    assert row["rollout_log_probs"] == pytest.approx(logprobs, abs=1e-5)
    payload = row["payload"]
    assert payload["request"] == body  # the agent's own request, as sent
    assert payload["response"]["id"] == answer.id  # the answer it got
    assert payload["response"]["output"][0]["content"][0]["text"] == answer.output_text
    assert payload["metadata"]["protocol"] == "responses"
    assert payload["metadata"]["response_id"] == answer.id
    assert payload["metadata"]["scoped"] is False


def test_a_streamed_response_sends_the_semantic_events_and_records_the_step(gw, sim):
    event_id = key()
    stream = agent(gw).responses.create(
        model=MODEL,
        input="What is 2 + 2?",
        stream=True,
        include=["message.output_text.logprobs"],
        extra_headers={"Idempotency-Key": event_id},
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    completed = events[-1].response
    text = "".join(e.delta for e in deltas)
    assert text == completed.output_text == events[-4].text
    direct = sampled(sim, [{"role": "user", "content": "What is 2 + 2?"}])
    assert text == direct["choices"][0]["message"]["content"]
    streamed_logprobs = [lp.logprob for e in deltas for lp in e.logprobs]

    (row,) = rows(gw, [event_id])
    assert row["response_ids"] == direct["choices"][0]["token_ids"]
    assert row["rollout_log_probs"] == pytest.approx(streamed_logprobs, abs=1e-5)
    assert row["payload"]["response"]["id"] == completed.id
    assert row["payload"]["metadata"]["stream"] is True


def test_a_tool_round_trip_chained_by_previous_response_id_is_one_trajectory_that_nests(gw):
    for attempt in range(20):  # tool_choice auto (token-in cannot force a call): until one
        trajectory = f"resp-tools-{uuid.uuid4().hex[:8]}"
        client = agent(gw, f"/t/{trajectory}/g/group-1/v1")
        first = client.responses.create(
            model=MODEL, input=f"What is 12 + {attempt}?", tools=[CALCULATOR]
        )
        if first.output[0].type == "function_call":
            break
    (call,) = first.output
    assert call.type == "function_call" and call.name == "calculator"
    assert json.loads(call.arguments) == {"expression": f"12 + {attempt}"}
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "19"}],
        tools=[CALCULATOR],
    )
    assert "19" in second.output_text and second.previous_response_id == first.id
    third = client.responses.create(
        model=MODEL,
        previous_response_id=second.id,
        input="And what is 2 + 2?",
        tools=[CALCULATOR],
        stream=True,
    )
    final = next(e for e in third if e.type == "response.completed").response

    steps = trajectory_rows(gw, trajectory, 3)
    assert [s["step_index"] for s in steps] == [0, 1, 2]
    assert [s["payload"]["response"]["id"] for s in steps] == [first.id, second.id, final.id]
    modes = [s["payload"]["metadata"]["token_in"]["mode"] for s in steps]
    assert modes == ["start", "extend", "extend"]
    assert nests(steps[0], steps[1]) and nests(steps[1], steps[2])
    assert all(s["token_source"] == "upstream" for s in steps)
    assert steps[1]["payload"]["metadata"]["previous_response_id"] == first.id
    # the model saw the whole conversation: the first turn, its tool call, the tool's answer
    conversation = steps[1]["payload"]["conversation"]["messages"]
    assert [m["role"] for m in conversation] == ["user", "assistant", "tool"]
    assert conversation[1]["tool_calls"][0]["id"] == call.call_id

    # silver: one step per model call with exact ids, one whole trajectory
    build_silver(Lake(str(gw.lake)))
    silver = pl.read_delta(str(gw.lake / "silver" / "steps")).filter(
        pl.col("trajectory_uid") == trajectory
    )
    assert silver.sort("step_index")["step_index"].to_list() == [0, 1, 2]
    assert set(silver["token_source"]) == {"upstream"}
    trajectories = pl.read_delta(str(gw.lake / "silver" / "trajectories")).filter(
        pl.col("trajectory_uid") == trajectory
    )
    assert trajectories["num_steps"].to_list() == [3]


def test_an_unscoped_chain_survives_a_gateway_restart(sim, tmp_path):
    env = proxy_env(sim.url, KEY, TENANT)
    ids = [key(), key()]
    with GatewayProcess(tmp_path / "lake", **env) as gw:
        first = agent(gw).responses.create(
            model=MODEL, input="What is 3 + 4?", extra_headers={"Idempotency-Key": ids[0]}
        )
    with GatewayProcess(tmp_path / "lake", **env) as gw:  # memory is gone: WAL or bronze
        agent(gw).responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input="And 5 + 5?",
            extra_headers={"Idempotency-Key": ids[1]},
        )
        one, two = rows(gw, ids)
    assert one["trajectory_uid"] == two["trajectory_uid"]
    assert (one["step_index"], two["step_index"]) == (0, 1)
    assert nests(one, two)
    assert one["payload"]["metadata"]["scoped"] is False  # an unscoped first call: stitched
    metadata = two["payload"]["metadata"]
    assert metadata["scope_via"] == "previous_response" and metadata["scoped"] is True
    assert metadata["previous_response_id"] == first.id
    build_silver(Lake(str(tmp_path / "lake")))  # the stitched root and its continuation: one
    silver = pl.read_delta(str(tmp_path / "lake" / "silver" / "steps"))
    assert silver.filter(pl.col("trajectory_uid") == one["trajectory_uid"]).height == 2


def test_another_tenants_response_is_refused_from_memory_and_after_a_restart(sim, tmp_path):
    other_key, other = "responses-other-key", "tenant-other"
    env = proxy_env(sim.url, KEY, TENANT)
    env["CLAW_API_KEYS"] += f",{other_key}={other}"
    stranger = {"Authorization": f"Bearer {other_key}"}

    def continued_by_the_other_tenant(gw, previous: str) -> httpx.Response:
        body = {"model": MODEL, "previous_response_id": previous, "input": "And then?"}
        headers = stranger | {"Idempotency-Key": key()}
        return httpx.post(gw.url + "/v1/responses", json=body, headers=headers, timeout=30)

    with GatewayProcess(tmp_path / "lake", **env) as gw:
        first = agent(gw).responses.create(model=MODEL, input="A secret: zanzibar")
        refused = continued_by_the_other_tenant(gw, first.id)
        assert refused.status_code == 403
        error = refused.json()["error"]
        assert error["param"] == "previous_response_id"
        assert error["code"] == "previous_response_forbidden"
        assert error["message"] == (
            f"previous_response_id: response {first.id!r} belongs to another tenant than "
            f"this key's ({other!r})"
        )
        assert "zanzibar" not in refused.text  # (the response id itself is named)
    with GatewayProcess(tmp_path / "lake", **env) as gw:  # read back from the WAL or bronze
        assert continued_by_the_other_tenant(gw, first.id).status_code == 403
        own = agent(gw).responses.create(model=MODEL, previous_response_id=first.id, input="+1?")
        assert own.id
    landed = bronze(tmp_path / "lake")
    assert set(landed.filter(pl.col("kind") == "chat_completion")["tenant"]) == {TENANT}


def test_bad_input_is_refused_naming_the_field_and_lands_nothing(gw):
    client = agent(gw)
    before = bronze(gw.lake).height
    cases = [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "previous_response_id": "resp_nothing"}, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.APIStatusError) as refused:
            client.responses.create(model=MODEL, **fields)
        assert refused.value.status_code in (400, 404)
        error = refused.value.body
        assert error["param"] == param and error["message"].startswith(param)
    assert client.responses.create(model=MODEL, input="still fine?").status == "completed"
    assert bronze(gw.lake).height <= before + 1  # at most that last call
