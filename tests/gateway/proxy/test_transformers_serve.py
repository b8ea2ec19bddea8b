"""A real third-party server behind the gateway: `transformers serve` runs a tiny random Qwen2
(its folder built here: the bundled vocabulary, a ChatML template, Qwen2's own tokenizer
class, which pre-tokenizes otherwise than the folder's tokenizer.json), the official OpenAI
SDK talks through the gateway. The server returns no token ids and no log-probs, answers
one choice for n=2 and never sends `[DONE]`: every call lands once, prompt ids equal
AutoTokenizer's, each step's label says whether its local ids match the server's own
counts, no phantom step, and the gateway refuses to start without the model's tokenizer.
The OpenAI Responses and Anthropic Messages dialects, translated to this server's chat
completions, land the same ids and labels (plain and streamed)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from types import SimpleNamespace

import anthropic
import openai
import polars as pl
import pytest
from transformers import AutoTokenizer

from claw_pipelines.app.processes import TransformersServe
from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.interop.export import export
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.simulation.model_folders import tiny_model_folder
from claw_pipelines.tokenization import server_messages
from tests.support.servers import REPO, GatewayProcess, bronze, wait_landed, wait_until
from tests.support.upstreams import proxy_env

pytestmark = pytest.mark.slow
KEY = "real-server-key"
QUESTION = [{"role": "user", "content": "Count 12345 then say 678."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformers-serve")
    model = tiny_model_folder(root / "tiny-qwen2")
    with TransformersServe(model, root) as server:
        yield server


@pytest.fixture(scope="module")
def gateway(served, tmp_path_factory):
    lake = tmp_path_factory.mktemp("real-server") / "lake"
    env = proxy_env(served.base_url, KEY, "t", CLAW_TOKENIZER=served.model, CLAW_TOKEN_IN="auto")
    with GatewayProcess(lake, **env) as server:
        yield server


@pytest.fixture(scope="module")
def truth(served):
    return AutoTokenizer.from_pretrained(served.model)


def _client(gateway, base: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + base, api_key=KEY, max_retries=0)


def _rows(gateway, keys: list[str]) -> pl.DataFrame:
    """The bronze step rows of these idempotency keys (one per choice), in key order."""
    landed = wait_landed(gateway.lake, keys)
    return landed.sort(pl.col("event_id").replace({k: i for i, k in enumerate(keys)}))


def _check_labels(row: dict, usage) -> None:
    """A step's label is the truth about its ids: `local` exactly when its prompt and reply
    lengths are the server's own counts; the counts sit in its metadata either way."""
    metadata = json.loads(row["payload"])["metadata"]
    local = (len(row["prompt_ids"]), len(row["response_ids"]))
    server = (usage.prompt_tokens, usage.completion_tokens)
    assert metadata["token_check"] == {
        "prompt_tokens": [local[0], server[0]],
        "completion_tokens": [local[1], server[1]],
    }
    assert row["token_source"] == ("local" if local == server else "local_unverified")
    assert row["rollout_log_probs"] is None and metadata["log_probs"] is False


