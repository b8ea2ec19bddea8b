"""What a traced agent's spans say: model calls, tool runs and rewards, read from a span's
bronze payload (`gateway.routes.otlp`), whichever convention wrote it (docs/DESIGN.md §4).

- An LLM span: `gen_ai.operation.name` chat / text_completion / generate_content (the GenAI
  semantic conventions), or `openinference.span.kind` LLM (OpenInference). Its messages come
  from, in this order: OpenInference's request (`input.value`, when it is the JSON body sent),
  the structured `gen_ai.input.messages` / `gen_ai.output.messages` (with
  `gen_ai.system_instructions`), OpenInference's flattened `llm.input_messages.N.message.*`,
  or the older per-message span events (`gen_ai.user.message`, ..., `gen_ai.choice`). All are
  read into OpenAI chat messages.
- A tool span: `gen_ai.operation.name` execute_tool, or `openinference.span.kind` TOOL.
- Token ids a span carries are taken as sent: ours (`claw.prompt_ids`, `claw.response_ids`,
  `claw.rollout_log_probs`) or Agent Lightning's (`prompt_token_ids`, `response_token_ids`).
- Where a call goes, from `claw.*` attributes of the span, else of its resource:
  `claw.trajectory_uid` (else the first of the configured sources that the span has:
  `gen_ai.conversation.id`, `session.id`, or the trace), `claw.step_index` (else the span's
  start in Unix microseconds: a function of the span alone, so a trajectory gets the same
  steps whatever order its spans arrive in), `claw.prompt_uid`, `claw.policy_version`,
  `claw.is_last`. A reward: `claw.reward` (on an LLM span: its step's; on another span: its
  trajectory's), Agent Lightning's reward spans (`agentlightning.reward`, attribute
  `reward`) and `gen_ai.evaluation.result` events (`gen_ai.evaluation.score.value`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from claw_pipelines.contracts.limits import FLOAT32_MAX, INT32_MAX, is_uid

LLM_OPERATIONS = ("chat", "text_completion", "generate_content")
TOOL_OPERATION = "execute_tool"
TRACE = "trace"  # a trajectory source: the span's trace
DEFAULT_TRAJECTORY_SOURCES = ("gen_ai.conversation.id", "session.id", TRACE)
REWARD_SPAN = "agentlightning.reward"
EVALUATION_EVENT = "gen_ai.evaluation.result"
_MESSAGE_EVENTS = {
    "gen_ai.system.message": "system",
    "gen_ai.user.message": "user",
    "gen_ai.assistant.message": "assistant",
    "gen_ai.tool.message": "tool",
}


@dataclass(slots=True)
class Placement:
    """Where a span's step or fact goes."""

    trajectory_uid: str
    step_index: int
    prompt_uid: str | None = None
    policy_version: int | None = None
    is_last: bool = False


