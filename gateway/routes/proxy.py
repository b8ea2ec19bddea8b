"""OpenAI-compatible proxy for black-box agents: only their base URL changes.

`/v1/...` (scoped by the X-Claw-* headers, or unscoped) and the scoped base URL
`/t/{trajectory_uid}/g/{prompt_uid}/v1/...`. Each choice becomes one step.
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Path, Request, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN
from claw_pipelines.contracts.wire import ErrorResponse
from gateway.deps import IDEMPOTENCY_HEADER_DOC, caller_of, read_body
from gateway.errors import ERROR_RESPONSES
from gateway.openapi import json_body
from gateway.proxy import ProxyAnswer, ProxyCall, ProxyService, parse_request, scope_of
from gateway.proxy.capture import CHAT, COMPLETIONS, Endpoint
from gateway.proxy.protocol import ChatCompletionBody, CompletionBody
from gateway.proxy.relay import StreamRelay

PathUid = Annotated[str, Path(min_length=1, max_length=MAX_UID_CHARS, pattern=UID_PATTERN)]

PROXY_RESPONSES: dict[int | str, dict[str, Any]] = ERROR_RESPONSES | {
    200: {
        "description": "The upstream's answer (JSON, or server-sent events when streamed)",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
    502: {"model": ErrorResponse, "description": "Upstream unreachable, failed (5xx) or garbled"},
    503: {
        "model": ErrorResponse,
        "description": "No upstream configured, or the gateway cannot record right now",
    },
    504: {"model": ErrorResponse, "description": "Upstream timed out"},
}
POLICY_HEADER_DOC = {
    "name": "X-Claw-Policy-Version",
    "in": "header",
    "required": False,
    "description": "policy version of the model that answers",
    "schema": {"type": "integer", "minimum": 0},
}
SCOPE_HEADERS_DOC = [
    {
        "name": "X-Claw-Trajectory",
        "in": "header",
        "required": False,
        "description": "trajectory of this call's steps (step_index counts up per trajectory)",
        "schema": {"type": "string", "maxLength": MAX_UID_CHARS, "pattern": UID_PATTERN},
    },
    {
        "name": "X-Claw-Prompt-Group",
        "in": "header",
        "required": False,
        "description": "prompt group (GRPO) of this call's steps",
        "schema": {"type": "string", "maxLength": MAX_UID_CHARS, "pattern": UID_PATTERN},
    },
    POLICY_HEADER_DOC,
    IDEMPOTENCY_HEADER_DOC,
]
URL_SCOPED_HEADERS_DOC = [POLICY_HEADER_DOC, IDEMPOTENCY_HEADER_DOC]
CHAT_DOC = json_body(ChatCompletionBody, parameters=SCOPE_HEADERS_DOC)
COMPLETION_DOC = json_body(CompletionBody, parameters=SCOPE_HEADERS_DOC)
SCOPED_CHAT_DOC = json_body(ChatCompletionBody, parameters=URL_SCOPED_HEADERS_DOC)
SCOPED_COMPLETION_DOC = json_body(CompletionBody, parameters=URL_SCOPED_HEADERS_DOC)

router = APIRouter(tags=["proxy"], responses=PROXY_RESPONSES)


class RelayResponse(StreamingResponse):
    """Streams a relay to the client, and always ends it (recording what was received)."""

    def __init__(self, relay: StreamRelay) -> None:
        super().__init__(
            relay.body,
            status_code=relay.status,
            media_type=relay.content_type,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.relay.close()


async def forward(
    request: Request,
    endpoint: Endpoint,
    trajectory_uid: str | None = None,
    prompt_uid: str | None = None,
    via: str = "url",
) -> Response:
    """Authenticate, scope and forward one call; answer as the upstream did."""
    caller = caller_of(request)
    scope = scope_of(request.headers, trajectory_uid, prompt_uid, via)
    body, request_json = parse_request(await read_body(request))
    service: ProxyService = request.app.state.proxy
    call = ProxyCall(endpoint, body, request_json, scope, caller.tenant, caller.idempotency_key)
    answer = await service.complete(call)
    if isinstance(answer, StreamRelay):
        return RelayResponse(answer)
    return _response(answer)


async def list_models(request: Request) -> Response:
    """Authenticate, then pass the upstream's model list through."""
    caller = caller_of(request)
    return _response(await request.app.state.proxy.models(caller.tenant))


def _response(answer: ProxyAnswer) -> Response:
    return Response(
        answer.body, status_code=answer.status, media_type=answer.media_type, headers=answer.headers
    )


@router.post("/v1/chat/completions", openapi_extra=CHAT_DOC)
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions through the gateway (streamed or not); one step per choice."""
    return await forward(request, CHAT)


@router.post("/v1/completions", openapi_extra=COMPLETION_DOC)
async def completions(request: Request) -> Response:
    """OpenAI legacy completions through the gateway; one step per choice."""
    return await forward(request, COMPLETIONS)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The upstream's models, passed through."""
    return await list_models(request)


@router.post(
    "/t/{trajectory_uid}/g/{prompt_uid}/v1/chat/completions", openapi_extra=SCOPED_CHAT_DOC
)
async def scoped_chat_completions(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """Chat completions scoped by the base URL to a trajectory and prompt group."""
    return await forward(request, CHAT, trajectory_uid, prompt_uid)


@router.post(
    "/t/{trajectory_uid}/g/{prompt_uid}/v1/completions", openapi_extra=SCOPED_COMPLETION_DOC
)
async def scoped_completions(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """Legacy completions scoped by the base URL to a trajectory and prompt group."""
    return await forward(request, COMPLETIONS, trajectory_uid, prompt_uid)


@router.get("/t/{trajectory_uid}/g/{prompt_uid}/v1/models")
async def scoped_models(trajectory_uid: PathUid, prompt_uid: PathUid, request: Request) -> Response:
    """The upstream's models, under a scoped base URL."""
    return await list_models(request)