def test_the_gateway_will_not_guess_ids_for_a_real_server_without_its_tokenizer(served, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", "gateway", "--port", "0"],
        cwd=REPO,
        env={"CLAW_UPSTREAM_URL": served.base_url, "CLAW_LAKE_URI": str(tmp_path / "lake")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    (line,) = done.stderr.strip().splitlines()
    assert "returns no token ids (it refuses return_token_ids)" in line
    assert "set CLAW_TOKENIZER" in line


def test_plain_calls_land_once_with_autotokenizers_prompt_ids(gateway, served, truth):
    client, keys, usages = _client(gateway), [], []
    for seed in range(4):
        keys.append(f"plain-{uuid.uuid4().hex}")
        raw = client.chat.completions.with_raw_response.create(
            model=served.model,
            messages=QUESTION,
            max_tokens=24,
            seed=seed,
            extra_headers={"Idempotency-Key": keys[-1]},
        )
        answer = raw.parse()
        usages.append(answer.usage)
        assert raw.headers["X-Claw-Step-Keys"].count(",") == 0
        assert answer.choices[0].message.content is not None
    rows = _rows(gateway, keys)
    assert rows.height == len(keys)  # once each
    expected = truth.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    for row, usage in zip(rows.iter_rows(named=True), usages, strict=True):
        assert row["prompt_ids"] == list(expected)
        assert len(row["prompt_ids"]) == usage.prompt_tokens  # the server's own count
        _check_labels(row, usage)


def test_a_stream_without_done_lands_what_arrived_and_names_its_step_key(gateway, served):
    key = f"stream-{uuid.uuid4().hex}"
    client = _client(gateway)
    with client.chat.completions.with_streaming_response.create(
        model=served.model,
        messages=QUESTION,
        max_tokens=16,
        stream=True,
        n=2,  # this server answers one choice: no second, phantom step may appear
        extra_headers={"Idempotency-Key": key},
    ) as response:
        step_keys = response.headers["X-Claw-Step-Keys"].split(",")
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert all(c.usage is None for c in chunks)  # the usage the gateway asked for is its own
    assert len(step_keys) == 2  # assigned as the stream opened, one per choice asked for
    row = _rows(gateway, [key]).row(0, named=True)
    payload = json.loads(row["payload"])
    assert f"{payload['trajectory_uid']}:{payload['step_index']}" == step_keys[0]
    assert payload["response"]["choices"][0]["message"]["content"] == text
    assert payload["finish_reason"] in ("stop", "length")  # finished, not cut
    steps = bronze(gateway.lake).filter(pl.col("event_id").str.starts_with(key))
    assert steps.height == 1
    check = payload["metadata"]["token_check"]
    assert check["completion_tokens"][1] is not None  # the stream's usage was read


def test_log_probs_asked_and_not_given_say_so(gateway, served):
    key = f"logprobs-{uuid.uuid4().hex}"
    answer = _client(gateway).chat.completions.create(
        model=served.model,
        messages=QUESTION,
        max_tokens=8,
        logprobs=True,
        extra_headers={"Idempotency-Key": key},
    )
    row = _rows(gateway, [key]).row(0, named=True)
    _check_labels(row, answer.usage)


def test_legacy_completions_tokenize_the_prompt_as_the_model_does(gateway, served, truth):
    key = f"completion-{uuid.uuid4().hex}"
    prompt = "The trainer read 12345 steps."
    answer = _client(gateway).completions.create(
        model=served.model, prompt=prompt, max_tokens=8, extra_headers={"Idempotency-Key": key}
    )
    row = _rows(gateway, [key]).row(0, named=True)
    assert row["kind"] == "completion"
    assert row["prompt_ids"] == truth(prompt, add_special_tokens=False)["input_ids"]
    _check_labels(row, answer.usage)


def test_a_scoped_conversation_numbers_its_turns(gateway, served, truth):
    trajectory = f"traj-{uuid.uuid4().hex[:8]}"
    client = _client(gateway, f"/t/{trajectory}/g/group-1/v1")
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    keys, usages = [], []
    for turn in range(3):
        keys.append(f"turn-{uuid.uuid4().hex}")
        raw = client.chat.completions.with_raw_response.create(
            model=served.model,
            messages=messages,
            max_tokens=12,
            extra_headers={"Idempotency-Key": keys[-1]},
        )
        assert raw.headers["X-Claw-Step-Keys"] == f"{trajectory}:{turn}"
        answer = raw.parse()
        usages.append(answer.usage)
        messages = [
            *messages,
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": f"And then {turn}?"},
        ]
    rows = _rows(gateway, keys)
    for turn, (row, usage) in enumerate(zip(rows.iter_rows(named=True), usages, strict=True)):
        payload = json.loads(row["payload"])
        assert (payload["trajectory_uid"], payload["step_index"]) == (trajectory, turn)
        sent = payload["request"]["messages"]
        expected = truth.apply_chat_template(
            server_messages(sent), add_generation_prompt=True, return_dict=False
        )
        assert row["prompt_ids"] == list(expected)
        assert "token_in" not in payload["metadata"]  # the server cannot take token ids
        _check_labels(row, usage)


def test_the_conversation_exports_in_the_models_own_language(served, tmp_path):
    # a lake of its own: the other tests' legacy completions are no chats to export
    env = proxy_env(served.base_url, KEY, "t", CLAW_TOKENIZER=served.model)
    with GatewayProcess(tmp_path / "lake", **env) as gateway:
        _export_a_conversation(gateway, served, tmp_path)


def _export_a_conversation(gateway, served, tmp_path) -> None:
    trajectory = f"export-{uuid.uuid4().hex[:8]}"
    client = _client(gateway, f"/t/{trajectory}/g/{trajectory}/v1")
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION]
    keys, sent = [], []
    for turn in range(2):
        keys.append(f"export-{uuid.uuid4().hex}")
        answer = client.chat.completions.create(
            model=served.model,
            messages=messages,
            max_tokens=12,
            extra_headers={"Idempotency-Key": keys[-1]},
        )
        reply = {"role": "assistant", "content": answer.choices[0].message.content}
        sent.append([*messages, reply])
        messages = [*messages, reply, {"role": "user", "content": f"Go on, {turn}."}]
    _rows(gateway, keys)
    lake = Lake(str(gateway.lake))
    build_silver(lake)
    spec = CurationSpec(name="as-served", reward_status=["final", "missing", "pending"])
    save_spec(lake, spec)
    build_partition(lake, spec, 0)
    out = tmp_path / "sft.jsonl"
    export(open_dataset("as-served", lake.uri), 0, "sft-messages", out)
    records = {r["step_key"]: r for r in map(json.loads, out.read_text().splitlines())}
    for turn, conversation in enumerate(sent):
        record = records[f"{trajectory}:{turn}"]
        assert record["messages"] == conversation  # what was sent, and the reply received
        assert record["decoded_with"]["name"] == served.model


def _server_counts(input_tokens: int, output_tokens: int) -> SimpleNamespace:
    """A Responses or Messages usage in the chat shape `_check_labels` reads."""
    return SimpleNamespace(prompt_tokens=input_tokens, completion_tokens=output_tokens)


def _check_translated(gateway, truth, keys: list[str], usages: list, protocol: str) -> None:
    """Each call of another protocol landed once, with the ids of the conversation it was
    translated to (the system prompt and the question) and its label."""
    rows = _rows(gateway, keys)
    assert rows.height == len(keys)  # once each, no phantom step
    system_and_user = [{"role": "system", "content": "Be brief."}, *QUESTION]
    expected = truth.apply_chat_template(
        system_and_user, add_generation_prompt=True, return_dict=False
    )
    for row, usage in zip(rows.iter_rows(named=True), usages, strict=True):
        assert row["prompt_ids"] == list(expected)
        assert json.loads(row["payload"])["metadata"]["protocol"] == protocol
        _check_labels(row, usage)


def test_a_responses_call_reaches_the_real_server_and_lands_its_ids(gateway, served, truth):
    keys, usages = [f"responses-{uuid.uuid4().hex}", f"responses-{uuid.uuid4().hex}"], []
    answer = _client(gateway).responses.create(
        model=served.model,
        instructions="Be brief.",
        input=QUESTION[0]["content"],
        max_output_tokens=12,
        extra_headers={"Idempotency-Key": keys[0]},
    )
    assert answer.output_text  # the server's reply, translated into Responses items
    usages.append(_server_counts(answer.usage.input_tokens, answer.usage.output_tokens))
    with _client(gateway).responses.stream(
        model=served.model,
        instructions="Be brief.",
        input=QUESTION[0]["content"],
        max_output_tokens=12,
        extra_headers={"Idempotency-Key": keys[1]},
    ) as stream:
        events = list(stream)
    # a reply cut at max_output_tokens ends `response.incomplete`, as OpenAI's does
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert final.output_text == "".join(deltas)  # the streamed text is the final text
    usages.append(_server_counts(final.usage.input_tokens, final.usage.output_tokens))
    _check_translated(gateway, truth, keys, usages, "responses")


def test_a_messages_call_reaches_the_real_server_and_lands_its_ids(gateway, served, truth):
    agent = anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
    keys, usages = [f"messages-{uuid.uuid4().hex}", f"messages-{uuid.uuid4().hex}"], []
    body = {"model": served.model, "max_tokens": 12, "system": "Be brief.", "messages": QUESTION}
    answer = agent.messages.create(**body, extra_headers={"Idempotency-Key": keys[0]})
    assert answer.type == "message" and answer.content[0].text
    usages.append(_server_counts(answer.usage.input_tokens, answer.usage.output_tokens))
    with agent.messages.stream(**body, extra_headers={"Idempotency-Key": keys[1]}) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.stop_reason in ("end_turn", "max_tokens")
    usages.append(_server_counts(final.usage.input_tokens, final.usage.output_tokens))
    _check_translated(gateway, truth, keys, usages, "messages")


def test_a_traced_call_lands_the_ids_the_model_gives_its_messages(gateway, served, truth, tmp_path):
    """An agent instrumented with OpenInference calls through the proxy and exports its spans
    to a gateway that takes traces only (with the model's tokenizer): the step read from its
    span carries the ids the model's own tokenizer gives its messages (the same the proxy
    computed for the same call), labelled as the proxy labels them."""
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    traces_only = GatewayProcess(
        tmp_path / "traces", CLAW_TOKENIZER=served.model, CLAW_API_KEYS=f"{KEY}=t"
    )
    with traces_only as traces:
        exporter = OTLPSpanExporter(
            endpoint=f"{traces.url}/v1/traces", headers={"Authorization": f"Bearer {KEY}"}
        )
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        instrumentor = OpenAIInstrumentor()
        instrumentor.instrument(tracer_provider=provider)
        key = f"traced-{uuid.uuid4().hex}"
        tracer = provider.get_tracer("agent")
        try:
            with tracer.start_as_current_span("invoke_agent") as root:
                answer = _client(gateway).chat.completions.create(
                    model=served.model,
                    messages=QUESTION,
                    max_tokens=8,
                    extra_headers={"Idempotency-Key": key},
                )
                trace = f"trace-{root.get_span_context().trace_id:032x}"
        finally:
            instrumentor.uninstrument()
            provider.shutdown()
        proxied = _rows(gateway, [key]).row(0, named=True)

        def traced():
            rows = bronze(traces.lake).filter(
                (pl.col("kind") == "traced_call") & (pl.col("trajectory_uid") == trace)
            )
            return rows if rows.height else None

        (step,) = wait_until(traced, 20, interval=0.1, what="the traced step").rows(named=True)
    expected = truth.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=False)
    assert step["prompt_ids"] == list(expected) == proxied["prompt_ids"]
    assert step["response_ids"] == proxied["response_ids"]
    metadata = json.loads(step["payload"])["metadata"]
    assert metadata["response_id"] == answer.id
    _check_labels(step, answer.usage)
