"""Bronze records derived from a traced agent's spans (docs/DESIGN.md §4): a step per model
call (kind `traced_call`), an event per tool run, feedback per reward.

A model call's ids are the ones its span carries (`token_source` `client`), else computed
here with the model's tokenizer from the span's messages and labelled against the span's
token counts as the proxy labels its own (`local` when both counts agree, else
`local_unverified`). A call with neither (no tokenizer, or no messages) lands as an
`uncaptured_call` event, never as a step. A call this gateway proxied lands once: its span
joins the proxied step (`gateway.proxy.proxied_calls`). Every derived record's event id is
the span's with a suffix, so an exporter's retry lands each once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from claw_pipelines.contracts.wire import Event, Feedback, StepTarget, TrajectoryTarget
from claw_pipelines.tokenization import ChatTokenizer
from gateway.genai_spans import (
    Placement,
    TracedCall,
    is_llm_span,
    is_tool_span,
    placement,
    span_rewards,
    tool_turn,
    traced_call,
)
from gateway.proxy.capture import (
    CHAT_KIND,
    CapturedChoice,
    StepTokens,
    Uncapturable,
    step_tokens,
    verified,
)
from gateway.proxy.proxied_calls import ProxiedCalls
from gateway.proxy.steps import StepPlace, step_record
from gateway.records import BronzeRecord, fact_record

TRACED_KIND = "traced_call"  # the bronze record kind of a step read from an LLM span
CLIENT = "client"  # the label of ids the span itself carries
FEEDBACK_SOURCE = "trace"  # the `source` of the feedback a span's reward becomes

Tokenizer = Callable[[], ChatTokenizer | None]


def derived_records(
    span: dict[str, Any],
    event_id: str,
    tenant: str,
    tokenizer: Tokenizer,
    sources: tuple[str, ...],
    calls: ProxiedCalls | None = None,
) -> list[BronzeRecord]:
    """The records a span's payload yields beside itself (`event_id`: the span record's). A
    model call this gateway proxied (`calls`, by response id) is not landed again: the span
    yields a `traced_twin` event naming the proxied step, and its rewards go to that step and
    its trajectory's to the proxied trajectory."""
    place = placement(span, sources)
    origin = {"trace_id": span["trace_id"], "span_id": span["span_id"]}
    records: list[BronzeRecord] = []
    rewards = span_rewards(span)
    target: StepTarget | TrajectoryTarget | None = None
    call = traced_call(span) if is_llm_span(span) else None
    twin = calls.step_of(tenant, call.response_id) if calls is not None and call else None
    if call is not None and twin is not None and calls is not None:
        calls.join(tenant, place.trajectory_uid, twin)
        event = Event(
            type="traced_twin",
            trajectory_uid=twin.rsplit(":", 1)[0],
            payload={"step_key": twin, "response_id": call.response_id, "otel": origin},
            event_id=f"{event_id}-twin",
        )
        records.append(fact_record(event, "event", tenant))
        target = StepTarget(step_key=twin)
    elif call is not None:
        step_reward = rewards[0][0] if rewards and rewards[0][1] == "claw.reward" else None
        step = _step(call, span, place, origin, event_id, tenant, tokenizer, step_reward)
        if step.kind == TRACED_KIND:
            target = StepTarget(step_key=f"{place.trajectory_uid}:{place.step_index}")
            if step_reward is not None:
                rewards = rewards[1:]  # the step carries it
        records.append(step)
    trajectory = place.trajectory_uid
    if calls is not None:
        trajectory = calls.trajectory_of(tenant, trajectory)
    if is_tool_span(span):
        turn = {k: v for k, v in tool_turn(span).items() if v is not None}
        event = Event(
            type="tool_turn",
            trajectory_uid=trajectory,
            payload={**turn, "otel": origin},
            event_id=f"{event_id}-tool",
        )
        records.append(fact_record(event, "event", tenant))
    target = target or TrajectoryTarget(trajectory_uid=trajectory)
    for number, (value, via) in enumerate(rewards):
        feedback = Feedback(
            target=target,
            kind="reward",
            value=value,
            source=FEEDBACK_SOURCE,
            metadata={"otel": origin, "via": via},
            event_id=f"{event_id}-reward-{number}",
        )
        records.append(fact_record(feedback, "feedback", tenant))
    return records


