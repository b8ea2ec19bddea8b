"""OTLP/HTTP trace ingestion (`POST /v1/traces`): every span lands in bronze as received.

Agents already traced with OpenTelemetry (the GenAI semantic conventions, OpenInference)
export their spans here unchanged: the official `opentelemetry-exporter-otlp-proto-http`
exporter or a Collector's `otlphttp` exporter pointed at the gateway. A request is an
`ExportTraceServiceRequest` in protobuf (`application/x-protobuf`) or in OTLP's JSON
(`application/json`: trace and span ids in hex), optionally gzip-compressed; each span becomes
one bronze record of kind `span` whose payload is the span with its resource and scope
(docs/DESIGN.md §4), its event id `otel-<trace id>-<span id>`, so an exporter's retry lands
nothing twice; model calls, tool runs and rewards the spans tell of land beside them as
steps, events and feedback (`gateway.traced`), in the same durable batch. Spans without a
valid trace or span id are rejected and counted in the answer's `partial_success`; the others
land. Durable as every write: a 200 means the spans survive a kill.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import zlib
from collections.abc import Iterator
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from gateway.asgi import Answer
from gateway.errors import ERROR_RESPONSES, ApiError
from gateway.genai_spans import TRACE, is_llm_span
from gateway.incoming import Incoming, media_of
from gateway.otlp_json import json_span_payloads
from gateway.proxy.proxied_calls import ProxiedCalls
from gateway.records import BronzeRecord, now_us
from gateway.routes.ingest import land
from gateway.routes.table import Route
from gateway.traced import Tokenizer, derived_records, unread_record

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
SPAN_KIND = "span"  # the bronze record kind of a span
TRACE_ID_BYTES, SPAN_ID_BYTES = 16, 8
SAMPLE_REASONS = 5  # rejections named in `error_message`


def media_type(incoming: Incoming) -> str:
    """The request's media type (415 unless protobuf or JSON)."""
    given = incoming.headers.get("content-type", "")
    media = media_of(given)
    if media not in (PROTOBUF, JSON):
        raise ApiError(
            415,
            f"Content-Type must be {PROTOBUF} or {JSON}, got {given!r}",
            param="Content-Type",
            code="unsupported_media_type",
        )
    return media


def inflated(body: bytes, encoding: str, limit: int) -> bytes:
    """The body with its Content-Encoding undone (gzip or none): 413 when it inflates past
    `limit` bytes, 400 when it is not gzip, 415 for another encoding."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "gzip":
        raise ApiError(
            415,
            f"Content-Encoding must be gzip or identity, got {encoding!r}",
            param="Content-Encoding",
            code="unsupported_encoding",
        )
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ApiError(400, f"body is not valid gzip: {exc}", code="invalid_body") from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise ApiError(413, f"body inflates past the limit of {limit} bytes", code="body_too_large")
    if not inflater.eof:
        raise ApiError(400, "body is truncated gzip", code="invalid_body")
    return out


def decoded(body: bytes, media: str) -> ExportTraceServiceRequest:
    """An ExportTraceServiceRequest from protobuf or OTLP JSON (400 when undecodable)."""
    request = ExportTraceServiceRequest()
    try:
        if media == PROTOBUF:
            request.ParseFromString(body)
        else:
            json_format.ParseDict(_ids_as_base64(json.loads(body)), request, True)
    except (DecodeError, json_format.ParseError, ValueError, TypeError, AttributeError) as exc:
        kind = "protobuf" if media == PROTOBUF else "OTLP JSON"
        raise ApiError(
            400, f"body is not an ExportTraceServiceRequest in {kind}: {exc}", code="invalid_body"
        ) from None
    return request


def _ids_as_base64(document: Any) -> Any:
    """OTLP JSON gives trace and span ids in hex where protobuf's JSON mapping reads base64:
    the ids of every span and link turned into base64 (a bad hex id: ValueError)."""
    for resource_spans in _list(document, "resourceSpans"):
        for scope_spans in _list(resource_spans, "scopeSpans"):
            for span in _list(scope_spans, "spans"):
                _rewrite_ids(span, ("traceId", "spanId", "parentSpanId"))
                for link in _list(span, "links"):
                    _rewrite_ids(link, ("traceId", "spanId"))
    return document


def _snake(key: str) -> str:
    """A lowerCamelCase key's snake_case spelling."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in key)


def _list(document: Any, key: str) -> list:
    """The list under `key`, lowerCamelCase or snake_case (protobuf's mapping reads both)."""
    if not isinstance(document, dict):
        return []
    value = document.get(key, document.get(_snake(key)))
    return value if isinstance(value, list) else []


def _rewrite_ids(item: Any, keys: tuple[str, ...]) -> None:
    if not isinstance(item, dict):
        return
    for key in keys:
        for name in (key, _snake(key)):
            value = item.get(name)
            if isinstance(value, str):
                item[name] = base64.b64encode(bytes.fromhex(value)).decode()


def any_value(value: AnyValue) -> Any:
    """An attribute value as JSON (bytes as base64)."""
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    if which == "bytes_value":
        return base64.b64encode(value.bytes_value).decode()
    return getattr(value, which)


