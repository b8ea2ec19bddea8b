"""The OpenAI-compatible proxy in front of a real `claw sim-llm` process, driven with the
official `openai` client and raw HTTP: answers are the model's, bronze holds its exact ids."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid

import httpx
import openai
import polars as pl
import pytest

from claw_pipelines.tokenization import encode_chat
from tests.support.servers import GatewayProcess, bronze, wait_landed, wait_until
from tests.support.upstreams import CALCULATOR, SimProcess, proxy_env

KEY = "proxy-test-key"
TENANT = "tenant-proxy"
QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]
VOLATILE = ("id", "created")  # differ between any two calls of the same model


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """The simulated model; its latency is spread over stream chunks."""
    with SimProcess(tmp_path_factory.mktemp("sim"), latency_ms=60) as server:
        yield server


@pytest.fixture(scope="module")
def gw(sim, tmp_path_factory):
    """A gateway proxying to the sim, with an API key."""
    lake = tmp_path_factory.mktemp("proxy") / "lake"
    with GatewayProcess(lake, **proxy_env(sim.url, KEY, TENANT)) as server:
        yield server


@pytest.fixture
def client(gw):
    with openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def direct(sim):
    with openai.OpenAI(base_url=sim.url, api_key="none", max_retries=0) as c:
        yield c


def key() -> str:
    return f"k-{uuid.uuid4().hex}"


def without(answer: dict, *fields: str) -> dict:
    return {k: v for k, v in answer.items() if k not in fields}


def raw_direct(sim: SimProcess, path: str, body: dict) -> dict:
    """The sim's answer with token ids and log-probs: what the model sampled."""
    asked = body | {"return_token_ids": True, "logprobs": True if "messages" in body else 0}
    response = httpx.post(sim.url + path, json=asked, timeout=30)
    response.raise_for_status()
    return response.json()


def steps(gw: GatewayProcess, event_ids) -> dict[str, dict]:
    """Bronze rows by event_id (waiting for them), with the payload decoded."""
    rows = wait_landed(gw.lake, event_ids).sort("event_id").to_dicts()
    return {row["event_id"]: row | {"payload": json.loads(row["payload"])} for row in rows}


def chat_logprobs(answer: dict, index: int = 0) -> list[float]:
    return [t["logprob"] for t in answer["choices"][index]["logprobs"]["content"]]


def test_chat_answer_is_the_models_and_bronze_holds_the_sampled_ids(gw, sim, client, direct):
    body = {"model": "claw-sim-llm", "messages": QUESTION, "seed": 3}
    event_id = key()
    answer = client.chat.completions.create(**body, extra_headers={"Idempotency-Key": event_id})
    straight = direct.chat.completions.create(**body)
    assert without(answer.model_dump(), *VOLATILE) == without(straight.model_dump(), *VOLATILE)
    assert answer.choices[0].logprobs is None  # asked for by the gateway, not by the agent

    sampled = raw_direct(sim, "/chat/completions", body)
    row = steps(gw, [event_id])[event_id]
    assert row["kind"] == "chat_completion"
    assert row["tenant"] == TENANT
    assert row["token_source"] == "upstream"
    assert row["prompt_ids"] == sampled["prompt_token_ids"] == encode_chat(QUESTION)
    assert row["response_ids"] == sampled["choices"][0]["token_ids"]
    assert row["rollout_log_probs"] == pytest.approx(chat_logprobs(sampled), abs=1e-5)
    assert row["finish_reason"] == "stop" and row["step_index"] == 0
    assert row["model"] == "claw-sim-llm"
    payload = row["payload"]
    assert payload["request"] == body
    assert (
        payload["response"]["choices"][0]["message"]["content"] == answer.choices[0].message.content
    )
    assert payload["metadata"]["scoped"] is False
    assert payload["response"]["id"] == answer.id


