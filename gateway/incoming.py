"""One request as every handler sees it (`Incoming`): who sends it, its options, its body."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN, is_uid
from gateway.auth import DEFAULT_TENANT, KeyRing, presented_key
from gateway.deadlines import ReadDeadlines
from gateway.errors import ApiError, from_pydantic
from gateway.services import GatewayServices

ModelT = TypeVar("ModelT", bound=BaseModel)

IDEMPOTENCY_HEADER_DOC = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "description": "event_id of the record (`key:i` for the i-th record of a batch)",
    "schema": {"type": "string", "maxLength": MAX_UID_CHARS - 8, "pattern": UID_PATTERN},
}


@dataclass(slots=True)
class Incoming:
    """A request matched in the route table: its services, lower-case headers (the first of
    repeated ones), path parameters (validated), and its body still to be received."""

    services: GatewayServices
    headers: Mapping[str, str]
    params: Mapping[str, str]
    receive: Receive
    scope: Scope
    authenticated: str | None = None  # the tenant, once the dispatcher checked the key

    @property
    def base_url(self) -> str:
        """The URL the client reached the gateway at (scheme, host, root path)."""
        host = self.headers.get("host")
        if host is None:
            server = self.scope.get("server") or ("localhost", None)
            host = server[0] if server[1] in (None, 80, 443) else f"{server[0]}:{server[1]}"
        return f"{self.scope.get('scheme', 'http')}://{host}{self.scope.get('root_path', '')}"

    def tenant(self) -> str:
        """The tenant of the presented API key (401 when missing or unknown)."""
        if self.authenticated is None:
            self.authenticated = tenant_of(self.services.keys, self.headers)
        return self.authenticated

    def idempotency_key(self) -> str | None:
        """The `Idempotency-Key` header, validated like an event_id (422 otherwise)."""
        return idempotency_key_of(self.headers)

    async def body(self) -> bytes:
        """The body, bounded by `CLAW_MAX_BODY_BYTES` (413) and in time (408)."""
        services = self.services
        return await read_body(self.receive, services.settings.max_body_bytes, services.deadlines)

    async def json(self, model: type[ModelT], *, optional: bool = False) -> ModelT:
        """The body validated against `model` (400 for bad JSON, 422 naming the field)."""
        return parse_json(model, await self.body(), optional=optional)


def media_of(content_type: str | None) -> str:
    """The media type of a Content-Type header, lower case, without its parameters."""
    return (content_type or "").split(";", 1)[0].strip().lower()


def tenant_of(keys: KeyRing, headers: Mapping[str, str]) -> str:
    """The tenant of the presented API key (401 when missing or unknown)."""
    if not keys.enabled:
        return DEFAULT_TENANT
    key = presented_key(headers.get("authorization"), headers.get("x-api-key"))
    if key is None:
        raise ApiError(
            401,
            "missing API key: send 'Authorization: Bearer <key>'",
            code="missing_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    tenant = keys.tenant_for(key)
    if tenant is None:
        raise ApiError(
            401, "invalid API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
    return tenant


def idempotency_key_of(headers: Mapping[str, str]) -> str | None:
    """The `Idempotency-Key` header, validated like an event_id."""
    value = headers.get("idempotency-key")
    if value is not None and not is_uid(value, MAX_UID_CHARS - 8):
        raise ApiError(
            422,
            "Idempotency-Key: use letters, digits and ._:@+=- (at most 248 characters)",
            param="Idempotency-Key",
            code="invalid_header",
        )
    return value


async def read_body(receive: Receive, limit: int, deadlines: ReadDeadlines) -> bytes:
    """An ASGI request body, bounded in size (413) and in time (408: `deadlines` cuts it)."""
    chunks, size = [], 0
    task = deadlines.watch()
    try:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ApiError(400, "client disconnected", code="client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413, f"body exceeds the limit of {limit} bytes", code="body_too_large"
                )
            chunks.append(chunk)
            if not message.get("more_body"):
                return b"".join(chunks)
    except asyncio.CancelledError:
        if not deadlines.was_cut(task):
            raise
        raise ApiError(408, "body not received in time", code="body_timeout") from None
    finally:
        deadlines.done(task)


def parse_json(model: type[ModelT], body: bytes, *, optional: bool = False) -> ModelT:
    """Validate a JSON body against `model` (400 for bad JSON, 422 naming the field)."""
    if optional and not body.strip():
        body = b"{}"
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None
