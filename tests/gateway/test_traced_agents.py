"""Agents traced with real OpenTelemetry instrumentation land as steps: the official `openai`
client instrumented by `opentelemetry-instrumentation-openai-v2` (GenAI conventions) or by
`openinference-instrumentation-openai`, exporting over OTLP/HTTP (protobuf, or OTLP JSON as a
Collector sends it) to a started gateway, the simulated model behind it."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path

import httpx
import openai
import polars as pl
import pytest
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.simulation.agents import CALCULATOR_TOOL, Task
from tests.support.servers import OTHER_KEY, TEST_KEY, GatewayProcess, bronze, wait_until
from tests.support.upstreams import SimProcess

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
KEYS = f"{TEST_KEY}=tenant-a,{OTHER_KEY}=tenant-b"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The simulated model, and a gateway proxying to it that takes traces."""
    folder = tmp_path_factory.mktemp("traced")
    with SimProcess(folder) as sim:
        env = {"CLAW_UPSTREAM_URL": sim.url, "CLAW_API_KEYS": KEYS}
        with GatewayProcess(folder / "lake", CLAW_FLUSH_INTERVAL_MS="50", **env) as gateway:
            yield gateway


@pytest.fixture(scope="module")
def tracer(tmp_path_factory):
    """A second gateway that only takes traces (the calls were not proxied by it): it
    tokenizes their messages with the simulated model's own tokenizer."""
    lake = tmp_path_factory.mktemp("traces-only") / "lake"
    env = {"CLAW_API_KEYS": KEYS, "CLAW_TOKENIZER": "bundled"}
    with GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="50", **env) as gateway:
        yield gateway


def instrumented(which: str, provider: TracerProvider, monkeypatch):
    """The openai module instrumented by `which`; call `.uninstrument()` when done."""
    if which == "genai":
        monkeypatch.setenv("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT", "SPAN_ONLY")
        monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", "gen_ai_latest_experimental")
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
    else:
        from openinference.instrumentation.openai import OpenAIInstrumentor
    instrumentor = OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    return instrumentor


def agent(url: str, provider: TracerProvider, seed: int) -> tuple[str, int]:
    """A calculator agent under one `invoke_agent` span: calls until the model answers
    without a tool call, runs each tool call under an `execute_tool` span, and puts its reward
    on the agent span. Its trace id and how many model calls it made."""
    tracer = provider.get_tracer("calculator-agent")
    task = Task.random(random.Random(seed))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TEST_KEY, max_retries=0)
    messages = [
        {"role": "system", "content": "You can use a calculator."},
        {"role": "user", "content": task.question},
    ]
    with tracer.start_as_current_span("invoke_agent calculator") as root:
        root.set_attribute("gen_ai.operation.name", "invoke_agent")
        final, calls = None, 0
        for _ in range(4):
            calls += 1
            reply = (
                client.chat.completions.create(
                    model="claw-sim-llm", messages=messages, tools=[CALCULATOR_TOOL], seed=seed
                )
                .choices[0]
                .message
            )
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                final = reply.content
                break
            for call in reply.tool_calls:
                with tracer.start_as_current_span(f"execute_tool {call.function.name}") as tool:
                    tool.set_attribute("gen_ai.operation.name", "execute_tool")
                    tool.set_attribute("gen_ai.tool.name", call.function.name)
                    tool.set_attribute("gen_ai.tool.call.id", call.id)
                    expression = json.loads(call.function.arguments).get("expression", "")
                    result = str(task.answer) if expression else "no expression"
                    tool.set_attribute("gen_ai.tool.call.result", result)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        root.set_attribute("claw.reward", task.reward(final))
        return f"{root.get_span_context().trace_id:032x}", calls


def exporter(url: str, key: str = TEST_KEY) -> OTLPSpanExporter:
    return OTLPSpanExporter(
        endpoint=f"{url}/v1/traces", headers={"Authorization": f"Bearer {key}"}, timeout=10
    )


def landed_steps(lake: Path, trace: str, calls: int) -> pl.DataFrame:
    """The traced steps of one trace once `calls` of them are in bronze."""

    def found():
        rows = bronze(lake)
        if "trajectory_uid" not in rows.columns:
            return None
        rows = rows.filter(
            (pl.col("kind") == "traced_call") & (pl.col("trajectory_uid") == f"trace-{trace}")
        )
        return rows if rows.height >= calls else None

    return wait_until(found, 20, interval=0.1, what=f"{calls} traced steps").sort("step_index")


def proxied_twins(lake: Path, traced: pl.DataFrame) -> pl.DataFrame:
    """The proxied steps of the same calls (the agent went through the proxy too), in the
    traced steps' order: matched on the upstream's response id."""
    ids = [json.loads(p)["metadata"]["response_id"] for p in traced["payload"]]
    rows = bronze(lake).filter(pl.col("kind") == "chat_completion")
    by_id = {json.loads(p)["response"]["id"]: i for i, p in enumerate(rows["payload"])}
    return rows[[by_id[i] for i in ids]]