def test_server_timing_splits_the_upstreams_time_from_the_gateways(gw, client):
    event_id = key()
    response = client.chat.completions.with_raw_response.create(
        model="claw-sim-llm", messages=QUESTION, extra_headers={"Idempotency-Key": event_id}
    )
    timings = dict(
        part.strip().split(";dur=") for part in response.headers["server-timing"].split(",")
    )
    upstream, gateway = float(timings["upstream"]), float(timings["gateway"])
    assert upstream >= 60  # the sim's latency
    assert 0 < gateway < upstream  # receiving, recording durably, building the answer
    row = steps(gw, [event_id])[event_id]
    assert row["payload"]["metadata"]["upstream_ms"] == pytest.approx(upstream, abs=0.01)


def test_tool_calls_and_n2_pass_through_one_step_per_choice(gw, sim, client, direct):
    body = {
        "model": "claw-sim-llm",
        "messages": QUESTION,
        "tools": [CALCULATOR],
        "tool_choice": "required",
        "n": 2,
        "seed": 5,
    }
    event_id = key()
    answer = client.chat.completions.create(**body, extra_headers={"Idempotency-Key": event_id})
    straight = direct.chat.completions.create(**body)
    assert without(answer.model_dump(), *VOLATILE) == without(straight.model_dump(), *VOLATILE)
    assert all(choice.message.tool_calls for choice in answer.choices)

    sampled = raw_direct(sim, "/chat/completions", body)
    rows = steps(gw, [f"{event_id}:0", f"{event_id}:1"])
    for index in range(2):
        row = rows[f"{event_id}:{index}"]
        assert row["response_ids"] == sampled["choices"][index]["token_ids"]
        assert row["prompt_ids"] == sampled["prompt_token_ids"]
        assert row["payload"]["metadata"]["choice_index"] == index
        assert row["finish_reason"] == sampled["choices"][index]["finish_reason"]
    first, second = rows[f"{event_id}:0"], rows[f"{event_id}:1"]
    assert first["prompt_uid"] == second["prompt_uid"] is not None  # one GRPO group
    assert first["trajectory_uid"] != second["trajectory_uid"]  # two rollouts


def test_async_client_streams_the_same_chunks_and_records_each_choice(gw, sim):
    body = {
        "model": "claw-sim-llm",
        "messages": QUESTION,
        "tools": [CALCULATOR],
        "n": 2,
        "seed": 11,
        "stream_options": {"include_usage": True},
    }
    event_id = key()

    async def run() -> tuple[list[dict], list[dict], dict]:
        async with (
            openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as client,
            openai.AsyncOpenAI(base_url=sim.url, api_key="none", max_retries=0) as direct,
        ):
            plain = await client.chat.completions.create(**without(body, "stream_options"))
            straight = await direct.chat.completions.create(**without(body, "stream_options"))
            assert without(plain.model_dump(), *VOLATILE) == without(
                straight.model_dump(), *VOLATILE
            )
            ours = await client.chat.completions.create(
                **body, stream=True, extra_headers={"Idempotency-Key": event_id}
            )
            theirs = await direct.chat.completions.create(**body, stream=True)
            return (
                [chunk.model_dump() async for chunk in ours],
                [chunk.model_dump() async for chunk in theirs],
                straight.model_dump(),
            )

    ours, theirs, whole = asyncio.run(run())
    assert [without(c, *VOLATILE) for c in ours] == [without(c, *VOLATILE) for c in theirs]
    assert ours[-1]["usage"] is not None

    sampled = raw_direct(sim, "/chat/completions", without(body, "stream_options"))
    rows = steps(gw, [f"{event_id}:0", f"{event_id}:1"])
    for index in range(2):
        row = rows[f"{event_id}:{index}"]
        assert row["response_ids"] == sampled["choices"][index]["token_ids"]
        assert row["rollout_log_probs"] == pytest.approx(chat_logprobs(sampled, index), abs=1e-5)
        assert row["payload"]["metadata"]["stream"] is True
        message = row["payload"]["response"]["choices"][0]["message"]
        expected = whole["choices"][index]["message"]
        assert message["content"] == expected["content"]
        if expected["tool_calls"]:
            assert message["tool_calls"][0]["function"] == expected["tool_calls"][0]["function"]


