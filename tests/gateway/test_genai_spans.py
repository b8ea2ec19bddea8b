"""Reading model calls, tool runs, rewards and placement out of span payloads, whichever
convention wrote them (the payload as /v1/traces stores it)."""

from __future__ import annotations

import json

from gateway.genai_spans import (
    DEFAULT_TRAJECTORY_SOURCES,
    is_llm_span,
    is_tool_span,
    placement,
    span_rewards,
    tool_turn,
    traced_call,
)
from gateway.proxy.proxied_calls import ProxiedCalls
from gateway.traced import derived_records, unread_record

TRACE = "5b8efff798038103d269b633813fc60c"
ASKED = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "2+2?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calc", "arguments": '{"expr": "2+2"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "4"},
]


def span(attributes: dict, events: list | None = None, **extra) -> dict:
    return {
        "trace_id": TRACE,
        "span_id": "00000000000000a1",
        "name": "chat",
        "start_time_unix_nano": 1_700_000_000_123_456_789,
        "end_time_unix_nano": 1_700_000_001_000_000_000,
        "attributes": attributes,
        "events": events or [],
        "resource": {"attributes": {}},
        "scope": {"name": "test"},
        "status": {"code": 0},
        **extra,
    }


def test_genai_structured_messages_read_as_openai_chat():
    inputs = [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {"role": "user", "parts": [{"type": "text", "content": "2+2?"}]},
        {
            "role": "assistant",
            "parts": [
                {"type": "tool_call", "id": "call_1", "name": "calc", "arguments": {"expr": "2+2"}}
            ],
        },
        {
            "role": "tool",
            "parts": [{"type": "tool_call_response", "id": "call_1", "response": "4"}],
        },
    ]
    outputs = [
        {"role": "assistant", "parts": [{"type": "text", "content": "4."}], "finish_reason": "stop"}
    ]
    call = traced_call(
        span(
            {
                "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": json.dumps(inputs),
                "gen_ai.output.messages": json.dumps(outputs),
                "gen_ai.response.id": "chatcmpl-1",
                "gen_ai.response.model": "m",
                "gen_ai.usage.input_tokens": 40,
                "gen_ai.usage.output_tokens": 3,
            }
        )
    )
    assert call is not None
    assert [m["role"] for m in call.messages] == ["system", "user", "assistant", "tool"]
    assert call.messages[2]["tool_calls"][0]["function"] == {
        "name": "calc",
        "arguments": '{"expr": "2+2"}',
    }
    assert call.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "4"}
    assert call.output == {"role": "assistant", "content": "4."}
    assert (call.finish_reason, call.response_id, call.model) == ("stop", "chatcmpl-1", "m")
    assert call.usage == {"prompt_tokens": 40, "completion_tokens": 3}


def test_openinference_reads_the_request_sent_else_its_flattened_messages():
    attrs = {
        "openinference.span.kind": "LLM",
        "input.value": json.dumps({"model": "m", "messages": ASKED, "tools": [{"type": "x"}]}),
        "output.value": json.dumps({"id": "chatcmpl-2", "choices": [{"finish_reason": "stop"}]}),
        "llm.output_messages.0.message.role": "assistant",
        "llm.output_messages.0.message.content": "4.",
        "llm.token_count.prompt": 40,
        "llm.model_name": "m",
    }
    call = traced_call(span(attrs))
    assert call is not None and call.messages == ASKED and call.tools == [{"type": "x"}]
    assert (call.output["content"], call.finish_reason, call.response_id) == (
        "4.",
        "stop",
        "chatcmpl-2",
    )
    flat = {k: v for k, v in attrs.items() if k != "input.value"}
    flat |= {
        "llm.input_messages.0.message.role": "user",
        "llm.input_messages.0.message.content": "2+2?",
        "llm.input_messages.1.message.role": "assistant",
        "llm.input_messages.1.message.tool_calls.0.tool_call.id": "call_1",
        "llm.input_messages.1.message.tool_calls.0.tool_call.function.name": "calc",
        "llm.input_messages.1.message.tool_calls.0.tool_call.function.arguments": "{}",
        "llm.input_messages.10.message.role": "tool",  # numbers, not text, order them
        "llm.input_messages.10.message.content": "4",
        "llm.input_messages.10.message.tool_call_id": "call_1",
    }
    call = traced_call(span(flat))
    assert call is not None
    assert [m["role"] for m in call.messages] == ["user", "assistant", "tool"]
    assert call.messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "calc", "arguments": "{}"}, "id": "call_1"}
    ]


def test_older_message_events_and_carried_ids():
    events = [
        {"name": "gen_ai.system.message", "attributes": {"content": "be brief"}},
        {"name": "gen_ai.user.message", "attributes": {"content": "2+2?"}},
        {
            "name": "gen_ai.choice",
            "attributes": {"message": json.dumps({"content": "4."}), "finish_reason": "stop"},
        },
    ]
    call = traced_call(span({"gen_ai.operation.name": "chat"}, events))
    assert call is not None
    assert call.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
    ]
    assert call.output == {"content": "4.", "role": "assistant"} and call.finish_reason == "stop"
    # Agent Lightning's names: ids alone make a call; ours take log-probs too
    carried = traced_call(
        span(
            {
                "gen_ai.operation.name": "chat",
                "prompt_token_ids": [1, 2, 3],
                "response_token_ids": [4, 5],
            }
        )
    )
    assert carried is not None and (carried.prompt_ids, carried.response_ids) == ([1, 2, 3], [4, 5])
    ours = traced_call(
        span(
            {
                "gen_ai.operation.name": "chat",
                "claw.prompt_ids": "[7, 8]",
                "claw.response_ids": [9],
                "claw.rollout_log_probs": [-0.5],
            }
        )
    )
    assert ours is not None and ours.log_probs == [-0.5] and ours.prompt_ids == [7, 8]
    bad = {"gen_ai.operation.name": "chat", "claw.prompt_ids": [1, -2], "claw.response_ids": [1]}
    assert traced_call(span(bad)) is None  # a negative id is no id, and there are no messages
    outside = {**bad, "claw.prompt_ids": [1], "claw.rollout_log_probs": [-1e300]}
    assert traced_call(span(outside)).log_probs is None  # past float32: dropped, never packed


