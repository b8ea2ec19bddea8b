"""OTLP JSON trace exports decoded at wire speed: typed msgspec structs, straight into the span
payloads `gateway.routes.otlp` lands (the protobuf path's, value for value).

OTLP's JSON (lowerCamelCase keys, trace and span ids in hex, 64-bit integers as strings or
numbers, enums as integers) is decoded by these structs without going through protobuf's JSON
mapping, which took ~16x the protobuf path's time on the same spans. They accept a subset of
what that mapping accepts: a body they refuse, or one with snake_case keys (the mapping's other
spelling, which the structs would ignore as unknown), returns None and goes the protobuf way,
which lands it or names what is wrong. `tests/gateway/test_otlp_json.py` holds both paths to
the same payloads.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import msgspec
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanMessage
from opentelemetry.proto.trace.v1.trace_pb2 import Status as StatusMessage

Int64 = int | str  # OTLP JSON writes 64-bit integers as strings; numbers are read too
# the snake_case spellings of the keys read here (a quoted one can only be a key, or an
# attribute named so: the protobuf path then reads the body, as it reads any spelling)
_SNAKE_KEYS = tuple(
    f'"{name}"'.encode()
    for name in [
        "resource_spans",
        "scope_spans",
        "trace_id",
        "span_id",
        "parent_span_id",
        "start_time_unix_nano",
        "end_time_unix_nano",
        "time_unix_nano",
        "string_value",
        "bool_value",
        "int_value",
        "double_value",
        "array_value",
        "kvlist_value",
        "bytes_value",
    ]
)


class AnyValue(msgspec.Struct, rename="camel"):
    string_value: str | None = None
    bool_value: bool | None = None
    int_value: Int64 | None = None
    double_value: float | str | None = None
    array_value: ArrayValue | None = None
    kvlist_value: KeyValueList | None = None
    bytes_value: str | None = None


class ArrayValue(msgspec.Struct, rename="camel"):
    values: list[AnyValue] = []


class KeyValue(msgspec.Struct, rename="camel"):
    key: str = ""
    value: AnyValue | None = None


class KeyValueList(msgspec.Struct, rename="camel"):
    values: list[KeyValue] = []


class Event(msgspec.Struct, rename="camel"):
    time_unix_nano: Int64 = 0
    name: str = ""
    attributes: list[KeyValue] = []


class Link(msgspec.Struct, rename="camel"):
    trace_id: str = ""
    span_id: str = ""


class Status(msgspec.Struct, rename="camel"):
    message: str = ""
    code: int | str = 0


class Span(msgspec.Struct, rename="camel"):
    trace_id: str = ""
    span_id: str = ""
    parent_span_id: str = ""
    name: str = ""
    kind: int | str = 0
    start_time_unix_nano: Int64 = 0
    end_time_unix_nano: Int64 = 0
    attributes: list[KeyValue] = []
    events: list[Event] = []
    links: list[Link] = []
    status: Status | None = None


class Scope(msgspec.Struct, rename="camel"):
    name: str = ""
    version: str = ""


class ScopeSpans(msgspec.Struct, rename="camel"):
    scope: Scope | None = None
    spans: list[Span] = []


class Resource(msgspec.Struct, rename="camel"):
    attributes: list[KeyValue] = []


class ResourceSpans(msgspec.Struct, rename="camel"):
    resource: Resource | None = None
    scope_spans: list[ScopeSpans] = []


class ExportRequest(msgspec.Struct, rename="camel"):
    resource_spans: list[ResourceSpans] = []


_DECODER = msgspec.json.Decoder(ExportRequest)


class _Unsure(Exception):
    """A value these structs cannot vouch for: the protobuf path decides."""


def _int(value: Int64, low: int = -(2**63), high: int = 2**63) -> int:
    """A 64-bit integer (int64 by default; the times are fixed64: `_time`)."""
    if isinstance(value, str):
        if not value.lstrip("-").isdigit():
            raise _Unsure
        value = int(value)
    if not low <= value < high:
        raise _Unsure
    return value


def _time(value: Int64) -> int:
    return _int(value, 0, 2**64)


def _double(value: float | str) -> float:
    if isinstance(value, str):
        named = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
        if value not in named:
            raise _Unsure
        return named[value]
    return float(value)


def _enum(value: int | str, names: Any) -> int:
    if isinstance(value, str):
        try:
            return names.Value(value)
        except ValueError:
            raise _Unsure from None
    return value


def _bytes(value: str) -> bytes:
    try:
        return base64.b64decode(
            value + "=" * (-len(value) % 4),
            altchars=b"-_" if "-" in value or "_" in value else None,
            validate=True,
        )
    except (binascii.Error, ValueError):
        raise _Unsure from None


def _value(value: AnyValue | None) -> Any:
    """An attribute value as JSON, as `routes.otlp.any_value` gives the protobuf's."""
    if value is None:
        return None
    if value.string_value is not None:
        return value.string_value
    if value.bool_value is not None:
        return value.bool_value
    if value.int_value is not None:
        return _int(value.int_value)
    if value.double_value is not None:
        return _double(value.double_value)
    if value.array_value is not None:
        return [_value(v) for v in value.array_value.values]
    if value.kvlist_value is not None:
        return _attributes(value.kvlist_value.values)
    if value.bytes_value is not None:
        return base64.b64encode(_bytes(value.bytes_value)).decode()
    return None


def _attributes(pairs: list[KeyValue]) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _id(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise _Unsure from None


def _payload(span: Span, resource: dict, scope: dict) -> tuple[dict, bytes, bytes]:
    status = span.status or Status()
    payload = {
        "trace_id": _id(span.trace_id).hex(),
        "span_id": _id(span.span_id).hex(),
        "parent_span_id": _id(span.parent_span_id).hex() or None,
        "name": span.name,
        "kind": _enum(span.kind, SpanMessage.SpanKind),
        "start_time_unix_nano": _time(span.start_time_unix_nano),
        "end_time_unix_nano": _time(span.end_time_unix_nano),
        "attributes": _attributes(span.attributes),
        "events": [
            {
                "name": event.name,
                "time_unix_nano": _time(event.time_unix_nano),
                "attributes": _attributes(event.attributes),
            }
            for event in span.events
        ],
        "links": [
            {"trace_id": _id(link.trace_id).hex(), "span_id": _id(link.span_id).hex()}
            for link in span.links
        ],
        "status": {"code": _enum(status.code, StatusMessage.StatusCode), "message": status.message},
        "resource": resource,
        "scope": scope,
    }
    return payload, _id(span.trace_id), _id(span.span_id)


def json_span_payloads(body: bytes, check: Any) -> list[tuple[dict | None, str]] | None:
    """The span payloads of an OTLP JSON body (or why each cannot land, as `check(number,
    trace_id, span_id)` says), or None when the protobuf path must decide."""
    if any(key in body for key in _SNAKE_KEYS):
        return None
    try:
        request = _DECODER.decode(body)
        out: list[tuple[dict | None, str]] = []
        number = 0
        for resource_spans in request.resource_spans:
            resource = {
                "attributes": _attributes((resource_spans.resource or Resource()).attributes)
            }
            for scope_spans in resource_spans.scope_spans:
                given = scope_spans.scope or Scope()
                scope = {"name": given.name, "version": given.version}
                for span in scope_spans.spans:
                    number += 1
                    payload, trace_id, span_id = _payload(span, resource, scope)
                    why = check(number, trace_id, span_id)
                    out.append((None, why) if why else (payload, ""))
        return out
    except (msgspec.DecodeError, _Unsure, OverflowError):
        return None