@dataclass(slots=True)
class TracedCall:
    """One model call as its span tells it, in OpenAI chat terms."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    output: dict[str, Any]  # the assistant message: content, tool_calls
    finish_reason: str | None
    model: str | None
    response_id: str | None
    usage: dict[str, int] = field(default_factory=dict)  # prompt_tokens, completion_tokens
    prompt_ids: list[int] | None = None  # carried on the span
    response_ids: list[int] | None = None
    log_probs: list[float] | None = None


def attributes_of(span: dict[str, Any]) -> dict[str, Any]:
    return span.get("attributes") or {}


def is_llm_span(span: dict[str, Any]) -> bool:
    attrs = attributes_of(span)
    return (
        attrs.get("gen_ai.operation.name") in LLM_OPERATIONS
        or attrs.get("openinference.span.kind") == "LLM"
    )


def is_tool_span(span: dict[str, Any]) -> bool:
    attrs = attributes_of(span)
    return (
        attrs.get("gen_ai.operation.name") == TOOL_OPERATION
        or attrs.get("openinference.span.kind") == "TOOL"
    )


def _claw(span: dict[str, Any], name: str) -> Any:
    """A `claw.*` attribute of the span, else of its resource."""
    value = attributes_of(span).get(f"claw.{name}")
    if value is None:
        value = ((span.get("resource") or {}).get("attributes") or {}).get(f"claw.{name}")
    return value


def _as_uid(value: Any, prefix: str) -> str | None:
    """A uid for an identifier: itself when it is one, else `prefix-<its BLAKE2b>`."""
    if value is None or isinstance(value, bool):
        return None
    text = str(value)
    if not text:
        return None
    if is_uid(text):
        return text
    return f"{prefix}-{hashlib.blake2b(text.encode(), digest_size=12).hexdigest()}"


def _count(value: Any, limit: int = INT32_MAX) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and 0 <= value <= limit else None


def placement(span: dict[str, Any], sources: tuple[str, ...]) -> Placement:
    """Where the span's step or fact goes (see the module's docstring)."""
    trajectory = _as_uid(_claw(span, "trajectory_uid"), "traj")
    for source in sources:
        if trajectory is not None:
            break
        if source == TRACE:
            trajectory = f"trace-{span['trace_id']}"
        else:
            trajectory = _as_uid(attributes_of(span).get(source), "conv")
    index = _count(_claw(span, "step_index"))
    if index is None:
        index = int(span.get("start_time_unix_nano") or 0) // 1_000
    return Placement(
        trajectory_uid=trajectory or f"trace-{span['trace_id']}",
        step_index=index,
        prompt_uid=_as_uid(_claw(span, "prompt_uid"), "pg"),
        policy_version=_count(_claw(span, "policy_version")),
        is_last=_claw(span, "is_last") is True,
    )


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def _ints(value: Any) -> list[int] | None:
    value = _json(value)
    if isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]  # one list per choice: the first
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT32_MAX for v in value
    ):
        return value
    return None


def _floats(value: Any) -> list[float] | None:
    value = _json(value)
    if isinstance(value, list) and all(
        isinstance(v, int | float) and not isinstance(v, bool) and abs(v) <= FLOAT32_MAX
        for v in value
    ):
        return [float(v) for v in value]
    return None


def _text(parts: list[Any]) -> str | None:
    texts = [
        str(p.get("content", ""))
        for p in parts
        if isinstance(p, dict) and p.get("type") in ("text", None)
    ]
    return "".join(texts) if texts else None


def _arguments(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {})


def _genai_message(message: Any) -> list[dict[str, Any]]:
    """A GenAI-conventions message (`role`, `parts`) as OpenAI chat messages (a tool
    message per tool result part)."""
    if not isinstance(message, dict):
        return []
    role, parts = message.get("role"), message.get("parts") or []
    if not isinstance(parts, list):
        return []
    results = [p for p in parts if isinstance(p, dict) and p.get("type") == "tool_call_response"]
    if results:
        return [
            {
                "role": "tool",
                "tool_call_id": str(p.get("id") or ""),
                "content": p["response"]
                if isinstance(p.get("response"), str)
                else json.dumps(p.get("response")),
            }
            for p in results
        ]
    out: dict[str, Any] = {"role": role, "content": _text(parts)}
    calls = [
        {
            "id": str(p.get("id") or ""),
            "type": "function",
            "function": {
                "name": str(p.get("name") or ""),
                "arguments": _arguments(p.get("arguments")),
            },
        }
        for p in parts
        if isinstance(p, dict) and p.get("type") == "tool_call"
    ]
    if calls:
        out["tool_calls"] = calls
    return [out]


def _genai_call(attrs: dict[str, Any]) -> tuple[list, dict, str | None] | None:
    inputs, outputs = (
        _json(attrs.get("gen_ai.input.messages")),
        _json(attrs.get("gen_ai.output.messages")),
    )
    if not isinstance(inputs, list) or not isinstance(outputs, list) or not outputs:
        return None
    messages = [m for message in inputs for m in _genai_message(message)]
    system = _json(attrs.get("gen_ai.system_instructions"))
    if isinstance(system, list) and (text := _text(system)):
        messages.insert(0, {"role": "system", "content": text})
    first = outputs[0] if isinstance(outputs[0], dict) else {}
    (output,) = _genai_message({**first, "role": "assistant"})[:1] or [{"role": "assistant"}]
    return messages, output, first.get("finish_reason")


def _flattened(attrs: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """OpenInference's flattened messages (`{prefix}.N.message.role`, ...) in order."""
    found: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        if not key.startswith(prefix + "."):
            continue
        number, _, rest = key[len(prefix) + 1 :].partition(".message.")
        if not number.isdigit() or not rest:
            continue
        message = found.setdefault(int(number), {})
        if rest in ("role", "content", "tool_call_id", "name"):
            message[rest] = value
        elif rest.startswith("tool_calls."):
            slot, _, what = rest[len("tool_calls.") :].partition(".tool_call.")
            if slot.isdigit():
                calls = message.setdefault("_calls", {})
                call = calls.setdefault(int(slot), {"type": "function", "function": {}})
                if what == "id":
                    call["id"] = value
                elif what.startswith("function."):
                    call["function"][what[len("function.") :]] = value
    messages = []
    for number in sorted(found):
        message = found[number]
        calls = message.pop("_calls", None)
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        messages.append(message)
    return messages


def _openinference_call(attrs: dict[str, Any]) -> tuple[list, dict, str | None, list | None]:
    request = _json(attrs.get("input.value"))
    messages = request.get("messages") if isinstance(request, dict) else None
    tools = request.get("tools") if isinstance(request, dict) else None
    if not isinstance(messages, list):
        messages = _flattened(attrs, "llm.input_messages")
    if not isinstance(tools, list):
        schemas = [
            _json(v)
            for k, v in sorted(attrs.items())
            if k.startswith("llm.tools.") and k.endswith(".tool.json_schema")
        ]
        tools = [s for s in schemas if isinstance(s, dict)] or None
    outputs = _flattened(attrs, "llm.output_messages")
    response = _json(attrs.get("output.value"))
    choice = None
    if isinstance(response, dict) and isinstance(response.get("choices"), list):
        choice = response["choices"][0] if response["choices"] else None
    output = outputs[0] if outputs else (choice or {}).get("message") or {}
    finish = attrs.get("llm.finish_reason") or (choice or {}).get("finish_reason")
    return messages, {**output, "role": "assistant"}, finish, tools