def test_placement_follows_claw_attributes_then_the_configured_sources():
    bare = span({"gen_ai.operation.name": "chat"})
    where = placement(bare, DEFAULT_TRAJECTORY_SOURCES)
    assert where.trajectory_uid == f"trace-{TRACE}"
    assert where.step_index == 1_700_000_000_123_456  # its start, in microseconds
    conversation = span({"gen_ai.conversation.id": "conv 42/a"})  # not a uid: hashed into one
    assert placement(conversation, DEFAULT_TRAJECTORY_SOURCES).trajectory_uid.startswith("conv-")
    assert placement(span({"session.id": "s-1"}), ("trace",)).trajectory_uid == f"trace-{TRACE}"
    given = span(
        {"claw.trajectory_uid": "traj-9", "claw.step_index": 3, "claw.is_last": True},
        resource={"attributes": {"claw.prompt_uid": "pg-1", "claw.policy_version": 2}},
    )
    where = placement(given, DEFAULT_TRAJECTORY_SOURCES)
    assert (where.trajectory_uid, where.step_index, where.prompt_uid) == ("traj-9", 3, "pg-1")
    assert (where.policy_version, where.is_last) == (2, True)


def test_kinds_tool_turns_and_rewards():
    tool = span(
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "bash",
            "gen_ai.tool.call.id": "call_1",
        },
        status={"code": 2},
    )
    assert is_tool_span(tool) and not is_llm_span(tool)
    turn = tool_turn(tool)
    assert (turn["name"], turn["call_id"], turn["error"]) == ("bash", "call_1", True)
    assert turn["seconds"] == 0.876543
    rewarded = span(
        {"claw.reward": "0.5"},
        [
            {
                "name": "gen_ai.evaluation.result",
                "attributes": {"gen_ai.evaluation.score.value": 1},
            },
            {
                "name": "gen_ai.evaluation.result",
                "attributes": {"gen_ai.evaluation.score.value": "x"},
            },
        ],
    )
    assert span_rewards(rewarded) == [(0.5, "claw.reward"), (1.0, "gen_ai.evaluation.result")]
    lightning = span({"reward": 0.25}, name="agentlightning.reward")
    assert span_rewards(lightning) == [(0.25, "agentlightning.reward")]
    assert span_rewards(span({"claw.reward": float("nan")})) == []


def test_a_call_that_cannot_be_a_step_keeps_its_reward_as_feedback():
    messages = '[{"role":"user","parts":[{"type":"text","content":"hi"}]}]'
    answer = '[{"role":"assistant","parts":[{"type":"text","content":"yo"}]}]'
    attrs = {
        "gen_ai.operation.name": "chat",
        "gen_ai.input.messages": messages,
        "gen_ai.output.messages": answer,
        "claw.reward": 1.0,
    }
    records = derived_records(span(attrs), "otel-x", "tenant-a", lambda: None, ("trace",))
    assert [r.kind for r in records] == ["event", "feedback"]  # no tokenizer: no step
    feedback = json.loads(records[1].payload)
    assert feedback["value"] == 1.0 and feedback["target"] == {"trajectory_uid": f"trace-{TRACE}"}
    unread = unread_record(span(attrs), "otel-x", "tenant-a", ValueError("odd"))
    assert json.loads(unread.payload)["payload"]["error"] == "ValueError: odd"


def test_a_call_the_gateway_proxied_joins_its_step_and_takes_the_traces_facts_along():
    calls = ProxiedCalls(capacity=2)
    calls.add("tenant-a", "chatcmpl-1", "traj-p:3")
    calls.add("tenant-a", "chatcmpl-1", "traj-p:4")  # a later choice of the call: the first stays
    llm = span(
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.response.id": "chatcmpl-1",
            "claw.prompt_ids": [1],
            "claw.response_ids": [2],
            "claw.reward": 0.5,
        }
    )
    records = derived_records(llm, "otel-a", "tenant-a", lambda: None, ("trace",), calls)
    assert [r.kind for r in records] == ["event", "feedback"]  # no second step
    twin = json.loads(records[0].payload)
    assert twin["type"] == "traced_twin" and twin["payload"]["step_key"] == "traj-p:3"
    assert json.loads(records[1].payload)["target"] == {"step_key": "traj-p:3"}
    root = span({"claw.reward": 1.0}, span_id="00000000000000b1")  # the agent's span, later
    (feedback,) = derived_records(root, "otel-b", "tenant-a", lambda: None, ("trace",), calls)
    assert json.loads(feedback.payload)["target"] == {"trajectory_uid": "traj-p"}
    other = derived_records(llm, "otel-c", "tenant-b", lambda: None, ("trace",), calls)
    assert other[0].kind == "traced_call"  # another tenant's call is never joined
    calls.add("tenant-a", "chatcmpl-2", "traj-q:0")
    calls.add("tenant-a", "chatcmpl-3", "traj-r:0")  # past capacity: the oldest is forgotten
    assert calls.step_of("tenant-a", "chatcmpl-1") is None
