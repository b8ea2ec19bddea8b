"""Claw-R1 compatibility: agents written for that gateway work unchanged."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from claw_pipelines.contracts.wire import Accepted, SubmitStepsRequest
from gateway.deps import IDEMPOTENCY_HEADER_DOC, caller_of, parse_body
from gateway.errors import ERROR_RESPONSES
from gateway.intake import accept, step_records
from gateway.openapi import json_body

router = APIRouter(tags=["claw-r1"], responses=ERROR_RESPONSES)


@router.post(
    "/submit_steps",
    response_model=Accepted,
    openapi_extra=json_body(SubmitStepsRequest, parameters=[IDEMPOTENCY_HEADER_DOC]),
)
async def submit_steps_claw_r1(
    request: Request,
) -> Response:
    """Claw-R1 step submission; unknown step fields are kept in the payload."""
    caller = caller_of(request)
    body = await parse_body(request, SubmitStepsRequest)
    return await accept(
        caller.landing, step_records(body.steps, caller.tenant, caller.idempotency_key)
    )
