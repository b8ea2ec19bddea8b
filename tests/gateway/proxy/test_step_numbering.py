"""A scoped trajectory keeps its step numbering across gateway restarts and replicas: real
gateway processes (uvicorn) in front of a real `claw sim-llm`, driven with the official
`openai` client; the turns after a SIGTERM or a SIGKILL, or served by another gateway on the
same lake, continue the trajectory's step keys, and silver holds every turn once, in order,
nothing in step_conflicts."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import httpx
import openai
import polars as pl
import pytest

from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.materialize.silver import build_silver
from gateway.numbering import RecordedSteps, turns_shown, wal_steps
from gateway.proxy.scope import TrajectoryBook
from gateway.records import BronzeRecord
from tests.support.ingest import nests, trajectory_rows
from tests.support.servers import GatewayProcess
from tests.support.upstreams import SimProcess, proxy_env

KEY = "numbering-test-key"
TENANT = "tenant-numbering"
MODEL = "claw-sim-llm"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with SimProcess(tmp_path_factory.mktemp("sim"), latency_ms=5) as server:
        yield server


def env(sim, gateway_id: str = "gw-test", **extra: str) -> dict[str, str]:
    return proxy_env(sim.url, KEY, TENANT, CLAW_GATEWAY_ID=gateway_id, **extra)


def client(gw: GatewayProcess, trajectory: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/t/{trajectory}/g/g1/v1", api_key=KEY, max_retries=0)


def turn(gw: GatewayProcess, trajectory: str, messages: list[dict]) -> tuple[str, str]:
    """One call of the conversation; (its step key, the reply)."""
    raw = client(gw, trajectory).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages
    )
    return raw.headers["x-claw-step-keys"], raw.parse().choices[0].message.content


class Conversation:
    """An agent that resends its whole history every turn (as the OpenAI SDK's users do)."""

    def __init__(self, trajectory: str) -> None:
        self.trajectory = trajectory
        self.messages: list[dict] = [{"role": "user", "content": "What is 3 + 4?"}]
        self.keys: list[str] = []

    def turn(self, gw: GatewayProcess) -> None:
        key, reply = turn(gw, self.trajectory, self.messages)
        self.keys.append(key)
        n = len(self.keys)
        self.messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"And {n} more?"},
        ]


def stateless_turn(gw: GatewayProcess, trajectory: str, n: int) -> str:
    """A call that shows none of the earlier turns (an agent that keeps its own state)."""
    return turn(gw, trajectory, [{"role": "user", "content": f"What is {n} + 1?"}])[0]