def unread_record(
    span: dict[str, Any], event_id: str, tenant: str, error: Exception
) -> BronzeRecord:
    """An `event` (type `span_unread`) for a span whose model call, tool run or rewards
    could not be read: why, and which span (kept as received beside it)."""
    origin = {"trace_id": span["trace_id"], "span_id": span["span_id"]}
    event = Event(
        type="span_unread",
        payload={"error": f"{type(error).__name__}: {error}"[:1_000], "otel": origin},
        event_id=f"{event_id}-unread",
    )
    return fact_record(event, "event", tenant)


def _step(
    call: TracedCall,
    span: dict[str, Any],
    place: Placement,
    origin: dict[str, str],
    event_id: str,
    tenant: str,
    tokenizer: Tokenizer,
    reward: float | None,
) -> BronzeRecord:
    """The step of a model call, or an `uncaptured_call` event when its ids cannot be had."""
    request = (
        {"messages": call.messages, "tools": call.tools}
        if call.tools
        else {"messages": call.messages}
    )
    try:
        tokens, named = _tokens(call, request, tokenizer)
    except Uncapturable as exc:
        event = Event(
            type="uncaptured_call",
            trajectory_uid=place.trajectory_uid,
            payload={
                "reason": str(exc),
                "model": call.model,
                "output": call.output,
                "otel": origin,
            },
            event_id=f"{event_id}-uncaptured",
        )
        return fact_record(event, "event", tenant)
    metadata: dict[str, Any] = {"otel": {**origin, "scope": (span.get("scope") or {}).get("name")}}
    metadata |= {"scoped": True, **named, **(tokens.metadata or {})}
    metadata["log_probs"] = tokens.rollout_log_probs is not None
    if call.response_id is not None:
        metadata["response_id"] = call.response_id
    return step_record(
        event_id=f"{event_id}-step",
        kind=TRACED_KIND,
        tenant=tenant,
        place=StepPlace(
            place.trajectory_uid, place.step_index, place.prompt_uid, place.policy_version
        ),
        model=call.model,
        metadata=metadata,
        request_json=json.dumps(request, ensure_ascii=False).encode(),
        choice=_choice(call),
        tokens=tokens,
        reward=reward,
        is_last=place.is_last,
    )


def _choice(call: TracedCall) -> CapturedChoice:
    response = {"id": call.response_id, "model": call.model}
    response["choices"] = [
        {"index": 0, "message": call.output, "finish_reason": call.finish_reason}
    ]
    return CapturedChoice(
        0,
        call.prompt_ids,
        call.response_ids,
        call.log_probs,
        call.finish_reason,
        call.output,
        response,
    )


def _tokens(
    call: TracedCall, request: dict[str, Any], tokenizer: Tokenizer
) -> tuple[StepTokens, dict[str, Any]]:
    """The call's packed ids, their label, and what the metadata says of the tokenizer: the
    proxy's own packing and local tokenization (`capture.step_tokens`); ids all carried on
    the span are the client's."""
    if not call.prompt_ids and not call.messages:
        raise Uncapturable("the span holds neither token ids nor the messages sent")
    tokens = step_tokens(_choice(call), request, CHAT_KIND, 0, tokenizer)
    if not tokens.prompt_ids:
        raise Uncapturable("the span's messages cannot be rendered with the model's template")
    if not tokens.local:
        return replace(tokens, token_source=CLIENT), {}
    (tokens,) = verified([tokens], [0], call.usage)
    chat = tokenizer()
    named = (
        {} if chat is None else {"tokenizer": {"name": chat.name, "fingerprint": chat.fingerprint}}
    )
    return tokens, named
