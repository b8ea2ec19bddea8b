"""Claw-R1 compatibility: agents written for that gateway work unchanged."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from gateway.errors import ERROR_RESPONSES
from gateway.routes.ingest import write, write_route
from gateway.writes import CLAW_R1_STEPS

router = APIRouter(responses=ERROR_RESPONSES, tags=["claw-r1"])


@write_route(CLAW_R1_STEPS, on=router)
async def submit_steps_claw_r1(request: Request) -> Response:
    """Claw-R1 step submission; unknown step fields are kept in the payload."""
    return await write(CLAW_R1_STEPS, request)