def test_stream_relays_chunks_as_they_arrive(gw):
    body = {"model": "claw-sim-llm", "messages": QUESTION, "stream": True, "max_tokens": 60}
    headers = {"Authorization": f"Bearer {KEY}"}
    started = time.perf_counter()
    arrivals = []
    with httpx.stream(
        "POST", gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                arrivals.append(time.perf_counter() - started)
    assert len(arrivals) > 4
    # the sim spreads its 60 ms over the chunks: relayed as they come, they arrive spread out
    # too (a relay that buffered would hand them over at once); load only widens the spread
    assert arrivals[-1] - arrivals[0] > 0.03


def test_legacy_completions_and_models_pass_through(gw, sim, client, direct):
    body = {"model": "claw-sim-llm", "prompt": "The trainer", "max_tokens": 12, "seed": 2}
    event_id = key()
    answer = client.completions.create(**body, extra_headers={"Idempotency-Key": event_id})
    straight = direct.completions.create(**body)
    assert without(answer.model_dump(), *VOLATILE) == without(straight.model_dump(), *VOLATILE)
    sampled = raw_direct(sim, "/completions", body)
    row = steps(gw, [event_id])[event_id]
    assert row["kind"] == "completion"
    assert row["response_ids"] == sampled["choices"][0]["token_ids"]
    assert row["prompt_ids"] == sampled["choices"][0]["prompt_token_ids"]
    assert client.models.list().model_dump() == direct.models.list().model_dump()


def test_scoped_base_url_numbers_the_turns_of_a_conversation(gw):
    trajectory, group = f"traj-{uuid.uuid4().hex[:8]}", "group-a"
    base = f"{gw.url}/t/{trajectory}/g/{group}/v1"
    messages = [{"role": "user", "content": "What is 6 * 7? Use the calculator."}]
    keys = []
    with openai.OpenAI(base_url=base, api_key=KEY, max_retries=0) as agent:
        for turn in range(3):
            keys.append(key())
            response = agent.chat.completions.with_raw_response.create(
                model="claw-sim-llm",
                messages=messages,
                tools=[CALCULATOR],
                extra_headers={"Idempotency-Key": keys[-1], "X-Claw-Policy-Version": "4"},
            )
            assert response.headers["x-claw-step-keys"] == f"{trajectory}:{turn}"
            message = response.parse().choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or ():
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
            if not message.tool_calls:
                messages.append({"role": "user", "content": "Thanks. And 2 + 2?"})
    rows = steps(gw, keys)
    ordered = [rows[k] for k in keys]
    assert [r["step_index"] for r in ordered] == [0, 1, 2]
    assert {r["trajectory_uid"] for r in ordered} == {trajectory}
    assert {r["prompt_uid"] for r in ordered} == {group}
    assert {r["policy_version"] for r in ordered} == {4}
    for earlier, later in itertools.pairwise(ordered):
        # exact ids: each turn's prompt starts with the previous prompt and its sampled reply
        sequence = earlier["prompt_ids"] + earlier["response_ids"]
        assert later["prompt_ids"][: len(sequence)] == sequence
    assert all(r["payload"]["metadata"]["scoped"] for r in ordered)


def test_scope_headers_and_their_validation(gw):
    headers = {
        "Authorization": f"Bearer {KEY}",
        "X-Claw-Trajectory": "hdr-traj-1",
        "X-Claw-Prompt-Group": "hdr-group",
        "X-Claw-Policy-Version": "9",
        "Idempotency-Key": key(),
    }
    body = {"model": "claw-sim-llm", "messages": QUESTION}
    answer = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert answer.status_code == 200
    row = steps(gw, [headers["Idempotency-Key"]])[headers["Idempotency-Key"]]
    assert (row["trajectory_uid"], row["prompt_uid"], row["policy_version"]) == (
        "hdr-traj-1",
        "hdr-group",
        9,
    )
    bad = httpx.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers=headers | {"X-Claw-Policy-Version": "latest"},
        timeout=30,
    )
    assert bad.status_code == 422
    assert bad.json()["error"]["param"] == "X-Claw-Policy-Version"


