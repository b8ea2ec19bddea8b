"""The gateway's outer layer: limits, metrics, and routing through the one route table.

Every request passes here first. With API keys configured, every request but health (and
/metrics when `CLAW_METRICS_PUBLIC`) must present one (401) before anything else is answered,
on the table's routes and on FastAPI's (/docs, /openapi.json, 404, 405) alike, and a
websocket handshake too (closed with 1008: the gateway serves none); then bodies are refused
early (a declared Content-Length over the limit: 413; a body that is not JSON: 415). A
request whose method and path are in the route table (gateway.routes) is answered straight
from ASGI by its handler; anything else (the OpenAPI docs, a 404 or 405) goes on to FastAPI.
FastAPI's per-request machinery costs more than a durable write itself
(benchmarks/gateway_ingest.py), so no table route runs through it,
and the app refuses middlewares and dependencies (gateway.main.GatewayApp), which would not
run on the table's routes: cross-cutting work belongs in this layer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.asgi import send_answer, send_body
from gateway.auth import KeyRing
from gateway.errors import ApiError, error_body
from gateway.incoming import Incoming, media_of, tenant_of
from gateway.metrics import GatewayMetrics, labelled
from gateway.routes.table import RouteTable
from gateway.services import GatewayServices

log = logging.getLogger(__name__)
BODY_METHODS = {"POST", "PUT", "PATCH"}


def _is_json(media: str) -> bool:
    return media == "application/json" or media.endswith("+json")


async def _answer_error(send: Send, error: ApiError, path: str = "") -> None:
    """Send an ApiError in its route's shape (OpenAI's envelope; Anthropic's on /v1/messages)."""
    body = json.dumps(error_body(path, error)).encode()
    await send_body(send, error.status, body, headers=error.headers)


def _headers(scope: Scope) -> dict[str, str]:
    """A request's headers by lower-case name (the first of repeated ones)."""
    headers: dict[str, str] = {}
    for name, value in scope["headers"]:
        key = name.decode("latin-1")
        if key not in headers:
            headers[key] = value.decode("latin-1")
    return headers


class Dispatcher:
    """Serves the route table's requests; passes everything else to `fallback` (FastAPI)."""

    def __init__(
        self,
        fallback: ASGIApp,
        routes: RouteTable,
        metrics: GatewayMetrics,
        max_body_bytes: int,
        keys: KeyRing | None = None,
        open_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.fallback = fallback
        self.routes = routes
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.keys = keys or KeyRing()
        self.open_paths = open_paths  # answered without a key
        self.services: GatewayServices | None = None  # set by the app's lifespan

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":  # lifespan
            return await self.fallback(scope, receive, send)
        started = time.perf_counter()
        status = 500
        label = None

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            headers = _headers(scope)
            try:
                tenant = self._authenticate(scope["path"], headers)  # before anything else
                matched = self.routes.match(scope["method"], scope["path"])
                if scope["method"] in BODY_METHODS:
                    media = matched[0].media_types if matched is not None else ()
                    refusal = self._refusal(headers, media)
                    if refusal is not None:
                        raise refusal
            except ApiError as refused:  # no or a wrong key; a body refused; a bad uid
                return await self._refuse(send_with_status, refused, scope["path"])
            if matched is None or self.services is None:
                return await self.fallback(scope, receive, send_with_status)
            route, params = matched
            label = route.path
            incoming = Incoming(self.services, headers, params, receive, scope, tenant)
            try:
                answer = await route.handle(incoming)
            except ApiError as exc:
                return await self._refuse(send_with_status, exc, scope["path"])
            except Exception:
                log.exception("unhandled error on %s %s", scope["method"], scope["path"])
                error = ApiError(
                    500, "internal error; the request was not stored", code="internal_error"
                )
                return await self._refuse(send_with_status, error, scope["path"])
            await send_answer(answer, scope, receive, send_with_status)
        finally:
            label = label or getattr(scope.get("route"), "path", None) or "unmatched"
            labelled(self.metrics.requests, label, str(status)).inc()
            labelled(self.metrics.request_seconds, label).observe(time.perf_counter() - started)

    async def _refuse(self, send: Send, error: ApiError, path: str = "") -> None:
        """Answer an error, counted by its reason (its code, else its status)."""
        labelled(self.metrics.rejected, error.code or f"http_{error.status}").inc()
        await _answer_error(send, error, path)

    def _authenticate(self, path: str, headers: dict[str, str]) -> str | None:
        """The tenant of the request's key (401 without a valid one), or None when keys are
        off or the path is open."""
        if not self.keys.enabled or path in self.open_paths:
            return None
        return tenant_of(self.keys, headers)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A websocket handshake: refused (closed, 1008) without a valid key when keys are
        set; FastAPI answers the rest (no route of the gateway is a websocket)."""
        try:
            self._authenticate(scope["path"], _headers(scope))
        except ApiError as refused:
            labelled(self.metrics.rejected, refused.code or "http_401").inc()
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.fallback(scope, receive, send)

    def _refusal(self, headers: dict[str, str], media: Sequence[str] = ()) -> ApiError | None:
        """Why a body is refused before it is read (its declared length over the limit; not
        JSON nor one of the route's `media` types), or None."""
        limit = self.max_body_bytes
        length = headers.get("content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return ApiError(400, "invalid Content-Length", code="invalid_header")
            if declared > limit:
                return ApiError(
                    413,
                    f"body of {declared} bytes exceeds the limit of {limit} bytes",
                    code="body_too_large",
                )
        has_body = "transfer-encoding" in headers or length not in (None, "0")
        content_type = headers.get("content-type")
        given = media_of(content_type)
        if has_body and not _is_json(given) and given not in media:
            allowed = " or ".join(["application/json", *media])
            return ApiError(
                415,
                f"Content-Type must be {allowed}, got {content_type!r}",
                param="Content-Type",
                code="unsupported_media_type",
            )
        return None
