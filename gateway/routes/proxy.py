"""OpenAI-compatible proxy for black-box agents: only their base URL changes.

`/v1/...` (scoped by the X-Claw-* headers, or unscoped) and the scoped base URL
`/t/{trajectory_uid}/g/{prompt_uid}/v1/...` (Claw-R1's `/{trajectory_uid}/{prompt_uid}/v1/...`
is in gateway.routes.claw_r1). Each choice becomes one step.
"""

from __future__ import annotations

import time
from typing import Any

import pydantic_core
from starlette.types import ASGIApp

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN
from claw_pipelines.contracts.wire import ErrorResponse
from gateway.asgi import Answer
from gateway.errors import ERROR_RESPONSES
from gateway.incoming import IDEMPOTENCY_HEADER_DOC, Incoming
from gateway.proxy import ProxyCall, parse_request, scope_of
from gateway.proxy.capture import CHAT, COMPLETIONS, Endpoint
from gateway.proxy.protocol import ChatCompletionBody, CompletionBody, MessagesBody, ResponsesBody
from gateway.proxy.relay import RelayResponse, StreamRelay
from gateway.proxy.token_in import TOKEN_IN_HEADER, header_mode
from gateway.routes.table import Route

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
# the Responses API answers 404 for a `previous_response_id` the gateway never recorded
RESPONSES_RESPONSES = PROXY_RESPONSES | {
    404: {"model": ErrorResponse, "description": "previous_response_id names no recorded response"}
}
POLICY_HEADER_DOC = {
    "name": "X-Claw-Policy-Version",
    "in": "header",
    "required": False,
    "description": "policy version of the model that answers",
    "schema": {"type": "integer", "minimum": 0},
}
TOKEN_IN_HEADER_DOC = {
    "name": "X-Claw-Token-In",
    "in": "header",
    "required": False,
    "description": "scoped chat calls: send the trajectory's exact token ids upstream (on), "
    "when possible (auto) or never (off); default CLAW_TOKEN_IN",
    "schema": {"type": "string", "enum": ["on", "auto", "off"]},
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
    TOKEN_IN_HEADER_DOC,
    IDEMPOTENCY_HEADER_DOC,
]
URL_SCOPED_HEADERS_DOC = [POLICY_HEADER_DOC, TOKEN_IN_HEADER_DOC, IDEMPOTENCY_HEADER_DOC]
ANTHROPIC_VERSION_DOC = {
    "name": "anthropic-version",
    "in": "header",
    "required": False,
    "description": "Anthropic API version the client speaks (kept on the step)",
    "schema": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
}


def retry_count(value: str | None) -> int:
    """The client's retry count of a call (0 when absent or not a small integer)."""
    if value is None or not (value.isascii() and value.isdigit() and len(value) < 6):
        return 0
    return int(value)


async def forward(
    incoming: Incoming, endpoint: Endpoint, via: str, protocol: str | None = None
) -> Answer | ASGIApp:
    """Authenticate, scope and forward one call; the upstream's answer, or a relay of its
    stream. The scope comes from the path (`via`: url, claw_r1) when it has uids, else from
    the X-Claw-* headers. `protocol` (`responses`, `messages`): the call is translated to a
    chat completion, and its answer back."""
    received = time.perf_counter()
    tenant = incoming.tenant()
    idempotency_key = incoming.idempotency_key()
    params = incoming.params
    scope = scope_of(incoming.headers, params.get("trajectory_uid"), params.get("prompt_uid"), via)
    body, request_json = parse_request(await incoming.body())
    dialect = audit = None
    if protocol is not None:
        dialect = await incoming.services.proxy.translate(
            protocol, body, scope, incoming.headers, tenant
        )
        scope, audit, body = dialect.scope, request_json, dialect.chat
        request_json = pydantic_core.to_json(body)
    call = ProxyCall(endpoint, body, request_json, scope, tenant, idempotency_key, received)
    call.dialect, call.audit_json = dialect, audit
    call.token_in = header_mode(incoming.headers.get(TOKEN_IN_HEADER))
    call.client_retry = retry_count(incoming.headers.get(RETRY_COUNT_HEADER))
    answer = await incoming.services.proxy.complete(call)
    return RelayResponse(answer) if isinstance(answer, StreamRelay) else answer


