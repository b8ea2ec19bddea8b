"""Token-in through a real gateway and a real `claw sim-llm` that drifts: every sampled reply
has one token the text's re-encoding would not give back, so re-rendering a conversation
(token-in off) breaks the turns' nesting, and token-in keeps it."""

from __future__ import annotations

import datetime as dt
import itertools
import json
import uuid

import dagster as dg
import httpx
import numpy as np
import openai
import polars as pl
import pytest

from claw_pipelines.definitions import defs
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.lake.delta import Lake
from claw_pipelines.tokenization import IM_END, decode, encode, load_tokenizer
from gateway.proxy.token_history import restore_trajectory
from tests.support.servers import GatewayProcess, bronze, wait_until
from tests.support.upstreams import CALCULATOR, SimProcess, proxy_env

KEY = "token-in-key"
TENANT = "tenant-token-in"
QUESTION = {"role": "user", "content": "What is 12 + 7?"}


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    """The simulated model, splitting one token of every reply."""
    with SimProcess(tmp_path_factory.mktemp("sim"), drift=1.0) as server:
        yield server


@pytest.fixture(scope="module")
def gw(sim, tmp_path_factory):
    """A gateway with token-in on by default for scoped chat calls."""
    lake = tmp_path_factory.mktemp("token-in") / "lake"
    with GatewayProcess(lake, **proxy_env(sim.url, KEY, TENANT, CLAW_TOKEN_IN="auto")) as server:
        yield server


def client(gw, trajectory: str, **headers: str) -> openai.OpenAI:
    """An OpenAI client whose base URL scopes its calls to `trajectory`."""
    return openai.OpenAI(
        base_url=f"{gw.url}/t/{trajectory}/g/{trajectory}-g/v1",
        api_key=KEY,
        max_retries=0,
        default_headers=headers,
    )


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def agent_turn(agent: openai.OpenAI, messages: list[dict], **options) -> dict:
    """One call; the reply (and a tool result when it called the calculator) appended."""
    answer = agent.chat.completions.create(
        model="sim", messages=messages, tools=[CALCULATOR], **options
    )
    message = answer.choices[0].message.model_dump(exclude_none=True)
    messages.append(message)
    if message.get("tool_calls"):
        call = message["tool_calls"][0]
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": "19"})
    else:
        messages.append({"role": "user", "content": "Thanks. And 3 * 4?"})
    return message


def steps_of(gw, trajectory: str, count: int) -> list[dict]:
    """The trajectory's chat steps in bronze by index (waiting for `count`), payload decoded."""

    def landed():
        frame = bronze(gw.lake)
        if frame.is_empty():
            return None
        frame = frame.filter(pl.col("trajectory_uid") == trajectory).sort("step_index")
        return frame if frame.height >= count else None

    rows = wait_until(landed, 20, interval=0.1, what=f"{count} steps").to_dicts()
    return [row | {"payload": json.loads(row["payload"])} for row in rows]


def nests(earlier: dict, later: dict) -> bool:
    full = [*earlier["prompt_ids"], *earlier["response_ids"]]
    return list(later["prompt_ids"][: len(full)]) == full


def token_in(step: dict) -> dict | None:
    return step["payload"]["metadata"].get("token_in")


def test_turns_nest_with_token_in_and_drift_without(gw):
    off, on = uid("off"), uid("on")
    for trajectory, mode in ((off, "off"), (on, "on")):
        agent, messages = client(gw, trajectory, **{"X-Claw-Token-In": mode}), [QUESTION]
        for _ in range(4):
            agent_turn(agent, messages)
    plain, exact = steps_of(gw, off, 4), steps_of(gw, on, 4)
    assert not all(nests(a, b) for a, b in itertools.pairwise(plain))
    assert all(token_in(s) is None for s in plain)
    assert all(nests(a, b) for a, b in itertools.pairwise(exact))
    assert [token_in(s)["mode"] for s in exact] == ["start", "extend", "extend", "extend"]
    assert [token_in(s)["parent_step"] for s in exact] == [None, 0, 1, 2]
    # the agent was answered with what the model sampled: the reply's text is its ids' text
    tokenizer = load_tokenizer()
    for step in exact:
        message = step["payload"]["response"]["choices"][0]["message"]
        text = decode(step["response_ids"], tokenizer).removesuffix(IM_END)
        if message.get("tool_calls"):
            function = message["tool_calls"][0]["function"]
            assert json.loads(text.split("<tool_call>")[1].split("</tool_call>")[0]) == {
                "name": function["name"],
                "arguments": json.loads(function["arguments"]),
            }
        else:
            assert text == message["content"]
        assert encode(text, tokenizer) != list(step["response_ids"])[:-1]  # the sim drifted


def test_edited_or_truncated_history_forks_never_splices(sim, tmp_path):
    env = proxy_env(sim.url, KEY, TENANT, CLAW_TOKEN_IN="on")
    with GatewayProcess(tmp_path / "lake", **env) as gw:
        _forks(gw)


