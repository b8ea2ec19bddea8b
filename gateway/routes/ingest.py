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


def _write_route(path: str, body: type, required: bool = True):
    """`POST /v1<path>`: answers `Accepted`, body and Idempotency-Key documented."""
    extra = json_body(body, required=required, parameters=[IDEMPOTENCY_HEADER_DOC])
    return router.post(path, response_model=Accepted, openapi_extra=extra)


async def _land_fact(request: Request, model: type, kind: str) -> Response:
    caller = caller_of(request)
    fact = await parse_body(request, model)
    record = fact_record(fact, kind, caller.tenant, caller.idempotency_key)
    return await accept(caller.landing, [record])


@_write_route("/steps", StepBatch)
async def submit_steps(request: Request) -> Response:
    """Submit token-level steps; a 200 means every step is durable."""
    caller = caller_of(request)
    batch = await parse_body(request, StepBatch)
    records = step_records(batch.steps, caller.tenant, caller.idempotency_key)
    return await accept(caller.landing, records)


@_write_route("/feedback", Feedback)
async def submit_feedback(request: Request) -> Response:
    """Record a reward or human feedback about a step or a trajectory."""
    return await _land_fact(request, Feedback, "feedback")


@_write_route("/events", Event)
async def submit_event(request: Request) -> Response:
    """Record a live interaction event from a black-box service."""
    return await _land_fact(request, Event, "event")


@_write_route("/trajectories/{trajectory_uid}/complete", TrajectoryCompletion, required=False)
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
