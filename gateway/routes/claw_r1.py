"""Claw-R1 compatibility: agents written for that gateway work unchanged."""

from __future__ import annotations

from fastapi import APIRouter, Request

from claw_pipelines.contracts.wire import Accepted, SubmitStepsRequest
from gateway.deps import IdempotencyKeyDep, LandingDep, TenantDep, parse_body
from gateway.errors import ERROR_RESPONSES
from gateway.intake import accept, step_records
from gateway.openapi import json_body

router = APIRouter(tags=["claw-r1"], responses=ERROR_RESPONSES)


@router.post("/submit_steps", response_model=Accepted, openapi_extra=json_body(SubmitStepsRequest))
async def submit_steps_claw_r1(
    request: Request, tenant: TenantDep, landing: LandingDep, idempotency_key: IdempotencyKeyDep
) -> Accepted:
    """Claw-R1 step submission; unknown step fields are kept in the payload."""
    body = await parse_body(request, SubmitStepsRequest)
    return await accept(landing, step_records(body.steps, tenant, idempotency_key))