def silver_of(lake: Path, trajectory: str, count: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(the trajectory's silver steps by step_index, its step conflicts), once bronze holds
    `count` of its records and silver was built."""
    trajectory_rows(_Lake(lake), trajectory, count)
    build_silver(Lake(str(lake)))
    steps = read_steps(Lake(str(lake)), "silver/steps").filter(
        pl.col("trajectory_uid") == trajectory
    )
    try:
        conflicts = pl.read_delta(str(lake / "silver" / "step_conflicts"))
    except Exception:  # never written: no conflict ever
        conflicts = pl.DataFrame({"step_key": []}, schema={"step_key": pl.String})
    conflicts = conflicts.filter(pl.col("step_key").str.starts_with(trajectory + ":"))
    return steps.sort("step_index"), conflicts


class _Lake:
    """What tests.support.ingest reads of a gateway: its lake."""

    def __init__(self, lake: Path) -> None:
        self.lake = lake


def assert_one_whole_trajectory(lake: Path, trajectory: str, keys: list[str], nested: bool):
    wanted = [f"{trajectory}:{i}" for i in range(len(keys))]
    assert keys == wanted  # what each call answered in X-Claw-Step-Keys
    steps, conflicts = silver_of(lake, trajectory, len(keys))
    assert steps["step_key"].to_list() == wanted  # the keys the client got, in order
    assert conflicts.is_empty()
    assert steps["event_id"].n_unique() == len(keys)
    if nested:  # each turn's prompt extends the turn before (prompt + reply)
        rows = steps.to_dicts()
        assert all(nests(a, b) for a, b in itertools.pairwise(rows))
        assert set(steps["fragment"]) == {0}


def test_a_trajectory_keeps_its_turns_across_a_gateway_restart(sim, tmp_path):
    """Two agents: one resends its history, one shows none (its numbering after the restart
    can only come from bronze, where the SIGTERM's drain landed the first three turns)."""
    lake, tag = tmp_path / "lake", uuid.uuid4().hex[:6]
    agent, stateless = Conversation(f"traj-r-{tag}"), f"traj-s-{tag}"
    keys = []
    with GatewayProcess(lake, **env(sim)) as gw:
        for n in range(3):
            agent.turn(gw)
            keys.append(stateless_turn(gw, stateless, n))
    # stopped with SIGTERM; started again on the same WAL and lake
    with GatewayProcess(lake, **env(sim)) as gw:
        for n in range(3, 6):
            agent.turn(gw)
            keys.append(stateless_turn(gw, stateless, n))
    assert_one_whole_trajectory(lake, agent.trajectory, agent.keys, nested=True)
    assert_one_whole_trajectory(lake, stateless, keys, nested=False)


def test_numbering_survives_a_sigkill_from_the_wal_for_calls_that_show_no_history(sim, tmp_path):
    """The turns before the kill are still in the WAL (nothing sealed: a long flush
    interval), and the calls carry no history: only what the WAL recorded can tell."""
    lake, trajectory = tmp_path / "lake", f"traj-k-{uuid.uuid4().hex[:6]}"
    slow = env(sim, CLAW_FLUSH_INTERVAL_MS="60000")
    gw = GatewayProcess(lake, **slow).start()
    keys = [stateless_turn(gw, trajectory, n) for n in range(3)]
    gw.kill()
    with GatewayProcess(lake, **env(sim)) as gw:
        keys += [stateless_turn(gw, trajectory, n) for n in range(3, 6)]
    assert_one_whole_trajectory(lake, trajectory, keys, nested=False)


def test_claw_r1_and_responses_trajectories_go_on_numbering_after_a_restart(sim, tmp_path):
    """A Claw-R1 trajectory (its own base URL, each call a new question) and a scoped
    Responses chain (`previous_response_id`) across a SIGTERM."""
    lake = tmp_path / "lake"
    chain = f"traj-resp-{uuid.uuid4().hex[:6]}"
    responses, r1_keys = [], []
    with GatewayProcess(lake, **env(sim)) as gw:
        init = httpx.post(
            gw.url + "/init_trajectory", json={}, headers={"Authorization": f"Bearer {KEY}"}
        ).json()
        r1 = openai.OpenAI(base_url=init["base_url"], api_key=KEY, max_retries=0)
        agent = client(gw, chain).responses.with_raw_response
        for n in range(2):
            question = [{"role": "user", "content": f"What is {n} + 2?"}]
            raw = r1.chat.completions.with_raw_response.create(model=MODEL, messages=question)
            r1_keys.append(raw.headers["x-claw-step-keys"])
            previous = {"previous_response_id": responses[-1][1]} if responses else {}
            raw = agent.create(model=MODEL, input=f"And {n} + 3?", **previous)
            responses.append((raw.headers["x-claw-step-keys"], raw.parse().id))
    r1_path = init["base_url"].removeprefix(gw.url)
    with GatewayProcess(lake, **env(sim)) as gw:
        r1 = openai.OpenAI(base_url=gw.url + r1_path, api_key=KEY, max_retries=0)
        raw = r1.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "What is 9 + 2?"}]
        )
        r1_keys.append(raw.headers["x-claw-step-keys"])
        raw = client(gw, chain).responses.with_raw_response.create(
            model=MODEL, input="And 9 + 3?", previous_response_id=responses[-1][1]
        )
        responses.append((raw.headers["x-claw-step-keys"], raw.parse().id))
    trajectory = init["trajectory_uid"]
    assert r1_keys == [f"{trajectory}:{n}" for n in range(3)]
    assert [k for k, _ in responses] == [f"{chain}:{n}" for n in range(3)]
    steps, conflicts = silver_of(lake, trajectory, 3)
    assert steps["step_key"].to_list() == r1_keys and conflicts.is_empty()
    assert set(steps["source_kind"]) == {"claw_r1"}
    steps, conflicts = silver_of(lake, chain, 3)
    assert steps["step_key"].to_list() == [k for k, _ in responses] and conflicts.is_empty()
    rows = steps.to_dicts()
    assert all(nests(a, b) for a, b in itertools.pairwise(rows))


