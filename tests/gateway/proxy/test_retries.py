"""Retry orphans: an agent whose call is retried (the same messages sent again) keeps one
unbroken trajectory; the first attempt is marked `superseded_by` the retry and left out of
gold by default (and kept by a spec that asks for it)."""

from __future__ import annotations

import openai
import polars as pl

from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.materialize.gold import build_partition, candidate_steps, source_versions
from claw_pipelines.materialize.silver import build_silver
from tests.support.servers import GatewayProcess, bronze, wait_until
from tests.support.upstreams import SimProcess, proxy_env

KEY, TENANT = "retry-key", "tenant-retry"


def wait_calls(gateway: GatewayProcess, count: int) -> None:
    """Wait until bronze holds `count` chat completion steps."""
    wait_until(
        lambda: bronze(gateway.lake).filter(pl.col("kind") == "chat_completion").height == count,
        20,
        interval=0.1,
        what=f"{count} calls in bronze",
    )


def test_a_retried_call_supersedes_the_first_attempt_and_the_trajectory_stays_whole(tmp_path):
    with (
        SimProcess(tmp_path) as sim,
        GatewayProcess(tmp_path / "lake", **proxy_env(sim.url, KEY, TENANT)) as gateway,
    ):
        agent = openai.OpenAI(base_url=f"{gateway.url}/t/agent-1/g/task-1/v1", api_key=KEY)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]
        keys = []

        def turn() -> str:
            answer = agent.chat.completions.with_raw_response.create(model="m", messages=messages)
            keys.append(answer.headers["X-Claw-Step-Keys"])
            return answer.parse().choices[0].message.content

        first = turn()
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And 4?"}]
        turn()  # the client times out on this answer...
        retried = turn()  # ...and sends the same messages again
        messages += [{"role": "assistant", "content": retried}, {"role": "user", "content": "5?"}]
        turn()
        wait_calls(gateway, 4)
    lake = Lake(str(tmp_path / "lake"))
    assert keys == [f"agent-1:{i}" for i in range(4)]
    build_silver(lake)
    frame = candidate_steps(lake, source_versions(lake)).sort("step_index")
    assert frame["superseded_by"].to_list() == [None, "agent-1:2", None, None]

    spec = CurationSpec(name="retries", reward_status=["pending", "missing", "final"])
    build_partition(lake, spec, 0)
    kept = open_dataset("retries", lake.uri).steps()["step_key"].sort().to_list()
    assert kept == ["agent-1:0", "agent-1:2", "agent-1:3"]  # one unbroken conversation
    everything = CurationSpec(name="all", reward_status=spec.reward_status, keep_superseded=True)
    build_partition(lake, everything, 0)
    assert open_dataset("all", lake.uri).steps().height == 4
    steps = read_steps(lake, "silver/steps").sort("step_index")
    prompts, responses = steps["prompt_ids"].to_list(), steps["response_ids"].to_list()
    assert prompts[1] == prompts[2]  # the retry repeats the orphan's input
    assert prompts[3][: len(prompts[2]) + len(responses[2])] == prompts[2] + responses[2]


def test_an_unscoped_client_retry_stays_in_the_stitched_trajectory_rollouts_stay_apart(tmp_path):
    with (
        SimProcess(tmp_path) as sim,
        GatewayProcess(tmp_path / "lake", **proxy_env(sim.url, KEY, TENANT)) as gateway,
    ):
        agent = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 3?"}]

        def turn(retry: int = 0) -> str:
            # what OpenAI's SDK sends on its own retries (after a timeout, a 5xx, a 429)
            headers = {"x-stainless-retry-count": str(retry)}
            answer = agent.chat.completions.create(
                model="m", messages=messages, extra_headers=headers
            )
            return answer.choices[0].message.content

        first = turn()
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And 4?"}]
        turn()  # the SDK times out on this answer...
        retried = turn(retry=1)  # ...and sends the same messages again, counting the retry
        messages += [{"role": "assistant", "content": retried}, {"role": "user", "content": "5?"}]
        turn()
        # two rollouts of one prompt (no retry count): a group, not a retry
        rollout = [{"role": "user", "content": "Name a prime."}]
        for _ in range(2):
            agent.chat.completions.create(model="m", messages=rollout)
        wait_calls(gateway, 6)
    lake = Lake(str(tmp_path / "lake"))
    build_silver(lake)
    frame = candidate_steps(lake, source_versions(lake)).sort("trajectory_uid", "step_index")
    conversation = frame.filter(pl.col("trajectory_uid").n_unique().over("prompt_uid") == 1)
    conversation = conversation.filter(pl.len().over("trajectory_uid") == 4)
    assert conversation.height == 4, frame.select("trajectory_uid", "step_index", "prompt_uid")
    uid = conversation["trajectory_uid"][0]
    assert conversation["superseded_by"].to_list() == [None, f"{uid}:2", None, None]
    rollouts = frame.filter(pl.col("trajectory_uid") != uid)
    assert rollouts.height == 2 and rollouts["trajectory_uid"].n_unique() == 2
    assert rollouts["prompt_uid"].n_unique() == 1 and rollouts["superseded_by"].is_null().all()
