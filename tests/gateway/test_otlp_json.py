"""OTLP JSON decoded by the msgspec structs gives the payloads protobuf's JSON mapping gives,
on generated exports; what the structs cannot vouch for goes the protobuf way."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import ApiError
from gateway.otlp_json import json_span_payloads
from gateway.routes.otlp import JSON, decoded, payloads_of, rejection, span_payloads

ints = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(str),  # as OTLP JSON writes 64-bit integers
    st.integers(0, 2**53),  # as some senders do
)
scalars = st.one_of(
    st.builds(lambda v: {"stringValue": v}, st.text(max_size=8)),
    st.builds(lambda v: {"boolValue": v}, st.booleans()),
    st.builds(lambda v: {"intValue": v}, ints),
    st.builds(lambda v: {"doubleValue": v}, st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(lambda v: {"doubleValue": v}, st.sampled_from(["Infinity", "-Infinity"])),
    st.builds(lambda v: {"bytesValue": base64.b64encode(v).decode()}, st.binary(max_size=6)),
    st.just({}),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.builds(lambda vs: {"arrayValue": {"values": vs}}, st.lists(inner, max_size=3)),
        st.builds(
            lambda kv: {"kvlistValue": {"values": [{"key": k, "value": v} for k, v in kv]}},
            st.lists(st.tuples(st.text(max_size=4), inner), max_size=3),
        ),
    ),
    max_leaves=6,
)
attributes = st.lists(
    st.builds(lambda k, v: {"key": k, "value": v}, st.text(max_size=10), values), max_size=4
)
ids = st.one_of(
    st.binary(min_size=16, max_size=16).map(bytes.hex),
    st.binary(min_size=8, max_size=8).map(bytes.hex),
    st.just(""),
    st.just("00000000000000000000000000000000"),
)


@st.composite
def spans(draw) -> dict:
    span = {"traceId": draw(ids), "spanId": draw(ids)}
    optional = {
        "parentSpanId": ids,
        "name": st.text(max_size=10),
        "kind": st.one_of(st.integers(0, 5), st.sampled_from(["SPAN_KIND_CLIENT"])),
        "startTimeUnixNano": ints,
        "endTimeUnixNano": ints,
        "attributes": attributes,
        "events": st.lists(
            st.fixed_dictionaries(
                {"name": st.text(max_size=5)},
                optional={"timeUnixNano": ints, "attributes": attributes},
            ),
            max_size=2,
        ),
        "links": st.lists(st.fixed_dictionaries({"traceId": ids, "spanId": ids}), max_size=2),
        "status": st.fixed_dictionaries(
            {},
            optional={
                "code": st.one_of(st.integers(0, 2), st.just("STATUS_CODE_ERROR")),
                "message": st.text(max_size=5),
            },
        ),
        "droppedAttributesCount": st.integers(0, 3),  # read by neither: ignored alike
    }
    for key, strategy in optional.items():
        if draw(st.booleans()):
            span[key] = draw(strategy)
    return span


requests = st.builds(
    lambda groups: {"resourceSpans": groups},
    st.lists(
        st.fixed_dictionaries(
            {
                "scopeSpans": st.lists(
                    st.fixed_dictionaries(
                        {"spans": st.lists(spans(), max_size=3)},
                        optional={
                            "scope": st.fixed_dictionaries(
                                {},
                                optional={
                                    "name": st.text(max_size=4),
                                    "version": st.text(max_size=3),
                                },
                            )
                        },
                    ),
                    max_size=2,
                )
            },
            optional={"resource": st.fixed_dictionaries({"attributes": attributes})},
        ),
        max_size=2,
    ),
)


def through_protobuf(body: bytes) -> list | None:
    try:
        return list(span_payloads(decoded(body, JSON)))
    except ApiError:
        return None


@settings(max_examples=300, deadline=None)
@given(requests)
def test_the_structs_give_protobufs_payloads(request):
    body = json.dumps(request).encode()
    fast = json_span_payloads(body, rejection)
    slow = through_protobuf(body)
    if fast is None:  # handed on: the protobuf path decides (and must accept or refuse)
        return
    assert slow is not None, "the structs accepted what protobuf's mapping refuses"
    assert fast == slow


def test_what_the_structs_cannot_vouch_for_goes_the_protobuf_way():
    one = {"traceId": "5b8efff798038103d269b633813fc60c", "spanId": "00000000000000a1"}
    snake = json.dumps({"resource_spans": [{"scope_spans": [{"spans": [one]}]}]}).encode()
    assert json_span_payloads(snake, rejection) is None
    (landed,) = payloads_of(snake, JSON)  # protobuf's mapping reads snake_case keys too
    assert landed[0]["span_id"] == "00000000000000a1"
    bad_hex = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"spanId": "zz"}]}]}]})
    assert json_span_payloads(bad_hex.encode(), rejection) is None
    with pytest.raises(ApiError) as refused:
        payloads_of(bad_hex.encode(), JSON)
    assert refused.value.status == 400
    nulls = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{**one, "name": None}]}]}]})
    assert json_span_payloads(nulls.encode(), rejection) is None  # null: protobuf's default
    (landed,) = payloads_of(nulls.encode(), JSON)
    assert landed[0]["name"] == ""