def test_proxy_routes_need_the_api_key(gw):
    body = {"model": "claw-sim-llm", "messages": QUESTION}
    missing = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=10)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
    wrong = httpx.get(gw.url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    not_json = httpx.post(
        gw.url + "/v1/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=10,
    )
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


def test_claw_r1_flow_lands_steps_and_the_completion(gw):
    auth = {"Authorization": f"Bearer {KEY}"}
    init = httpx.post(
        gw.url + "/init_trajectory", json={"metadata": {"policy_version": 2}}, headers=auth
    )
    assert init.status_code == 200
    started = init.json()
    trajectory, group = started["trajectory_uid"], started["prompt_uid"]
    assert started["base_url"] == f"{gw.url}/{trajectory}/{group}/v1"
    keys = [key() for _ in range(3)]
    messages = [{"role": "user", "content": "Plan a short trip."}]
    with openai.OpenAI(base_url=started["base_url"], api_key=KEY, max_retries=0) as agent:
        for turn, event_id in enumerate(keys):
            if turn == 1:
                registered = httpx.post(
                    f"{started['base_url']}/register_trajectory",
                    json={"metadata": {"policy_version": 7, "agent": "planner"}},
                    headers=auth,
                )
                assert registered.json()["policy_version"] == 7
            answer = agent.chat.completions.create(
                model="claw-sim-llm", messages=messages, extra_headers={"Idempotency-Key": event_id}
            )
            messages += [
                answer.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": f"Next, step {turn + 2}?"},
            ]
    done = httpx.post(
        f"{started['base_url']}/complete_trajectory", json={"reward": 1.0}, headers=auth
    )
    assert done.status_code == 200
    completion_id = done.json()["event_ids"][0]
    rows = steps(gw, [*keys, completion_id])
    ordered = [rows[k] for k in keys]
    assert [r["step_index"] for r in ordered] == [0, 1, 2]
    assert [r["policy_version"] for r in ordered] == [2, 7, 7]
    assert ordered[2]["payload"]["metadata"]["agent"] == "planner"
    assert all(r["payload"]["metadata"]["scope_via"] == "claw_r1" for r in ordered)
    completion = rows[completion_id]
    assert completion["kind"] == "trajectory_complete"
    assert completion["payload"]["trajectory_uid"] == trajectory
    assert completion["payload"]["reward"] == 1.0


def test_a_stream_cut_by_the_client_is_recorded(gw, sim):
    body = {"model": "claw-sim-llm", "messages": QUESTION, "stream": True, "max_tokens": 200}
    event_id = key()
    headers = {"Authorization": f"Bearer {KEY}", "Idempotency-Key": event_id}
    url = gw.url + "/v1/chat/completions"
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url, json=body, headers=headers) as response,
    ):
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                break  # leave mid-answer: closing the response drops the connection
    row = steps(gw, [event_id])[event_id]
    assert row["finish_reason"] == "client_disconnected"
    full = raw_direct(sim, "/chat/completions", without(body, "stream"))["choices"][0]
    received = row["response_ids"]
    assert 0 < len(received) < len(full["token_ids"])
    assert received == full["token_ids"][: len(received)]  # exactly what was sampled so far
    assert row["rollout_log_probs"] is not None and len(row["rollout_log_probs"]) == len(received)