def _event_call(span: dict[str, Any]) -> tuple[list, dict, str | None] | None:
    """The older conventions: a span event per message, `gen_ai.choice` for the reply."""
    messages, output, finish = [], None, None
    for event in span.get("events") or []:
        name, attrs = event.get("name"), event.get("attributes") or {}
        if name in _MESSAGE_EVENTS:
            message: dict[str, Any] = {"role": attrs.get("role") or _MESSAGE_EVENTS[name]}
            message["content"] = attrs.get("content")
            if calls := _json(attrs.get("tool_calls")):
                message["tool_calls"] = calls
            if attrs.get("id") is not None and message["role"] == "tool":
                message["tool_call_id"] = attrs["id"]
            messages.append(message)
        elif name == "gen_ai.choice" and output is None:
            given = _json(attrs.get("message"))
            output = given if isinstance(given, dict) else {"content": attrs.get("content")}
            finish = attrs.get("finish_reason")
    if output is None:
        return None
    return messages, {**output, "role": "assistant"}, finish


def traced_call(span: dict[str, Any]) -> TracedCall | None:
    """The model call an LLM span tells of; None when it holds no messages and no ids."""
    attrs = attributes_of(span)
    tools = None
    if attrs.get("openinference.span.kind") == "LLM":
        messages, output, finish, tools = _openinference_call(attrs)
        read: tuple | None = (messages, output, finish) if messages or output else None
    else:
        read = _genai_call(attrs) or _event_call(span)
    response = _json(attrs.get("output.value"))
    response_id = attrs.get("gen_ai.response.id") or (
        response.get("id") if isinstance(response, dict) else None
    )
    finishes = attrs.get("gen_ai.response.finish_reasons")
    prompt_ids = _ints(attrs.get("claw.prompt_ids", attrs.get("prompt_token_ids")))
    response_ids = _ints(attrs.get("claw.response_ids", attrs.get("response_token_ids")))
    if read is None and (prompt_ids is None or response_ids is None):
        return None
    messages, output, finish = read or ([], {"role": "assistant"}, None)
    if finish is None and isinstance(finishes, list) and finishes:
        finish = finishes[0]
    usage = {
        "prompt_tokens": _count(
            attrs.get("gen_ai.usage.input_tokens", attrs.get("llm.token_count.prompt"))
        ),
        "completion_tokens": _count(
            attrs.get("gen_ai.usage.output_tokens", attrs.get("llm.token_count.completion"))
        ),
    }
    log_probs = _floats(attrs.get("claw.rollout_log_probs"))
    if log_probs is not None and (response_ids is None or len(log_probs) != len(response_ids)):
        log_probs = None
    return TracedCall(
        messages=[m for m in messages if isinstance(m, dict)],
        tools=tools if isinstance(tools, list) else None,
        output={k: v for k, v in output.items() if v is not None},
        finish_reason=str(finish) if finish is not None else None,
        model=attrs.get("gen_ai.response.model")
        or attrs.get("llm.model_name")
        or attrs.get("gen_ai.request.model"),
        response_id=str(response_id) if response_id is not None else None,
        usage={k: v for k, v in usage.items() if v is not None},
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        log_probs=log_probs,
    )


def tool_turn(span: dict[str, Any]) -> dict[str, Any]:
    """What a tool span says of the tool run: name, call id, arguments, result, seconds."""
    attrs = attributes_of(span)
    seconds = (
        int(span.get("end_time_unix_nano") or 0) - int(span.get("start_time_unix_nano") or 0)
    ) / 1e9
    return {
        "name": attrs.get("gen_ai.tool.name") or attrs.get("tool.name") or span.get("name"),
        "call_id": attrs.get("gen_ai.tool.call.id"),
        "arguments": attrs.get("gen_ai.tool.call.arguments", attrs.get("input.value")),
        "result": attrs.get("gen_ai.tool.call.result", attrs.get("output.value")),
        "seconds": round(max(seconds, 0.0), 6),
        "error": (span.get("status") or {}).get("code") == 2,
        "span_id": span.get("span_id"),
    }


def _number(value: Any) -> float | None:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def span_rewards(span: dict[str, Any]) -> list[tuple[float, str]]:
    """The rewards a span gives (value, where it came from): `claw.reward`, Agent Lightning's
    reward span, `gen_ai.evaluation.result` events."""
    attrs = attributes_of(span)
    found = []
    if (value := _number(attrs.get("claw.reward"))) is not None:
        found.append((value, "claw.reward"))
    if span.get("name") == REWARD_SPAN and (value := _number(attrs.get("reward"))) is not None:
        found.append((value, REWARD_SPAN))
    for event in span.get("events") or []:
        if event.get("name") == EVALUATION_EVENT:
            score = _number((event.get("attributes") or {}).get("gen_ai.evaluation.score.value"))
            if score is not None:
                found.append((score, EVALUATION_EVENT))
    return found