def _forks(gw) -> None:
    trajectory = uid("fork")
    agent, messages = client(gw, trajectory), [QUESTION]
    first = agent_turn(agent, messages)
    agent_turn(agent, messages)
    # truncated: back to the first reply, another follow-up: a branch from step 0
    truncated = [QUESTION, first, {"role": "user", "content": "Say it in words."}]
    agent_turn(agent, truncated)
    # edited: the first reply rewritten: nothing recorded matches, a branch from the start
    edited = [QUESTION, {"role": "assistant", "content": "It is 20."}, truncated[2]]
    agent_turn(agent, edited)
    steps = steps_of(gw, trajectory, 4)
    assert [(token_in(s)["mode"], token_in(s)["parent_step"]) for s in steps] == [
        ("start", None),
        ("extend", 0),
        ("fork", 0),
        ("fork", None),
    ]
    assert nests(steps[0], steps[2]) and not nests(steps[1], steps[2])
    assert not nests(steps[0], steps[3])
    # silver's nesting check follows the forks: every continued step nests in its parent
    result = dg.materialize(
        defs.assets,
        selection=dg.AssetSelection.groups("silver"),
        resources={"claw": ClawLake(lake_uri=str(gw.lake))},
    )
    found = {e.check_name: e for e in result.get_asset_check_evaluations()}["turns_nest"]
    assert found.passed, found.metadata


def test_streams_and_tool_calls_arrive_in_the_chat_format(gw):
    trajectory = uid("stream")
    agent, messages = client(gw, trajectory), [QUESTION]
    agent_turn(agent, messages)  # the first turn goes as a chat call: nothing to continue
    for turn in range(1, 12):  # until a continuing turn calls the calculator
        stream = agent.chat.completions.create(
            model="sim",
            messages=[*messages],
            tools=[CALCULATOR],
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
        )
        chunks = list(stream)
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        calls = [c for d in deltas for c in d.tool_calls or ()]
        content = "".join(d.content or "" for d in deltas)
        step = steps_of(gw, trajectory, turn + 1)[turn]
        assert token_in(step)["mode"] == "extend"
        if calls:
            break
        messages += [{"role": "assistant", "content": content}, QUESTION]
    assert calls, "the sim never called the tool"
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert calls[0].function.name == "calculator" and calls[0].id.startswith("call_")
    assert "expression" in json.loads(calls[0].function.arguments)
    logprobs = [
        t
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content or ()
    ]
    assert len(logprobs) == len(step["response_ids"])
    assert all(len(t.top_logprobs) == 2 for t in logprobs)
    assert np.allclose([t.logprob for t in logprobs], step["rollout_log_probs"])


def test_wrong_modes_get_a_clear_error_and_land_nothing(gw):
    before = bronze(gw.lake).height
    base = {"model": "sim", "messages": [QUESTION]}
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [
        ("/v1/chat/completions", base, {"X-Claw-Token-In": "sometimes"}, 422, "X-Claw-Token-In"),
        ("/v1/chat/completions", base, {"X-Claw-Token-In": "on"}, 400, "X-Claw-Token-In"),
        (
            f"/t/{uid('bad')}/g/g/v1/chat/completions",
            base | {"response_format": {"type": "json_object"}},
            {"X-Claw-Token-In": "on"},
            400,
            "response_format",
        ),
        (
            f"/t/{uid('bad')}/g/g/v1/chat/completions",
            base | {"tools": [CALCULATOR], "tool_choice": "required"},
            {"X-Claw-Token-In": "on"},
            400,
            "tool_choice",
        ),
    ]
    for path, body, headers, status, param in cases:
        response = httpx.post(gw.url + path, json=body, headers=auth | headers, timeout=10)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"]
    # auto: what token-in cannot translate goes upstream as it came
    trajectory = uid("auto")
    body = base | {"response_format": {"type": "json_object"}}
    response = httpx.post(
        f"{gw.url}/t/{trajectory}/g/g/v1/chat/completions", json=body, headers=auth, timeout=10
    )
    assert response.status_code == 200, response.text
    step = steps_of(gw, trajectory, 1)[0]
    assert token_in(step) is None
    assert bronze(gw.lake).height == before + 1


def test_history_survives_kill_9_from_the_wal_and_from_bronze(sim, tmp_path):
    lake = tmp_path / "lake"
    env = proxy_env(sim.url, KEY, TENANT, CLAW_TOKEN_IN="on")
    trajectory = uid("restart")
    messages = [QUESTION]
    # segments sealed after a minute: what the first gateway acknowledges stays in its WAL
    gateway = GatewayProcess(lake, **env | {"CLAW_FLUSH_INTERVAL_MS": "60000"}).start()
    try:
        agent = client(gateway, trajectory)
        agent_turn(agent, messages)
        agent_turn(agent, messages)
    finally:
        gateway.kill()
    # acknowledged, not in bronze yet: the gateway's WAL has them (its open segment)
    wal = lake / "_wal" / "gw-test"
    eos = encode(IM_END)[0]
    since = dt.date.today() - dt.timedelta(days=1)
    from_wal = restore_trajectory(trajectory, wal, Lake(str(lake)), since, eos)
    assert from_wal.last_step == 1 and len(from_wal.turns) == 2
    gateway = GatewayProcess(lake, **env).start()
    try:
        agent_turn(client(gateway, trajectory), messages)
        steps = steps_of(gateway, trajectory, 3)
        wait_until(lambda: not list(wal.glob("*.wal")), 20, what="the WAL landed")
    finally:
        gateway.kill()
    assert [(token_in(s)["mode"], token_in(s)["parent_step"]) for s in steps] == [
        ("start", None),
        ("extend", 0),
        ("extend", 1),
    ]
    assert [s["step_index"] for s in steps] == [0, 1, 2] and nests(steps[1], steps[2])
    gateway = GatewayProcess(lake, **env).start()
    try:
        agent_turn(client(gateway, trajectory), messages)
        steps = steps_of(gateway, trajectory, 4)
    finally:
        gateway.stop()
    assert (token_in(steps[3])["mode"], token_in(steps[3])["parent_step"]) == ("extend", 2)
    assert steps[3]["step_index"] == 3 and nests(steps[2], steps[3])
