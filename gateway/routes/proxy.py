"""OpenAI-compatible proxy for black-box agents: only their base URL changes.

`/v1/...` (scoped by the X-Claw-* headers, or unscoped) and the scoped base URL
`/t/{trajectory_uid}/g/{prompt_uid}/v1/...`. Each choice becomes one step.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Path, Request, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN, is_uid
from claw_pipelines.contracts.wire import ErrorResponse
from gateway.asgi import send_body
from gateway.deps import (
    IDEMPOTENCY_HEADER_DOC,
    caller_of,
    idempotency_key_of,
    read_asgi_body,
    tenant_of,
)
from gateway.errors import ERROR_RESPONSES
from gateway.openapi import json_body
from gateway.proxy import ProxyAnswer, ProxyCall, parse_request, scope_of
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


@dataclass(frozen=True, slots=True)
class ProxyRoute:
    """A proxied completion route: its path template (the metrics label), endpoint and how
    it scopes calls."""

    path: str
    endpoint: Endpoint
    via: str


URL_PREFIX = "/t/{trajectory_uid}/g/{prompt_uid}/v1"
CLAW_R1_PREFIX = "/{trajectory_uid}/{prompt_uid}/v1"
UNSCOPED_CHAT = ProxyRoute("/v1/chat/completions", CHAT, "url")
UNSCOPED_COMPLETIONS = ProxyRoute("/v1/completions", COMPLETIONS, "url")
URL_CHAT = ProxyRoute(URL_PREFIX + "/chat/completions", CHAT, "url")
URL_COMPLETIONS = ProxyRoute(URL_PREFIX + "/completions", COMPLETIONS, "url")
CLAW_R1_CHAT = ProxyRoute(CLAW_R1_PREFIX + "/chat/completions", CHAT, "claw_r1")
CLAW_R1_COMPLETIONS = ProxyRoute(CLAW_R1_PREFIX + "/completions", COMPLETIONS, "claw_r1")
_UNSCOPED = {r.path: r for r in (UNSCOPED_CHAT, UNSCOPED_COMPLETIONS)}
_ENDPOINTS = r"/v1/(chat/completions|completions)"
_SCOPED = [
    (
        re.compile(r"/t/([^/]+)/g/([^/]+)" + _ENDPOINTS),
        {"chat/completions": URL_CHAT, "completions": URL_COMPLETIONS},
    ),
    (
        re.compile(r"/([^/]+)/([^/]+)" + _ENDPOINTS),
        {"chat/completions": CLAW_R1_CHAT, "completions": CLAW_R1_COMPLETIONS},
    ),
]


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


async def serve_call(
    state: Any,
    headers: Mapping[str, str],
    receive: Receive,
    route: ProxyRoute,
    trajectory_uid: str | None = None,
    prompt_uid: str | None = None,
) -> ProxyAnswer | StreamRelay:
    """Authenticate, scope and forward one call (the FastAPI routes and the ASGI fast path
    both come here); the upstream's answer, or a relay of its stream."""
    received = time.perf_counter()
    tenant = tenant_of(state.keys, headers)
    idempotency_key = idempotency_key_of(headers)
    scope = scope_of(headers, trajectory_uid, prompt_uid, route.via)
    settings = state.settings
    raw = await read_asgi_body(receive, settings.max_body_bytes, settings.body_read_timeout_s)
    body, request_json = parse_request(raw)
    call = ProxyCall(route.endpoint, body, request_json, scope, tenant, idempotency_key, received)
    return await state.proxy.complete(call)


async def send_answer(
    answer: ProxyAnswer | StreamRelay, scope: Scope, receive: Receive, send: Send
):
    """Send a proxied answer over ASGI (a stream through RelayResponse)."""
    if isinstance(answer, StreamRelay):
        return await RelayResponse(answer)(scope, receive, send)
    await send_body(send, answer.status, answer.body, answer.media_type, answer.headers)


def match_proxy(path: str) -> tuple[ProxyRoute, str | None, str | None] | None:
    """The proxied completion route of a POST path and its (valid) uids; None otherwise, and
    for invalid uids, which FastAPI's routes answer naming the field."""
    route = _UNSCOPED.get(path)
    if route is not None:
        return route, None, None
    for pattern, routes in _SCOPED:
        found = pattern.fullmatch(path)
        if found:
            trajectory, prompt, endpoint = found.groups()
            if is_uid(trajectory) and is_uid(prompt):
                return routes[endpoint], trajectory, prompt
            return None
    return None


async def forward(
    request: Request,
    route: ProxyRoute,
    trajectory_uid: str | None = None,
    prompt_uid: str | None = None,
) -> Response:
    """The FastAPI side of `serve_call`."""
    state = request.app.state
    answer = await serve_call(
        state, request.headers, request.receive, route, trajectory_uid, prompt_uid
    )
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


@router.post(UNSCOPED_CHAT.path, openapi_extra=CHAT_DOC)
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions through the gateway (streamed or not); one step per choice."""
    return await forward(request, UNSCOPED_CHAT)


@router.post(UNSCOPED_COMPLETIONS.path, openapi_extra=COMPLETION_DOC)
async def completions(request: Request) -> Response:
    """OpenAI legacy completions through the gateway; one step per choice."""
    return await forward(request, UNSCOPED_COMPLETIONS)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The upstream's models, passed through."""
    return await list_models(request)


@router.post(URL_CHAT.path, openapi_extra=SCOPED_CHAT_DOC)
async def scoped_chat_completions(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """Chat completions scoped by the base URL to a trajectory and prompt group."""
    return await forward(request, URL_CHAT, trajectory_uid, prompt_uid)


@router.post(URL_COMPLETIONS.path, openapi_extra=SCOPED_COMPLETION_DOC)
async def scoped_completions(
    trajectory_uid: PathUid, prompt_uid: PathUid, request: Request
) -> Response:
    """Legacy completions scoped by the base URL to a trajectory and prompt group."""
    return await forward(request, URL_COMPLETIONS, trajectory_uid, prompt_uid)


@router.get(URL_PREFIX + "/models")
async def scoped_models(trajectory_uid: PathUid, prompt_uid: PathUid, request: Request) -> Response:
    """The upstream's models, under a scoped base URL."""
    return await list_models(request)
