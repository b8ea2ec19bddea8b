"""Bronze records of proxied calls: one step per choice, and upstream failures as events.

A step record's JSON payload has the step fields at top level (as `POST /v1/steps` stores
them) plus `request` (the body the client sent) and `response` (the answer the client got,
reduced to this choice; assembled from the chunks when streamed). The token arrays live in
the record's typed columns, not in the payload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pydantic_core

from claw_pipelines.contracts.ids import step_key
from claw_pipelines.contracts.wire import Event
from gateway.proxy.capture import CapturedChoice, StepTokens
from gateway.proxy.upstream import UpstreamFailure
from gateway.records import BronzeRecord, fact_record, now_us


@dataclass(slots=True)
class CallSteps:
    """A call's step records, where each went and the choices they came from; and the
    events of choices whose ids could not be captured (no step is made up for them)."""

    captured: list[CapturedChoice]
    records: list[BronzeRecord]
    places: list[StepPlace]
    uncaptured: list[BronzeRecord]


@dataclass(frozen=True, slots=True)
class StepPlace:
    """Where one choice's step goes: its trajectory, index, group and policy version."""

    trajectory_uid: str
    step_index: int
    prompt_uid: str | None
    policy_version: int | None
    stamped: bool = False  # the policy version is the published one (neither call nor scope said)


def step_keys(places: list[StepPlace]) -> str:
    """The `X-Claw-Step-Keys` header: the step keys of an answer's choices."""
    return ",".join(step_key(p.trajectory_uid, p.step_index) for p in places)


def step_record(
    *,
    event_id: str,
    kind: str,
    tenant: str,
    place: StepPlace,
    model: str | None,
    metadata: dict[str, Any],
    request_json: bytes,
    choice: CapturedChoice,
    tokens: StepTokens,
    extra: bytes | None = None,
    reward: float | None = None,
    is_last: bool = False,
) -> BronzeRecord:
    """The bronze record of one choice of a proxied (or traced) call (`extra`: more payload
    members)."""
    fields = {
        "trajectory_uid": place.trajectory_uid,
        "prompt_uid": place.prompt_uid,
        "step_index": place.step_index,
        "reward": reward,
        "policy_version": place.policy_version,
        "is_last": is_last,
        "finish_reason": choice.finish_reason,
        "model": model,
        "metadata": metadata,
        "event_id": event_id,
    }
    head = pydantic_core.to_json(fields)
    response = pydantic_core.to_json(choice.response)
    parts = [head[:-1], b',"request":', request_json, b',"response":', response]
    if extra:
        parts += [b",", extra]
    payload = b"".join((*parts, b"}"))
    return BronzeRecord(
        event_id,
        kind,
        tenant,
        now_us(),
        payload,
        tokens.token_source,
        tokens.prompt_ids,
        tokens.response_ids,
        tokens.rollout_log_probs,
        None,
    )


def uncaptured_record(
    choice: CapturedChoice, tenant: str, trajectory_uid: str | None, reason: str, model: Any
) -> BronzeRecord:
    """An `event` record (type `uncaptured_call`) for a choice answered without token ids
    that could not be tokenized here: what the client got, never a step."""
    payload = {
        "reason": reason,
        "choice_index": choice.index,
        "finish_reason": choice.finish_reason,
        "model": model if isinstance(model, str) else None,
        "output": choice.output,
    }
    event = Event(type="uncaptured_call", trajectory_uid=trajectory_uid, payload=payload)
    return fact_record(event, "event", tenant)


def upstream_error_record(
    failure: UpstreamFailure, tenant: str, trajectory_uid: str | None, details: dict[str, Any]
) -> BronzeRecord:
    """An `event` record (type `upstream_error`) for a call the upstream failed."""
    payload = {
        "status": failure.status,
        "code": failure.code,
        "message": failure.message,
        "upstream_status": failure.upstream_status,
        **details,
    }
    event = Event(type="upstream_error", trajectory_uid=trajectory_uid, payload=payload)
    return fact_record(event, "event", tenant)
