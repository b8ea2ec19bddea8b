"""The OpenAI Agents SDK, unchanged, running a two-tool agent through the gateway's
`/v1/responses` in front of a real `claw sim-llm`: the agent's loop (model call, tool,
model call with the tool's output) lands one step per model call with exact ids, the turns
nest, and silver holds the trajectory whole."""

from __future__ import annotations

import itertools
import uuid

import polars as pl
import pytest

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import build_silver
from tests.support.ingest import trajectory_rows
from tests.support.servers import GatewayProcess
from tests.support.upstreams import SimProcess, proxy_env

agents = pytest.importorskip("agents")

KEY = "agents-sdk-key"
TENANT = "tenant-agents"
MODEL = "claw-sim-llm"


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    with SimProcess(tmp_path_factory.mktemp("sim"), latency_ms=10) as sim:
        lake = tmp_path_factory.mktemp("agents") / "lake"
        env = proxy_env(sim.url, KEY, TENANT, CLAW_TOKEN_IN="auto")
        with GatewayProcess(lake, **env) as server:
            yield server


def test_a_two_tool_agent_runs_unchanged_and_lands_one_whole_trajectory(gw):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI otherwise
    used: list[str] = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        used.append("calculator")
        left, right = (int(x) for x in expression.split("+"))
        return str(left + right)

    @agents.function_tool
    def weather(city: str) -> str:
        """Today's weather in a city."""
        used.append("weather")
        return f"sunny in {city}"

    for attempt in range(20):  # the simulated model calls a tool when it likes (auto)
        trajectory = f"agent-{uuid.uuid4().hex[:8]}"
        client = AsyncOpenAI(
            base_url=f"{gw.url}/t/{trajectory}/g/agents/v1", api_key=KEY, max_retries=0
        )
        agent = agents.Agent(
            name="assistant",
            instructions="Use the tools to answer.",
            tools=[calculator, weather],
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        )
        used.clear()
        result = agents.Runner.run_sync(agent, f"What is 12 + {attempt}?", max_turns=6)
        if used:
            break
    assert used, "the simulated model never called a tool in 20 runs"
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert calls and len(outputs) == len(calls)
    assert isinstance(result.final_output, str)
    model_calls = len(result.raw_responses)
    assert model_calls >= 2  # a tool call, then the answer with the tool's output

    steps = trajectory_rows(gw, trajectory, model_calls)
    assert [s["step_index"] for s in steps] == list(range(model_calls))
    assert [s["payload"]["response"]["id"] for s in steps] == [
        r.response_id for r in result.raw_responses
    ]
    assert all(s["token_source"] == "upstream" for s in steps)
    for parent, child in itertools.pairwise(steps):
        sequence = list(parent["prompt_ids"]) + list(parent["response_ids"])
        assert list(child["prompt_ids"])[: len(sequence)] == sequence  # turns nest

    build_silver(Lake(str(gw.lake)))
    silver = pl.read_delta(str(gw.lake / "silver" / "steps")).filter(
        pl.col("trajectory_uid") == trajectory
    )
    assert silver.sort("step_index")["step_index"].to_list() == list(range(model_calls))
    trajectories = pl.read_delta(str(gw.lake / "silver" / "trajectories")).filter(
        pl.col("trajectory_uid") == trajectory
    )
    assert trajectories["num_steps"].to_list() == [model_calls]
