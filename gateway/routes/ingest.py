"""White-box ingestion: steps, feedback, events and trajectory completion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from claw_pipelines.contracts.wire import (
    Accepted,
    Event,
    Feedback,
    StepBatch,
    TrajectoryCompleted,
    TrajectoryCompletion,
)
from claw_pipelines.contracts.wire_structs import checked_steps
from gateway.asgi import Answer
from gateway.errors import ERROR_RESPONSES, ApiError
from gateway.incoming import IDEMPOTENCY_HEADER_DOC, Incoming, parse_json
from gateway.landing import Landing, Overloaded
from gateway.records import BronzeRecord, fact_record, step_records
from gateway.routes.table import Route

# (body, tenant, idempotency key, incoming) -> the records it lands
Build = Callable[[Any, str, str | None, Incoming], list[BronzeRecord]]


async def land(landing: Landing, records: list[BronzeRecord]) -> int:
    """Land records durably; how many were duplicates. Overload becomes 503 with
    Retry-After."""
    try:
        _written, duplicates = await landing.land(records)
    except Overloaded as exc:
        raise ApiError(
            503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after)}
        ) from None
    return duplicates


async def accept(landing: Landing, records: list[BronzeRecord]) -> Answer:
    """Land records durably (`land`); the `Accepted` answer."""
    duplicates = await land(landing, records)
    # Accepted, serialized by hand on the hot path (event ids are validated, JSON-safe).
    ids = '","'.join(r.event_id for r in records)
    body = f'{{"accepted":{len(records)},"duplicates":{duplicates},"event_ids":["{ids}"]}}'
    return Answer(200, body.encode())


async def perform_write(
    incoming: Incoming, model: type[BaseModel], build: Build, optional: bool = False
) -> Answer:
    """Authenticate, validate, land durably (raises ApiError)."""
    tenant = incoming.tenant()
    key = incoming.idempotency_key()
    body = await incoming.body()
    parsed = parse_json(model, body, optional=optional)
    records = build(parsed, tenant, key, incoming)
    # Free the validated model (for steps: thousands of Python ints) before waiting on the
    # disk: freed now it is still in cache; freed after the wait it costs ~100 µs a request.
    del parsed, body
    return await accept(incoming.services.landing, records)


def published_step_records(steps, tenant: str, key: str | None, incoming: Incoming):
    """Step records; a step naming no policy version gets the published one."""
    published = incoming.services.landing.policy_version
    return step_records(steps, tenant, key, policy_version=published)


def build_steps(body: Any, tenant: str, key: str | None, incoming: Incoming):
    """The records of a body's steps (`published_step_records`)."""
    return published_step_records(body.steps, tenant, key, incoming)


def _fact(kind: str) -> Build:
    return lambda body, tenant, key, _incoming: [fact_record(body, kind, tenant, key)]


def _completion(body: Any, tenant: str, key: str | None, incoming: Incoming):
    uid = incoming.params["trajectory_uid"]
    completed = TrajectoryCompleted(trajectory_uid=uid, **body.model_dump())
    return [fact_record(completed, "trajectory_complete", tenant, key)]


async def submit_steps(incoming: Incoming) -> Answer:
    """Submit token-level steps; a 200 means every step is durable."""
    tenant = incoming.tenant()
    key = incoming.idempotency_key()
    body = await incoming.body()
    steps = checked_steps(body)  # the typed structs, at wire speed
    if steps is None:  # the model decides, and names the field when it refuses
        steps = parse_json(StepBatch, body).steps
    del body
    records = published_step_records(steps, tenant, key, incoming)
    del steps
    return await accept(incoming.services.landing, records)


async def submit_feedback(incoming: Incoming) -> Answer:
    """Record a reward or human feedback about a step or a trajectory."""
    return await perform_write(incoming, Feedback, _fact("feedback"))


async def submit_event(incoming: Incoming) -> Answer:
    """Record a live interaction event from a black-box service."""
    return await perform_write(incoming, Event, _fact("event"))


async def complete_trajectory(incoming: Incoming) -> Answer:
    """Close a trajectory, optionally with its reward."""
    return await perform_write(incoming, TrajectoryCompletion, _completion, optional=True)


def write_route(path: str, handle, body: type[BaseModel], required: bool = True, tag="ingestion"):
    """A POST route that lands records and answers `Accepted`."""
    return Route(
        "POST",
        path,
        handle,
        tag,
        body=body,
        body_required=required,
        response_model=Accepted,
        responses=ERROR_RESPONSES,
        headers=[IDEMPOTENCY_HEADER_DOC],
    )


ROUTES = [
    write_route("/v1/steps", submit_steps, StepBatch),
    write_route("/v1/feedback", submit_feedback, Feedback),
    write_route("/v1/events", submit_event, Event),
    write_route(
        "/v1/trajectories/{trajectory_uid}/complete",
        complete_trajectory,
        TrajectoryCompletion,
        required=False,
    ),
]
