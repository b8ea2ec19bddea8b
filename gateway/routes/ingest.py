"""White-box ingestion: steps, feedback, events and trajectory completion."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN
from claw_pipelines.contracts.wire import (
    Accepted,
    Event,
    Feedback,
    StepBatch,
    TrajectoryCompleted,
    TrajectoryCompletion,
)
from gateway.deps import IdempotencyKeyDep, LandingDep, TenantDep, parse_body
from gateway.errors import ERROR_RESPONSES
from gateway.intake import accept, fact_record, step_records
from gateway.openapi import json_body

router = APIRouter(prefix="/v1", tags=["ingestion"], responses=ERROR_RESPONSES)
TrajectoryUid = Annotated[str, Path(min_length=1, max_length=MAX_UID_CHARS, pattern=UID_PATTERN)]


@router.post("/steps", response_model=Accepted, openapi_extra=json_body(StepBatch))
async def submit_steps(
    request: Request, tenant: TenantDep, landing: LandingDep, idempotency_key: IdempotencyKeyDep
) -> Accepted:
    """Submit token-level steps; a 200 means every step is durable."""
    batch = await parse_body(request, StepBatch)
    return await accept(landing, step_records(batch.steps, tenant, idempotency_key))


@router.post("/feedback", response_model=Accepted, openapi_extra=json_body(Feedback))
async def submit_feedback(
    request: Request, tenant: TenantDep, landing: LandingDep, idempotency_key: IdempotencyKeyDep
) -> Accepted:
    """Record a reward or human feedback about a step or a trajectory."""
    feedback = await parse_body(request, Feedback)
    return await accept(landing, [fact_record(feedback, "feedback", tenant, idempotency_key)])


@router.post("/events", response_model=Accepted, openapi_extra=json_body(Event))
async def submit_event(
    request: Request, tenant: TenantDep, landing: LandingDep, idempotency_key: IdempotencyKeyDep
) -> Accepted:
    """Record a live interaction event from a black-box service."""
    event = await parse_body(request, Event)
    return await accept(landing, [fact_record(event, "event", tenant, idempotency_key)])


@router.post(
    "/trajectories/{trajectory_uid}/complete",
    response_model=Accepted,
    openapi_extra=json_body(TrajectoryCompletion, required=False),
)
async def complete_trajectory(
    trajectory_uid: TrajectoryUid,
    request: Request,
    tenant: TenantDep,
    landing: LandingDep,
    idempotency_key: IdempotencyKeyDep,
) -> Accepted:
    """Close a trajectory, optionally with its reward."""
    body = await parse_body(request, TrajectoryCompletion, optional=True)
    completed = TrajectoryCompleted(trajectory_uid=trajectory_uid, **body.model_dump())
    record = fact_record(completed, "trajectory_complete", tenant, idempotency_key)
    return await accept(landing, [record])
