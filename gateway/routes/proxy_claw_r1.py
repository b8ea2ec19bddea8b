"""Claw-R1 trajectory routes: init a trajectory, chat through its base URL, register its
policy version, complete it with a reward. Agents written for that gateway work unchanged."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from claw_pipelines.contracts.ids import new_event_id
from claw_pipelines.contracts.wire import Accepted, TrajectoryCompleted
from gateway.deps import IDEMPOTENCY_HEADER_DOC, caller_of, parse_body
from gateway.errors import ERROR_RESPONSES, from_pydantic
from gateway.intake import accept, fact_record
from gateway.openapi import json_body
from gateway.proxy.protocol import (
    CompleteTrajectory,
    InitTrajectory,
    RegisterTrajectory,
    TrajectoryInitialized,
    TrajectoryRegistered,
)
from gateway.routes.proxy import (
    CLAW_R1_CHAT,
    CLAW_R1_COMPLETIONS,
    CLAW_R1_PREFIX,
    PROXY_RESPONSES,
    SCOPED_CHAT_DOC,
    SCOPED_COMPLETION_DOC,
    PathUid,
    forward,
    list_models,
)

router = APIRouter(tags=["claw-r1"], responses=ERROR_RESPONSES)
PREFIX = CLAW_R1_PREFIX


@router.post(
    "/init_trajectory",
    response_model=TrajectoryInitialized,
    openapi_extra=json_body(InitTrajectory, required=False),
)
async def init_trajectory(request: Request) -> TrajectoryInitialized:
    """Start a trajectory; answer the OpenAI base URL its calls go to."""
    caller_of(request)
    body = await parse_body(request, InitTrajectory, optional=True)
    trajectory_uid = body.trajectory_uid or new_event_id()
    prompt_uid = body.prompt_uid or new_event_id()
    metadata = body.metadata.model_dump(exclude_none=True)
    if metadata:
        request.app.state.proxy.book.register(trajectory_uid, metadata)
    base = str(request.base_url).rstrip("/")
    return TrajectoryInitialized(
        trajectory_uid=trajectory_uid,
        prompt_uid=prompt_uid,
        base_url=f"{base}/{trajectory_uid}/{prompt_uid}/v1",
    )


@router.post(CLAW_R1_CHAT.path, responses=PROXY_RESPONSES, openapi_extra=SCOPED_CHAT_DOC)
async def claw_r1_chat_completions(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """Chat completions of a Claw-R1 trajectory; step_index counts up per trajectory."""
    return await forward(request, CLAW_R1_CHAT, trajectory_uid, prompt_uid)


@router.post(
    CLAW_R1_COMPLETIONS.path, responses=PROXY_RESPONSES, openapi_extra=SCOPED_COMPLETION_DOC
)
async def claw_r1_completions(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """Legacy completions of a Claw-R1 trajectory."""
    return await forward(request, CLAW_R1_COMPLETIONS, trajectory_uid, prompt_uid)


@router.get(PREFIX + "/models", responses=PROXY_RESPONSES)
async def claw_r1_models(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """The upstream's models, under a Claw-R1 base URL."""
    return await list_models(request)


@router.post(
    PREFIX + "/register_trajectory",
    response_model=TrajectoryRegistered,
    openapi_extra=json_body(RegisterTrajectory, required=False),
)
async def register_trajectory(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> TrajectoryRegistered:
    """Register a trajectory's metadata; its `policy_version` applies to later steps."""
    caller_of(request)
    body = await parse_body(request, RegisterTrajectory, optional=True)
    book = request.app.state.proxy.book
    book.register(trajectory_uid, body.metadata.model_dump(exclude_none=True))
    version, _ = book.registered(trajectory_uid)
    return TrajectoryRegistered(
        trajectory_uid=trajectory_uid, prompt_uid=prompt_uid, policy_version=version
    )


@router.post(
    PREFIX + "/complete_trajectory",
    response_model=Accepted,
    openapi_extra=json_body(
        CompleteTrajectory, required=False, parameters=[IDEMPOTENCY_HEADER_DOC]
    ),
)
async def complete_trajectory(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """Close a Claw-R1 trajectory, optionally with its reward (a `trajectory_complete` record)."""
    caller = caller_of(request)
    body = await parse_body(request, CompleteTrajectory, optional=True)
    extra = body.model_extra or {}
    metadata = {"prompt_uid": prompt_uid, **body.metadata, **({"claw_r1": extra} if extra else {})}
    try:
        completed = TrajectoryCompleted(
            trajectory_uid=trajectory_uid,
            reward=body.reward,
            status=body.status,
            metadata=metadata,
            event_id=body.event_id,
        )
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    record = fact_record(completed, "trajectory_complete", caller.tenant, caller.idempotency_key)
    answer = await accept(caller.landing, [record])
    return Response(answer, media_type="application/json")
