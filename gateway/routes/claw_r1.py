"""Claw-R1 compatibility: agents written for that gateway work unchanged.

Step submission, and its trajectory routes: init a trajectory, chat through its base URL
`/{trajectory_uid}/{prompt_uid}/v1`, register its policy version, complete it with a reward.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from claw_pipelines.contracts.ids import new_event_id
from claw_pipelines.contracts.wire import SubmitStepsRequest, TrajectoryCompleted
from gateway.asgi import Answer
from gateway.errors import ERROR_RESPONSES, from_pydantic
from gateway.incoming import Incoming
from gateway.proxy.capture import CHAT, COMPLETIONS
from gateway.proxy.protocol import (
    ChatCompletionBody,
    CompleteTrajectory,
    CompletionBody,
    InitTrajectory,
    RegisterTrajectory,
    TrajectoryInitialized,
    TrajectoryRegistered,
)
from gateway.records import fact_record
from gateway.routes.ingest import accept, build_steps, perform_write, write_route
from gateway.routes.proxy import (
    URL_SCOPED_HEADERS_DOC,
    completion_route,
    forward,
    models_route,
)
from gateway.routes.table import Route

PREFIX = "/{trajectory_uid}/{prompt_uid}/v1"
TAG = "claw-r1"


def _json(model: BaseModel) -> Answer:
    return Answer(200, model.model_dump_json().encode())


async def submit_steps_claw_r1(incoming: Incoming) -> Answer:
    """Claw-R1 step submission; unknown step fields are kept in the payload."""
    return await perform_write(incoming, SubmitStepsRequest, build_steps)


async def init_trajectory(incoming: Incoming) -> Answer:
    """Start a trajectory; answer the OpenAI base URL its calls go to."""
    incoming.tenant()
    body = await incoming.json(InitTrajectory, optional=True)
    trajectory_uid = body.trajectory_uid or new_event_id()
    prompt_uid = body.prompt_uid or new_event_id()
    metadata = body.metadata.model_dump(exclude_none=True)
    if metadata:
        incoming.services.proxy.book.register(trajectory_uid, metadata)
    return _json(
        TrajectoryInitialized(
            trajectory_uid=trajectory_uid,
            prompt_uid=prompt_uid,
            base_url=f"{incoming.base_url}/{trajectory_uid}/{prompt_uid}/v1",
        )
    )


async def chat_completions(incoming: Incoming):
    """Chat completions of a Claw-R1 trajectory; step_index counts up per trajectory."""
    return await forward(incoming, CHAT, "claw_r1")


async def completions(incoming: Incoming):
    """Legacy completions of a Claw-R1 trajectory."""
    return await forward(incoming, COMPLETIONS, "claw_r1")


async def register_trajectory(incoming: Incoming) -> Answer:
    """Register a trajectory's metadata; its `policy_version` applies to later steps."""
    incoming.tenant()
    body = await incoming.json(RegisterTrajectory, optional=True)
    trajectory_uid = incoming.params["trajectory_uid"]
    book = incoming.services.proxy.book
    book.register(trajectory_uid, body.metadata.model_dump(exclude_none=True))
    version, _ = book.registered(trajectory_uid)
    return _json(
        TrajectoryRegistered(
            trajectory_uid=trajectory_uid,
            prompt_uid=incoming.params["prompt_uid"],
            policy_version=version,
        )
    )


async def complete_trajectory(incoming: Incoming) -> Answer:
    """Close a Claw-R1 trajectory, optionally with its reward (a `trajectory_complete` record)."""
    tenant, key = incoming.tenant(), incoming.idempotency_key()
    body = await incoming.json(CompleteTrajectory, optional=True)
    extra = body.model_extra or {}
    metadata = {
        "prompt_uid": incoming.params["prompt_uid"],
        **body.metadata,
        **({"claw_r1": extra} if extra else {}),
    }
    try:
        completed = TrajectoryCompleted(
            trajectory_uid=incoming.params["trajectory_uid"],
            reward=body.reward,
            status=body.status,
            metadata=metadata,
            event_id=body.event_id,
        )
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    record = fact_record(completed, "trajectory_complete", tenant, key)
    return await accept(incoming.services.landing, [record])


ROUTES = [
    write_route("/submit_steps", submit_steps_claw_r1, SubmitStepsRequest, tag=TAG),
    Route(
        "POST",
        "/init_trajectory",
        init_trajectory,
        TAG,
        body=InitTrajectory,
        body_required=False,
        response_model=TrajectoryInitialized,
        responses=ERROR_RESPONSES,
    ),
    completion_route(
        PREFIX + "/chat/completions",
        chat_completions,
        ChatCompletionBody,
        URL_SCOPED_HEADERS_DOC,
        TAG,
    ),
    completion_route(
        PREFIX + "/completions", completions, CompletionBody, URL_SCOPED_HEADERS_DOC, TAG
    ),
    models_route(PREFIX + "/models", TAG, "The upstream's models, under a Claw-R1 base URL."),
    Route(
        "POST",
        PREFIX + "/register_trajectory",
        register_trajectory,
        TAG,
        body=RegisterTrajectory,
        body_required=False,
        response_model=TrajectoryRegistered,
        responses=ERROR_RESPONSES,
    ),
    write_route(
        PREFIX + "/complete_trajectory", complete_trajectory, CompleteTrajectory, False, TAG
    ),
]