@pytest.mark.parametrize("which", ["genai", "openinference"])
def test_an_instrumented_agent_lands_its_calls_tools_and_reward(stack, tracer, which, monkeypatch):
    """The agent calls the model through `stack`'s proxy and exports its spans to `tracer`,
    which never saw the calls: the traced steps, tokenized there, against the proxy's."""
    seed = 11 if which == "genai" else 12
    # the group is the rollout worker's, on its resource: every span of it carries it (a
    # span's ancestors are never consulted: children end, and are exported, first)
    resource = Resource.create({"service.name": "calculator", "claw.prompt_uid": f"pg-{seed}"})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(SimpleSpanProcessor(exporter(tracer.url)))
    instrumentor = instrumented(which, provider, monkeypatch)
    try:
        trace, calls = agent(stack.url, provider, seed)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    assert calls >= 2  # a tool call, then the answer
    steps = landed_steps(tracer.lake, trace, calls)
    assert set(steps["tenant"]) == {"tenant-a"} and set(steps["prompt_uid"]) == {f"pg-{seed}"}
    twins = proxied_twins(stack.lake, steps)
    # every call's reply is the model's own tokens; the prompts too where the span holds all
    # the model saw (OpenInference keeps the tools sent; the GenAI conventions here do not,
    # and those prompts are honestly `local_unverified`, their counts in the metadata)
    assert steps["response_ids"].to_list() == twins["response_ids"].to_list()
    for row, twin in zip(steps.iter_rows(named=True), twins.iter_rows(named=True), strict=True):
        check = json.loads(row["payload"])["metadata"]["token_check"]
        if row["token_source"] == "local":
            assert row["prompt_ids"] == twin["prompt_ids"]
            assert check["prompt_tokens"][0] == check["prompt_tokens"][1]
        else:
            assert row["token_source"] == "local_unverified"
            assert check["prompt_tokens"][0] != check["prompt_tokens"][1]
    if which == "openinference":
        assert set(steps["token_source"]) == {"local"}
    events = bronze(tracer.lake).filter(pl.col("kind") == "event")
    turns = [json.loads(p) for p in events["payload"]]
    turns = [
        t for t in turns if t["type"] == "tool_turn" and t["trajectory_uid"] == f"trace-{trace}"
    ]
    assert len(turns) == calls - 1 and turns[0]["payload"]["name"] == "calculator"
    feedback = bronze(tracer.lake).filter(pl.col("kind") == "feedback")
    rewards = [json.loads(p) for p in feedback["payload"]]
    (reward,) = [r for r in rewards if r["target"].get("trajectory_uid") == f"trace-{trace}"]
    assert reward["kind"] == "reward" and reward["source"] == "trace"

    lake = Lake(str(tracer.lake))
    build_silver(lake)
    silver = lake.read("silver/steps").filter(pl.col("trajectory_uid") == f"trace-{trace}")
    assert silver.height == calls and set(silver["source_kind"]) == {"otel"}
    assert silver.sort("step_index")["step_index"].to_list() == steps["step_index"].to_list()
    trajectories = lake.read("silver/trajectories")
    (mine,) = trajectories.filter(pl.col("trajectory_uid") == f"trace-{trace}").rows(named=True)
    assert mine["num_steps"] == calls


