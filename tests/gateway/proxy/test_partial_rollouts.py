"""Partial rollouts through the proxy, with the official `openai` client in front of a real
`claw sim-llm`: a call the model aborts mid-generation lands with its tokens, log-probs and
policy version, and its continuation (the prompt's ids plus the partial reply's, token in,
under the next policy version) is joined to it in silver into one step whose response is
exactly what the model sampled, with policy-version runs [v, v + 1]; one never continued is
left out of gold once its trajectory ended and counted discarded by the waste ledger."""

from __future__ import annotations

import uuid

import httpx
import numpy as np
import openai
import polars as pl
import pytest

from claw_pipelines.contracts.specs import DEFAULT_SPEC
from claw_pipelines.contracts.tables import SILVER_STEPS, gold_rejection_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.ops.ledger import waste_ledger
from claw_pipelines.simulation.agents import Tally, Task, partial_rollout
from tests.support.servers import GatewayProcess, bronze, wait_landed, wait_until
from tests.support.upstreams import SimProcess, proxy_env

KEY = "partial-test-key"
TENANT = "tenant-partial"
QUESTION = [{"role": "user", "content": "What is 12 + 7?"}]


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    with SimProcess(tmp_path_factory.mktemp("sim"), latency_ms=20) as server:
        yield server


@pytest.fixture(scope="module")
def gw(sim, tmp_path_factory):
    lake = tmp_path_factory.mktemp("partial") / "lake"
    with GatewayProcess(lake, **proxy_env(sim.url, KEY, TENANT)) as server:
        yield server


def silver_steps(gw: GatewayProcess, trajectory: str) -> list[dict]:
    """The trajectory's silver steps after a silver run over what bronze holds."""
    lake = Lake(str(gw.lake))
    build_silver(lake)
    steps = read_steps(lake, SILVER_STEPS).filter(pl.col("trajectory_uid") == trajectory)
    return steps.sort("step_index").to_dicts()


def test_an_aborted_call_and_its_token_in_continuation_are_one_step(gw, sim):
    trajectory, version = f"pr-{uuid.uuid4().hex[:8]}", 7
    events = [f"e-{uuid.uuid4().hex}" for _ in range(2)]
    base = f"{gw.url}/t/{trajectory}/g/q-{trajectory}/v1"
    with (
        openai.OpenAI(base_url=base, api_key=KEY, max_retries=0) as client,
        openai.OpenAI(base_url=sim.url, api_key="none", max_retries=0) as direct,
    ):
        whole = direct.chat.completions.create(
            model="claw-sim-llm",
            messages=QUESTION,
            logprobs=True,
            extra_body={"return_token_ids": True},
        ).choices[0]
        cut = client.chat.completions.with_raw_response.create(
            model="claw-sim-llm",
            messages=QUESTION,
            extra_headers={"X-Claw-Policy-Version": str(version), "Idempotency-Key": events[0]},
            extra_body={"return_token_ids": True, "abort_after_tokens": 3},
        )
        first = cut.parse()
        partial = first.choices[0]
        assert partial.finish_reason == "abort" and partial.token_ids == whole.token_ids[:3]
        prompt = [*first.model_extra["prompt_token_ids"], *partial.token_ids]
        rest = client.completions.with_raw_response.create(
            model="claw-sim-llm",
            prompt=prompt,
            extra_headers={"X-Claw-Policy-Version": str(version + 1), "Idempotency-Key": events[1]},
            extra_body={"return_token_ids": True},
        )
    keys = [cut.headers["x-claw-step-keys"], rest.headers["x-claw-step-keys"]]
    assert keys == [f"{trajectory}:0", f"{trajectory}:1"]
    landed = {r["event_id"]: r for r in wait_landed(gw.lake, events).to_dicts()}
    aborted = landed[events[0]]  # the partial lands with its tokens, log-probs and version
    assert aborted["finish_reason"] == "abort" and aborted["policy_version"] == version
    assert aborted["response_ids"] == whole.token_ids[:3]
    sampled = np.asarray([t.logprob for t in whole.logprobs.content], dtype=np.float32)
    assert aborted["rollout_log_probs"] == sampled[:3].tolist()

    (row,) = silver_steps(gw, trajectory)
    assert row["step_key"] == keys[1] and row["policy_version"] == version + 1
    assert row["prompt_ids"] == first.model_extra["prompt_token_ids"]
    assert row["response_ids"] == whole.token_ids  # exactly the answer the model sampled
    assert row["rollout_log_probs"] == sampled.tolist()
    assert row["policy_version_runs"] == [version, version + 1]
    assert row["policy_run_lengths"] == [3, len(whole.token_ids) - 3]
    assert row["partial_step_keys"] == [keys[0]] and row["partial_event_ids"] == events[:1]
    assert row["token_source"] == "upstream" and row["finish_reason"] == "stop"


def test_the_simulated_rollout_worker_resumes_its_aborted_request(gw):
    tally = Tally()
    trajectory = partial_rollout(
        gw.url, KEY, Task("What is 12 + 7?", 19), "worker", 3, tally, abort_after=2
    )
    assert tally.steps == 2 and tally.trajectories == 1

    def landed() -> bool:
        rows = bronze(gw.lake).filter(pl.col("kind").is_in(["chat_completion", "completion"]))
        return rows.filter(pl.col("trajectory_uid") == trajectory).height == 2  # both calls

    wait_until(landed, 20, interval=0.1, what="the worker's two calls in bronze")
    (row,) = silver_steps(gw, trajectory)
    assert row["policy_version_runs"] == [3, 4] and row["policy_run_lengths"][0] == 2
    assert row["partial_step_keys"] == [f"{trajectory}:0"]


def test_an_aborted_call_never_continued_is_counted_discarded_by_the_ledger(gw):
    trajectory, event = f"gone-{uuid.uuid4().hex[:8]}", f"e-{uuid.uuid4().hex}"
    base = f"{gw.url}/t/{trajectory}/g/q-{trajectory}/v1"
    with openai.OpenAI(base_url=base, api_key=KEY, max_retries=0) as client:
        cut = client.chat.completions.create(
            model="claw-sim-llm",
            messages=QUESTION,
            extra_headers={"X-Claw-Policy-Version": "5", "Idempotency-Key": event},
            extra_body={"abort_after_tokens": 4},
        )
    assert cut.choices[0].finish_reason == "abort"
    done = httpx.post(  # the worker gave up on it: the trajectory ends
        f"{gw.url}/v1/trajectories/{trajectory}/complete",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"reward": 0.0},
        timeout=30,
    )
    done.raise_for_status()
    wait_landed(gw.lake, [event, *done.json()["event_ids"]])
    lake = Lake(str(gw.lake))
    build_silver(lake)
    build_partition(lake, DEFAULT_SPEC, 5)
    rejected = lake.read(gold_rejection_table("default")).filter(
        pl.col("step_key").str.starts_with(trajectory)
    )
    assert rejected.select("step_key", "reason").rows() == [(f"{trajectory}:0", "aborted")]
    ledger = waste_ledger(lake, ["default"]).filter(
        (pl.col("policy_version") == 5) & (pl.col("reason") == "aborted")
    )
    assert ledger.select("outcome", "steps", "generated_tokens").rows() == [("rejected", 1, 4)]
