"""POST /v1/traces: OpenTelemetry's own exporter and OTLP JSON land spans in bronze, durably,
each once, under the key's tenant; bad bodies get OTLP/HTTP's statuses and land nothing."""

from __future__ import annotations

import gzip
import json

import httpx
import polars as pl
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import build_silver
from tests.support.servers import OTHER_KEY, TEST_KEY, GatewayProcess, bronze, wait_landed

TRACE = "5b8efff798038103d269b633813fc60c"


def traced(url: str, key: str | None, compression=Compression.NoCompression) -> list[str]:
    """A chat span and a tool span under it, exported by the SDK's own OTLP/HTTP exporter to
    `url`; their event ids."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    exporter = OTLPSpanExporter(
        endpoint=f"{url}/v1/traces", headers=headers, compression=compression, timeout=10
    )
    provider = TracerProvider(resource=Resource.create({"service.name": "coding-agent"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("agent", "1.0")
    ids = []
    with tracer.start_as_current_span("chat small-model") as chat:
        chat.set_attribute("gen_ai.operation.name", "chat")
        chat.set_attribute("gen_ai.request.model", "small-model")
        chat.set_attribute("gen_ai.usage.input_tokens", 12)
        chat.set_attribute("claw.reward", 1.0)
        with tracer.start_as_current_span("execute_tool bash") as tool:
            tool.set_attribute("gen_ai.operation.name", "execute_tool")
            tool.add_event("gen_ai.tool.message", {"content": "ok"})
            ids.append(_event_id(tool))
        ids.append(_event_id(chat))
    provider.shutdown()
    return ids


def _event_id(span) -> str:
    context = span.get_span_context()
    return f"otel-{context.trace_id:032x}-{context.span_id:016x}"


def json_body(spans: list[dict]) -> bytes:
    """An OTLP JSON request (hex ids, camelCase) holding `spans`."""
    resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "bot"}}]}
    scope = {"scope": {"name": "manual"}, "spans": spans}
    return json.dumps({"resourceSpans": [{"resource": resource, "scopeSpans": [scope]}]}).encode()


def span(span_id: str, **extra) -> dict:
    return {
        "traceId": TRACE,
        "spanId": span_id,
        "name": "chat",
        "kind": 3,
        "startTimeUnixNano": "1700000000000000000",
        "endTimeUnixNano": "1700000001000000000",
        "attributes": [{"key": "gen_ai.operation.name", "value": {"stringValue": "chat"}}],
        **extra,
    }


def post(url: str, body: bytes, media: str, key: str | None = TEST_KEY, **headers: str):
    sent = {"Content-Type": media, **headers}
    if key:
        sent["Authorization"] = f"Bearer {key}"
    return httpx.post(f"{url}/v1/traces", content=body, headers=sent, timeout=10)


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_the_official_exporter_lands_every_span_under_its_tenant(secured_gateway, compression):
    ids = traced(secured_gateway.url, TEST_KEY, compression)
    rows = wait_landed(secured_gateway.lake, ids).sort("event_id")
    assert set(rows["kind"]) == {"span"} and set(rows["tenant"]) == {"tenant-a"}
    payloads = {json.loads(p)["name"]: json.loads(p) for p in rows["payload"]}
    chat, tool = payloads["chat small-model"], payloads["execute_tool bash"]
    assert chat["attributes"]["gen_ai.usage.input_tokens"] == 12
    assert chat["attributes"]["claw.reward"] == 1.0
    assert chat["resource"]["attributes"]["service.name"] == "coding-agent"
    assert chat["scope"] == {"name": "agent", "version": "1.0"}
    assert tool["parent_span_id"] == chat["span_id"] and tool["trace_id"] == chat["trace_id"]
    assert tool["events"][0]["attributes"] == {"content": "ok"}


def test_a_stranger_is_refused_and_another_tenant_lands_as_itself(secured_gateway):
    stranger = post(
        secured_gateway.url, json_body([span("00000000000000a1")]), "application/json", None
    )
    assert stranger.status_code == 401
    other = post(
        secured_gateway.url, json_body([span("00000000000000b1")]), "application/json", OTHER_KEY
    )
    assert other.status_code == 200, other.text
    (row,) = wait_landed(secured_gateway.lake, [f"otel-{TRACE}-00000000000000b1"]).rows(named=True)
    assert row["tenant"] == "tenant-b"
    assert f"otel-{TRACE}-00000000000000a1" not in set(bronze(secured_gateway.lake)["event_id"])


def test_otlp_json_with_hex_ids_and_partial_success_naming_what_was_rejected(secured_gateway):
    body = json_body(
        [span("00000000000000c1"), span("0000000000000000"), span("00000000000000c2", traceId="")]
    )
    answer = post(secured_gateway.url, body, "application/json")
    assert answer.status_code == 200, answer.text
    partial = answer.json()["partialSuccess"]
    assert partial["rejectedSpans"] == "2"  # int64 as a string, as OTLP JSON writes it
    assert "span 2: span_id must be 8 bytes" in partial["errorMessage"]
    assert "span 3: trace_id must be 16 bytes" in partial["errorMessage"]
    rows = wait_landed(secured_gateway.lake, [f"otel-{TRACE}-00000000000000c1"])
    assert json.loads(rows["payload"][0])["start_time_unix_nano"] == 1700000000000000000
    # the same export again (an exporter's retry) lands nothing twice
    assert post(secured_gateway.url, body, "application/json").status_code == 200
    again = bronze(secured_gateway.lake).filter(
        pl.col("event_id").str.ends_with("00000000000000c1")
    )
    assert again.height == 1


def test_protobuf_answers_in_protobuf(secured_gateway):
    request = ExportTraceServiceRequest()
    spans = request.resource_spans.add().scope_spans.add().spans
    spans.add(trace_id=bytes.fromhex(TRACE), span_id=bytes.fromhex("00000000000000d1"), name="x")
    spans.add(trace_id=b"short", span_id=bytes.fromhex("00000000000000d2"), name="y")
    answer = post(secured_gateway.url, request.SerializeToString(), "application/x-protobuf")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith(
        "application/x-protobuf"
    )
    response = ExportTraceServiceResponse.FromString(answer.content)
    assert response.partial_success.rejected_spans == 1
    wait_landed(secured_gateway.lake, [f"otel-{TRACE}-00000000000000d1"])


def test_bad_bodies_get_otlp_statuses_and_land_nothing(secured_gateway):
    url, before = secured_gateway.url, bronze(secured_gateway.lake).height
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.add(
        trace_id=bytes.fromhex(TRACE), span_id=bytes.fromhex("00000000000000e1"), name="z" * 50
    )
    truncated = post(url, request.SerializeToString()[:-20], "application/x-protobuf")
    assert truncated.status_code == 400 and "protobuf" in truncated.json()["error"]["message"]
    assert post(url, b"{not json", "application/json").status_code == 400
    bad_hex = post(url, json_body([span("zz")]), "application/json")
    assert bad_hex.status_code == 400
    wrong_type = post(url, b"spans", "text/plain")
    assert wrong_type.status_code == 415
    assert "application/x-protobuf" in wrong_type.json()["error"]["message"]
    not_gzip = post(url, b"plain", "application/json", **{"Content-Encoding": "gzip"})
    assert not_gzip.status_code == 400
    brotli = post(url, b"x", "application/json", **{"Content-Encoding": "br"})
    assert brotli.status_code == 415
    bomb = gzip.compress(b" " * (32 * 2**20 + 1))  # inflates past CLAW_MAX_BODY_BYTES
    assert post(url, bomb, "application/json", **{"Content-Encoding": "gzip"}).status_code == 413
    unknown = json_body([span("00000000000000e2", droppedAttributesCount=3, somethingNew=1)])
    assert post(url, unknown, "application/json").status_code == 200  # unknown fields ignored
    wait_landed(secured_gateway.lake, [f"otel-{TRACE}-00000000000000e2"])
    assert bronze(secured_gateway.lake).height == before + 1
    assert httpx.get(f"{url}/readyz").status_code == 200


def test_an_acknowledged_export_survives_kill_9_and_silver_passes_spans_by(tmp_path):
    lake = tmp_path / "lake"
    # a long flush interval: the spans are in the write-ahead log only when the kill comes
    server = GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="60000").start()
    try:
        ids = traced(server.url, None)
        server.kill()
        assert bronze(lake).height == 0
        server.start()
        rows = wait_landed(lake, ids)
    finally:
        server.stop()
    assert rows.height == 2
    # what the spans told of landed in the same acknowledged batch: the tool run, the reward
    derived = bronze(lake).filter(pl.col("kind") != "span")
    assert sorted(derived["kind"]) == ["event", "feedback"]
    # a chat span without messages or ids is no step: silver passes the spans by
    run = build_silver(Lake(str(lake)))
    assert run.bronze_version is not None and run.steps_added == 0
    assert Lake(str(lake)).read("silver/steps").height == 0