def test_a_call_both_proxied_and_traced_lands_once_with_the_traces_facts(stack, monkeypatch):
    """The agent calls through the proxy and exports its spans to the same gateway: each call
    is its proxied step, once, with the proxy's exact ids; its span names that step (a
    `traced_twin` event), and the trace's tool runs and reward go to the proxied trajectory,
    which silver resolves through stitching."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter(stack.url)))
    instrumentor = instrumented("openinference", provider, monkeypatch)
    try:
        trace, calls = agent(stack.url, provider, seed=31)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()

    def twins():
        events = bronze(stack.lake).filter(pl.col("kind") == "event")
        found = [json.loads(p) for p in events["payload"]]
        found = [e for e in found if e["type"] == "traced_twin"]
        mine = [e for e in found if e["payload"]["otel"]["trace_id"] == trace]
        return mine if len(mine) == calls else None

    joined = wait_until(twins, 20, interval=0.1, what="a traced_twin event per call")
    rows = bronze(stack.lake)
    traced = rows.filter(
        (pl.col("kind") == "traced_call") & (pl.col("trajectory_uid") == f"trace-{trace}")
    )
    assert traced.is_empty()  # no second step of any call
    proxied = rows.filter(pl.col("kind") == "chat_completion")
    keys = {f"{t}:{i}" for t, i in proxied.select("trajectory_uid", "step_index").iter_rows()}
    assert {e["payload"]["step_key"] for e in joined} <= keys
    feedback = [json.loads(p) for p in rows.filter(pl.col("kind") == "feedback")["payload"]]
    (reward,) = [f for f in feedback if f["metadata"]["otel"]["trace_id"] == trace]
    last = max(joined, key=lambda e: e["payload"]["step_key"])  # (uuid7 ids: in time order)
    assert reward["target"] == {"trajectory_uid": last["trajectory_uid"]}

    lake = Lake(str(stack.lake))
    build_silver(lake)
    steps = lake.read("silver/steps")
    origin = {e["payload"]["step_key"] for e in joined}
    mine = steps.filter(
        pl.col("origin_step_key").is_in(list(origin)) | pl.col("step_key").is_in(list(origin))
    )
    assert mine.height == calls and set(mine["source_kind"]) == {"proxy"}
    assert set(mine["token_source"]) == {"upstream"}  # the proxy's exact ids
    (stitched,) = mine["trajectory_uid"].unique().to_list()  # one conversation, stitched
    trajectory = lake.read("silver/trajectories").filter(pl.col("trajectory_uid") == stitched)
    assert trajectory["resolved_return"].to_list() == [reward["value"]]


def collector_json(spans) -> bytes:
    """Spans as a Collector's `otlphttp` exporter sends them with `encoding: json`: OTLP
    JSON, trace and span ids in hex."""
    document = json_format.MessageToDict(encode_spans(spans))
    for resource in document["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(document).encode()


def test_spans_in_any_order_and_several_exports_converge_to_the_same_steps(stack, tmp_path):
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    instrumentor = instrumented("openinference", provider, pytest.MonkeyPatch())
    try:
        agent(stack.url, provider, seed=21)
    finally:
        instrumentor.uninstrument()
        provider.shutdown()
    spans = list(memory.get_finished_spans())
    assert len(spans) >= 4
    built = []
    for name, order in (("in-order", spans), ("reversed", spans[::-1])):
        lake = tmp_path / name / "lake"
        with GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="50", CLAW_TOKENIZER="bundled") as gateway:
            for one in order:  # one export per span, each as JSON, last span first
                answer = httpx.post(
                    f"{gateway.url}/v1/traces",
                    content=collector_json([one]),
                    headers={"Content-Type": "application/json"},
                    timeout=10,
                )
                assert answer.status_code == 200, answer.text
            wait_until(
                lambda lake=lake: (
                    bronze(lake).filter(pl.col("kind") == "span").height == len(spans)
                ),
                20,
                interval=0.1,
                what="every span",
            )
            build_silver(Lake(str(lake)))
        steps = Lake(str(lake)).read("silver/steps")
        built.append(
            steps.select(
                "step_key", "prompt_uid", "token_source", "prompt_len", "response_id"
            ).sort("step_key")
        )
    assert built[0].height == len([s for s in spans if s.name == "ChatCompletion"])
    assert built[0].equals(built[1])


def test_ids_on_the_span_are_used_as_sent_and_no_tokenizer_means_no_step(tmp_path):
    provider = TracerProvider()
    with GatewayProcess(tmp_path / "lake", CLAW_FLUSH_INTERVAL_MS="50") as gateway:
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(f"{gateway.url}/v1/traces"))
        )
        tracer = provider.get_tracer("lightning-agent")
        with tracer.start_as_current_span("openai.chat.completion") as call:
            call.set_attribute("gen_ai.operation.name", "chat")
            call.set_attribute("prompt_token_ids", [5, 6, 7])
            call.set_attribute("response_token_ids", [8, 9])
            call.set_attribute("claw.reward", 1.0)
        with tracer.start_as_current_span("chat m") as untokenizable:
            untokenizable.set_attribute("gen_ai.operation.name", "chat")
            untokenizable.set_attribute(
                "gen_ai.input.messages",
                '[{"role":"user","parts":[{"type":"text","content":"hi"}]}]',
            )
            untokenizable.set_attribute(
                "gen_ai.output.messages",
                '[{"role":"assistant","parts":[{"type":"text","content":"yo"}]}]',
            )
            untokenizable.set_attribute("some.vendor.thing", "ignored")
        provider.shutdown()

        def derived():
            rows = bronze(gateway.lake)
            return rows if rows.filter(pl.col("kind") != "span").height >= 2 else None

        rows = wait_until(derived, 20, interval=0.1, what="derived records")
    (step,) = rows.filter(pl.col("kind") == "traced_call").rows(named=True)
    assert (step["prompt_ids"], step["response_ids"]) == ([5, 6, 7], [8, 9])
    assert step["token_source"] == "client" and step["reward"] == 1.0
    (event,) = [json.loads(p) for p in rows.filter(pl.col("kind") == "event")["payload"]]
    assert event["type"] == "uncaptured_call" and "CLAW_TOKENIZER" in event["payload"]["reason"]