def test_turns_alternating_between_two_gateways_on_one_lake_are_one_trajectory(sim, tmp_path):
    lake, trajectory = tmp_path / "lake", f"traj-a-{uuid.uuid4().hex[:6]}"
    agent = Conversation(trajectory)
    with (
        GatewayProcess(lake, **env(sim, "gw-one")) as one,
        GatewayProcess(lake, **env(sim, "gw-two")) as two,
    ):
        for n in range(6):
            agent.turn((one, two)[n % 2])
    assert_one_whole_trajectory(lake, trajectory, agent.keys, nested=True)


def test_calls_that_show_no_history_on_two_gateways_at_once_are_all_kept_in_silver(sim, tmp_path):
    """What numbering cannot know (docs/DESIGN.md §4): two gateways serving one trajectory
    whose calls show none of the other's turns give one index twice. Silver keeps every call
    all the same: the first received keeps the key, the other is renumbered, none is a
    conflict."""
    lake, trajectory = tmp_path / "lake", f"traj-b-{uuid.uuid4().hex[:6]}"
    with (
        GatewayProcess(lake, **env(sim, "gw-one")) as one,
        GatewayProcess(lake, **env(sim, "gw-two")) as two,
    ):
        keys = [stateless_turn((one, two)[n % 2], trajectory, n) for n in range(6)]
    assert keys == [f"{trajectory}:{n // 2}" for n in range(6)]  # each gateway counts its own
    steps, conflicts = silver_of(lake, trajectory, 6)
    assert steps.height == 6 and steps["step_key"].n_unique() == 6 and conflicts.is_empty()
    assert steps["step_key"].to_list()[:3] == keys[::2]  # the first received keep theirs
    moved = steps["metadata"].str.json_path_match("$.renumbered_from").to_list()
    assert moved == [None, None, None, *keys[1::2]]


def test_recorded_steps_resume_after_the_newest_index_and_only_ever_skip():
    recorded = RecordedSteps()
    recorded.add(pl.DataFrame({"trajectory_uid": ["a", "a", "b"], "step_index": [0, 4, 2]}))
    recorded.add(pl.DataFrame({"trajectory_uid": ["a", "c"], "step_index": [1, None]}))
    assert [recorded.next_step(t) for t in ("a", "b", "c", "z")] == [5, 3, 0, 0]
    book = TrajectoryBook(capacity=2, recorded=recorded)
    assert book.claim_steps("a", 1) == 5  # after what the WAL and bronze held
    assert book.claim_steps("z", 2, at_least=3) == 3  # the call showed three earlier turns
    assert book.claim_steps("z", 1, at_least=1) == 5  # never below what this process gave
    records = [
        BronzeRecord("e1", "chat_completion", "t", 0, b'{"trajectory_uid":"w","step_index":7}'),
        BronzeRecord("e2", "feedback", "t", 0, b'{"trajectory_uid":"w","step_index":9}'),
    ]
    assert wal_steps(records).rows() == [("w", 7)]


def test_the_turns_a_call_shows_are_its_replies_not_a_prefill():
    user, reply = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
    assert turns_shown({"messages": [user]}) == 0
    assert turns_shown({"messages": [user, reply, {"role": "tool"}, reply, user]}) == 2
    assert turns_shown({"messages": [user, reply, user, reply]}) == 1  # the last: prefilled
    assert turns_shown({"prompt": "a legacy completion"}) == 0