def attributes(pairs: Any) -> dict[str, Any]:
    """Key-value pairs as a JSON object (a repeated key: the last one)."""
    return {pair.key: any_value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


def rejection(number: int, trace_id: bytes, span_id: bytes) -> str:
    """Why span `number` cannot land ("" when it can): its ids."""
    if len(trace_id) != TRACE_ID_BYTES or not any(trace_id):
        return f"span {number}: trace_id must be {TRACE_ID_BYTES} bytes, not zero"
    if len(span_id) != SPAN_ID_BYTES or not any(span_id):
        return f"span {number}: span_id must be {SPAN_ID_BYTES} bytes, not zero"
    return ""


def span_payloads(request: ExportTraceServiceRequest) -> Iterator[tuple[dict | None, str]]:
    """For every span of the request, in order: (its payload, "") when it can land, else
    (None, why)."""
    number = 0
    for resource_spans in request.resource_spans:
        resource = {"attributes": attributes(resource_spans.resource.attributes)}
        for scope_spans in resource_spans.scope_spans:
            scope = {"name": scope_spans.scope.name, "version": scope_spans.scope.version}
            for span in scope_spans.spans:
                number += 1
                why = rejection(number, span.trace_id, span.span_id)
                yield (None, why) if why else (_payload(span, resource, scope), "")


def payloads_of(body: bytes, media: str) -> list[tuple[dict | None, str]]:
    """Every span's payload (or why it cannot land) of a request body: OTLP JSON by the
    msgspec structs when they can (`gateway.otlp_json`), else through protobuf (400 when the
    body does not decode)."""
    if media == JSON:
        fast = json_span_payloads(body, rejection)
        if fast is not None:
            return fast
    return list(span_payloads(decoded(body, media)))


def _payload(span: Any, resource: dict, scope: dict) -> dict:
    """A span as its bronze payload: ids in hex, times in Unix nanoseconds, attributes and
    events as JSON, with its resource and instrumentation scope."""
    return {
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex() or None,
        "name": span.name,
        "kind": int(span.kind),
        "start_time_unix_nano": span.start_time_unix_nano,
        "end_time_unix_nano": span.end_time_unix_nano,
        "attributes": attributes(span.attributes),
        "events": [
            {
                "name": event.name,
                "time_unix_nano": event.time_unix_nano,
                "attributes": attributes(event.attributes),
            }
            for event in span.events
        ],
        "links": [
            {"trace_id": link.trace_id.hex(), "span_id": link.span_id.hex()} for link in span.links
        ],
        "status": {"code": int(span.status.code), "message": span.status.message},
        "resource": resource,
        "scope": scope,
    }


def span_record(payload: dict, tenant: str, received_us: int) -> BronzeRecord:
    """The bronze record of one span."""
    event_id = f"otel-{payload['trace_id']}-{payload['span_id']}"
    body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
    return BronzeRecord(event_id, SPAN_KIND, tenant, received_us, body)


def trajectory_sources(setting: str) -> tuple[str, ...]:
    """CLAW_OTEL_TRAJECTORY_FROM as the attribute names (or `trace`) to try in order."""
    return tuple(part.strip() for part in setting.split(",") if part.strip()) or (TRACE,)


def span_records(
    payloads: list[tuple[dict | None, str]],
    tenant: str,
    tokenizer: Tokenizer,
    sources: tuple[str, ...],
    calls: ProxiedCalls | None = None,
) -> tuple[list[BronzeRecord], list[str]]:
    """Every span's record and the records derived from it (steps, tool turns, rewards), and
    why the spans that cannot land were rejected. Model calls are read first, so that a call
    joined to a proxied step (`calls`) takes its trace's other facts along in one export."""
    received, records, reasons = now_us(), [], []
    landing = [p for p, _ in payloads if p is not None]
    reasons = [why for p, why in payloads if p is None]
    for payload in sorted(landing, key=lambda p: not is_llm_span(p)):
        record = span_record(payload, tenant, received)
        records.append(record)
        try:
            records += derived_records(payload, record.event_id, tenant, tokenizer, sources, calls)
        except Exception as exc:  # the span is kept as received: what it says can be read later
            log.warning("span %s: not read into steps: %s", record.event_id, exc)
            records.append(unread_record(payload, record.event_id, tenant, exc))
    return records, reasons


def answer(media: str, rejected: int, reasons: list[str]) -> Answer:
    """The ExportTraceServiceResponse (with `partial_success` when spans were rejected), in
    the request's media type."""
    response = ExportTraceServiceResponse()
    if rejected:
        response.partial_success.rejected_spans = rejected
        shown = "; ".join(reasons[:SAMPLE_REASONS])
        more = (
            f" (and {len(reasons) - SAMPLE_REASONS} more)" if len(reasons) > SAMPLE_REASONS else ""
        )
        response.partial_success.error_message = shown + more
    if media == PROTOBUF:
        return Answer(200, response.SerializeToString(), media_type=PROTOBUF)
    return Answer(200, json_format.MessageToJson(response, indent=None).encode())


async def export_traces(incoming: Incoming) -> Answer:
    """Export OpenTelemetry spans (OTLP/HTTP); a 200 means every accepted span is durable."""
    tenant = incoming.tenant()
    media = media_type(incoming)
    limit = incoming.services.settings.max_body_bytes
    body = inflated(await incoming.body(), incoming.headers.get("content-encoding", ""), limit)
    services = incoming.services
    sources = trajectory_sources(services.settings.otel_trajectory_from)

    def read() -> tuple[list[BronzeRecord], list[str]]:  # off the event loop: decode, tokenize
        proxy = services.proxy
        payloads = payloads_of(body, media)
        return span_records(payloads, tenant, proxy.local_tokenizer, sources, proxy.proxied_calls)

    records, reasons = await asyncio.to_thread(read)
    if records:
        await land(incoming.services.landing, records)
    return answer(media, len(reasons), reasons)


ROUTES = [
    Route(
        "POST",
        "/v1/traces",
        export_traces,
        "opentelemetry",
        responses=ERROR_RESPONSES,
        media_types=(JSON, PROTOBUF),
    ),
]