async def list_models(incoming: Incoming) -> Answer:
    """The upstream's models, passed through (after authentication)."""
    return await incoming.services.proxy.models(incoming.tenant())


async def chat_completions(incoming: Incoming) -> Answer | ASGIApp:
    """OpenAI chat completions through the gateway (streamed or not); one step per choice."""
    return await forward(incoming, CHAT, "url")


async def completions(incoming: Incoming) -> Answer | ASGIApp:
    """OpenAI legacy completions through the gateway; one step per choice."""
    return await forward(incoming, COMPLETIONS, "url")


async def responses(incoming: Incoming) -> Answer | ASGIApp:
    """OpenAI Responses API through the gateway (streamed or not), as the upstream's chat
    completions; `previous_response_id` resolved from what the gateway recorded; one step."""
    return await forward(incoming, CHAT, "url", "responses")


async def messages(incoming: Incoming) -> Answer | ASGIApp:
    """Anthropic Messages API through the gateway (streamed or not), as the upstream's chat
    completions; errors in Anthropic's shape; one step."""
    return await forward(incoming, CHAT, "url", "messages")


def completion_route(
    path: str, handle, body, headers, tag="proxy", doc=None, responses=PROXY_RESPONSES
) -> Route:
    """A proxied (chat) completion route."""
    return Route(
        "POST", path, handle, tag, body=body, responses=responses, headers=headers, doc=doc
    )


def models_route(path: str, tag: str = "proxy", doc: str | None = None) -> Route:
    """The upstream's model list under a base URL."""
    return Route("GET", path, list_models, tag, responses=PROXY_RESPONSES, doc=doc)


RETRY_COUNT_HEADER = "x-stainless-retry-count"  # what OpenAI's SDKs send on every call
URL_PREFIX = "/t/{trajectory_uid}/g/{prompt_uid}/v1"
ROUTES = [
    completion_route(
        "/v1/chat/completions", chat_completions, ChatCompletionBody, SCOPE_HEADERS_DOC
    ),
    completion_route("/v1/completions", completions, CompletionBody, SCOPE_HEADERS_DOC),
    models_route("/v1/models"),
    completion_route(
        "/v1/responses",
        responses,
        ResponsesBody,
        SCOPE_HEADERS_DOC,
        responses=RESPONSES_RESPONSES,
    ),
    completion_route(
        "/v1/messages", messages, MessagesBody, [*SCOPE_HEADERS_DOC, ANTHROPIC_VERSION_DOC]
    ),
    completion_route(
        URL_PREFIX + "/chat/completions",
        chat_completions,
        ChatCompletionBody,
        URL_SCOPED_HEADERS_DOC,
        doc="Chat completions scoped by the base URL to a trajectory and prompt group.",
    ),
    completion_route(
        URL_PREFIX + "/completions",
        completions,
        CompletionBody,
        URL_SCOPED_HEADERS_DOC,
        doc="Legacy completions scoped by the base URL to a trajectory and prompt group.",
    ),
    models_route(URL_PREFIX + "/models", doc="The upstream's models, under a scoped base URL."),
    completion_route(
        URL_PREFIX + "/responses",
        responses,
        ResponsesBody,
        URL_SCOPED_HEADERS_DOC,
        doc="Responses API calls scoped by the base URL to a trajectory and prompt group.",
        responses=RESPONSES_RESPONSES,
    ),
    completion_route(
        URL_PREFIX + "/messages",
        messages,
        MessagesBody,
        [*URL_SCOPED_HEADERS_DOC, ANTHROPIC_VERSION_DOC],
        doc="Anthropic Messages calls scoped by the base URL to a trajectory and prompt group.",
    ),
]
