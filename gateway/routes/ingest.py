"""White-box ingestion: steps, feedback, events and trajectory completion.

These routes document the API and serve requests that bypass the gateway middleware; in the
running gateway the middleware's fast path answers them with the same `perform_write`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN
from claw_pipelines.contracts.wire import Accepted
from gateway.deps import IDEMPOTENCY_HEADER_DOC, read_body
from gateway.errors import ERROR_RESPONSES
from gateway.openapi import json_body
from gateway.writes import COMPLETE, EVENTS, FEEDBACK, STEPS, WriteRoute, perform_write

router = APIRouter(responses=ERROR_RESPONSES, tags=["ingestion"])
TrajectoryUid = Annotated[str, Path(min_length=1, max_length=MAX_UID_CHARS, pattern=UID_PATTERN)]


def write_route(route: WriteRoute, on: APIRouter = router):
    """Declare `POST route.path`: answers `Accepted`, body and Idempotency-Key documented."""
    extra = json_body(
        route.model, required=not route.optional_body, parameters=[IDEMPOTENCY_HEADER_DOC]
    )
    return on.post(route.path, response_model=Accepted, openapi_extra=extra)


async def write(route: WriteRoute, request: Request) -> Response:
    """Serve a write route through FastAPI."""
    body = await read_body(request)
    answer = await perform_write(
        route, request.app.state, request.headers, body, request.path_params
    )
    return Response(answer, media_type="application/json")


@write_route(STEPS)
async def submit_steps(request: Request) -> Response:
    """Submit token-level steps; a 200 means every step is durable."""
    return await write(STEPS, request)


@write_route(FEEDBACK)
async def submit_feedback(request: Request) -> Response:
    """Record a reward or human feedback about a step or a trajectory."""
    return await write(FEEDBACK, request)


@write_route(EVENTS)
async def submit_event(request: Request) -> Response:
    """Record a live interaction event from a black-box service."""
    return await write(EVENTS, request)


@write_route(COMPLETE)
async def complete_trajectory(trajectory_uid: TrajectoryUid, request: Request) -> Response:
    """Close a trajectory, optionally with its reward."""
    return await write(COMPLETE, request)