def test_upstream_killed_mid_run_gives_clean_502s_and_loses_no_answered_call(gw, sim):
    """Last in the module: it kills the sim, then starts it again on the same port."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "claw-sim-llm", "messages": QUESTION}
    outcomes: list[tuple[str, int, dict]] = []
    stop = threading.Event()

    def agent() -> None:
        with httpx.Client(timeout=30) as http:
            while not stop.is_set():
                event_id = key()
                response = http.post(
                    gw.url + "/v1/chat/completions",
                    json=body,
                    headers=auth | {"Idempotency-Key": event_id},
                )
                outcomes.append((event_id, response.status_code, response.json()))

    agents = [threading.Thread(target=agent) for _ in range(4)]
    for thread in agents:
        thread.start()
    try:
        time.sleep(0.8)
        sim.kill()
        time.sleep(0.8)
    finally:
        stop.set()
        for thread in agents:
            thread.join(30)
    statuses = {status for _, status, _ in outcomes}
    assert statuses <= {200, 502}, statuses
    answered = [event_id for event_id, status, _ in outcomes if status == 200]
    failed = [answer for _, status, answer in outcomes if status == 502]
    assert answered and failed
    assert all(a["error"]["type"] == "upstream_error" for a in failed)
    assert {a["error"]["code"] for a in failed} <= {"upstream_unreachable", "upstream_error"}
    assert httpx.get(gw.url + "/healthz", timeout=5).status_code == 200
    assert httpx.get(gw.url + "/readyz", timeout=5).status_code == 200
    steps(gw, answered)  # every answered call is in bronze

    def errors_landed() -> pl.DataFrame | None:
        events = bronze(gw.lake).filter(pl.col("kind") == "event")
        found = events.filter(pl.col("payload").str.contains('"upstream_error"'))
        return found if len(found) >= len(failed) else None

    wait_until(errors_landed, 20, interval=0.1, what="upstream_error events")
    sim.start()  # the same port: the gateway recovers on its own
    recovered = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=auth, timeout=30)
    assert recovered.status_code == 200


def test_the_httpx_upstream_client_answers_and_records_the_same(sim, tmp_path):
    """CLAW_UPSTREAM_CLIENT=httpx (the benchmark's comparison arm) proxies like the default."""
    env = proxy_env(sim.url, KEY, TENANT) | {"CLAW_UPSTREAM_CLIENT": "httpx"}
    with (
        GatewayProcess(tmp_path / "lake", **env) as gateway,
        openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0) as c,
    ):
        answer = c.chat.completions.with_raw_response.create(
            model="claw-sim-llm", messages=QUESTION, max_tokens=8, seed=3
        )
        keys = answer.headers["x-claw-step-keys"].split(",")
        streamed = c.chat.completions.create(
            model="claw-sim-llm", messages=QUESTION, max_tokens=8, seed=3, stream=True
        )
        text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
        assert text == answer.parse().choices[0].message.content
        rows = wait_until(
            lambda: (found := bronze(gateway.lake)).height >= 2 and found, 20, what="2 steps"
        )
        assert len(keys) == 1 and rows.filter(pl.col("token_source") == "upstream").height == 2


def test_the_gateway_says_how_it_captures_ids(gw):
    capture = httpx.get(gw.url + "/readyz", timeout=5).json()["capture"]
    assert capture == {
        "token_ids": "server ids",
        "upstream_returns_ids": True,
        "upstream_returns_log_probs": True,
        "simulated_upstream": True,  # its model list says so: the bundled tokenizer is its own
        "tokenizer": "bundled",
        "probe": "ok",
    }
    started = (gw.lake.parent / f"gateway-{gw.port}.log").read_text()
    assert "capture: token ids: server ids; log-probs: yes; tokenizer: bundled" in started


def test_a_streamed_call_names_its_step_keys_for_the_sdk(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    key = f"stream-{uuid.uuid4().hex}"
    with client.chat.completions.with_streaming_response.create(
        model="claw-sim-llm",
        messages=QUESTION,
        stream=True,
        n=2,
        extra_headers={"Idempotency-Key": key},
    ) as response:
        step_keys = response.headers["X-Claw-Step-Keys"].split(",")
        chunks = list(response.parse())
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert all(c.usage is None for c in chunks)  # the usage the gateway asked for is its own
    rows = steps(gw, [f"{key}:0", f"{key}:1"])
    landed = sorted(f"{r['trajectory_uid']}:{r['step_index']}" for r in rows.values())
    assert landed == sorted(step_keys)
