"""White-box ingestion: steps, feedback, events and trajectory completion."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN
from claw_pipelines.contracts.wire import (
    Accepted,
    Event,
    Feedback,
    StepBatch,
    TrajectoryCompleted,
    TrajectoryCompletion,
)
from gateway.deps import IDEMPOTENCY_HEADER_DOC, caller_of, parse_body
from gateway.errors import ERROR_RESPONSES
from gateway.intake import accept, fact_record, step_records
from gateway.openapi import json_body

router = APIRouter(prefix="/v1", tags=["ingestion"], responses=ERROR_RESPONSES)
TrajectoryUid = Annotated[str, Path(min_length=1, max_length=MAX_UID_CHARS, pattern=UID_PATTERN)]


@router.post(
    "/steps",
    response_model=Accepted,
    openapi_extra=json_body(StepBatch, parameters=[IDEMPOTENCY_HEADER_DOC]),
)
async def submit_steps(request: Request) -> Response:
    """Submit token-level steps; a 200 means every step is durable."""
    caller = caller_of(request)
    batch = await parse_body(request, StepBatch)
    return await accept(
        caller.landing, step_records(batch.steps, caller.tenant, caller.idempotency_key)
    )


@router.post(
    "/feedback",
    response_model=Accepted,
    openapi_extra=json_body(Feedback, parameters=[IDEMPOTENCY_HEADER_DOC]),
)
async def submit_feedback(request: Request) -> Response:
    """Record a reward or human feedback about a step or a trajectory."""
    caller = caller_of(request)
    feedback = await parse_body(request, Feedback)
    return await accept(
        caller.landing, [fact_record(feedback, "feedback", caller.tenant, caller.idempotency_key)]
    )


@router.post(
    "/events",
    response_model=Accepted,
    openapi_extra=json_body(Event, parameters=[IDEMPOTENCY_HEADER_DOC]),
)
async def submit_event(request: Request) -> Response:
    """Record a live interaction event from a black-box service."""
    caller = caller_of(request)
    event = await parse_body(request, Event)
    return await accept(
        caller.landing, [fact_record(event, "event", caller.tenant, caller.idempotency_key)]
    )


@router.post(
    "/trajectories/{trajectory_uid}/complete",
    response_model=Accepted,
    openapi_extra=json_body(
        TrajectoryCompletion, required=False, parameters=[IDEMPOTENCY_HEADER_DOC]
    ),
)
async def complete_trajectory(
    trajectory_uid: TrajectoryUid,
    request: Request,
) -> Response:
    """Close a trajectory, optionally with its reward."""
    caller = caller_of(request)
    body = await parse_body(request, TrajectoryCompletion, optional=True)
    completed = TrajectoryCompleted(trajectory_uid=trajectory_uid, **body.model_dump())
    record = fact_record(completed, "trajectory_complete", caller.tenant, caller.idempotency_key)
    return await accept(caller.landing, [record])
