"""Pure-ASGI middleware: early refusal of oversized or non-JSON bodies, and request metrics."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.asgi import send_body
from gateway.deps import read_asgi_body
from gateway.errors import ApiError, envelope
from gateway.metrics import GatewayMetrics, labelled
from gateway.routes.proxy import ProxyRoute, match_proxy, send_answer, serve_call
from gateway.writes import match_write, perform_write

log = logging.getLogger(__name__)
T = TypeVar("T")

BODY_METHODS = {"POST", "PUT", "PATCH"}
WRITE_HEADERS = {b"authorization", b"x-api-key", b"idempotency-key"}


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def _answer(send: Send, error: ApiError) -> None:
    """Send an ApiError in the OpenAI envelope."""
    body = json.dumps(envelope(error.status, error.message, error.param, error.code)).encode()
    await send_body(send, error.status, body, headers=error.headers)


async def _answered_errors(scope: Scope, send: Send, work: Awaitable[T]) -> T | None:
    """The result of a fast path's work; None once its error was answered (an ApiError as
    is, anything else as a logged 500)."""
    try:
        return await work
    except ApiError as exc:
        await _answer(send, exc)
    except Exception:
        log.exception("unhandled error on POST %s", scope["path"])
        await _answer(send, ApiError(500, "internal error; the request was not stored"))
    return None


class GatewayMiddleware:
    """The gateway's outer layer: refuse a declared Content-Length over the limit (413) and
    non-JSON bodies (415) before any parsing; serve the write routes on a fast path; count
    and time every request by route template and status.

    The fast path answers the write routes (gateway.writes) and the proxied completions
    (gateway.routes.proxy) straight from ASGI with the same `perform_write` / `serve_call` the
    FastAPI routes call: FastAPI's per-request machinery costs more than a durable write
    itself (benchmarks/gateway_ingest.py), and a fifth of what the proxy adds to a call
    (benchmarks/proxy_overhead.py).
    """

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, metrics: GatewayMetrics, state: Any
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_read_timeout_s = state.settings.body_read_timeout_s
        self.metrics = metrics
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500
        route_name = None

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            write = proxied = None
            if scope["method"] in BODY_METHODS:
                refusal, headers = self._inspect(scope)
                if refusal is not None:
                    return await _answer(send_with_status, refusal)
                if scope["method"] == "POST":
                    write = match_write(scope["path"])
                    proxied = None if write else match_proxy(scope["path"])
            if write is not None:
                route_name = write[0].path
                await self._serve_write(scope, receive, send_with_status, headers, *write)
            elif proxied is not None:
                route_name = proxied[0].path
                await self._serve_proxy(scope, receive, send_with_status, *proxied)
            else:
                await self.app(scope, receive, send_with_status)
        finally:
            route = route_name or getattr(scope.get("route"), "path", None) or "unmatched"
            labelled(self.metrics.requests, route, str(status)).inc()
            labelled(self.metrics.request_seconds, route).observe(time.perf_counter() - started)

    async def _serve_write(self, scope, receive, send, headers, route, params) -> None:
        async def write() -> bytes:
            body = await read_asgi_body(receive, self.max_body_bytes, self.body_read_timeout_s)
            return await perform_write(route, self.state, headers, body, params)

        answer = await _answered_errors(scope, send, write())
        if answer is not None:
            await send_body(send, 200, answer)

    async def _serve_proxy(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        route: ProxyRoute,
        trajectory_uid: str | None,
        prompt_uid: str | None,
    ) -> None:
        headers: dict[str, str] = {}
        for name, value in reversed(scope["headers"]):  # the first of repeated headers wins
            headers[name.decode("latin-1")] = value.decode("latin-1")
        call = serve_call(self.state, headers, receive, route, trajectory_uid, prompt_uid)
        answer = await _answered_errors(scope, send, call)
        if answer is not None:
            await send_answer(answer, scope, receive, send)

    def _inspect(self, scope: Scope) -> tuple[ApiError | None, dict[str, str]]:
        """One pass over the headers: a refusal if any, and the headers a write needs."""
        wanted: dict[str, str] = {}
        length = content_type = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"transfer-encoding":
                chunked = True
            elif name in WRITE_HEADERS:
                wanted[name.decode()] = value.decode("latin-1")
        return self._refusal(length, content_type, chunked), wanted

    def _refusal(
        self, length: bytes | None, content_type: str | None, chunked: bool
    ) -> ApiError | None:
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return ApiError(400, "invalid Content-Length", code="invalid_header")
            if declared > self.max_body_bytes:
                return ApiError(
                    413,
                    f"body of {declared} bytes exceeds the limit of {self.max_body_bytes} bytes",
                    code="body_too_large",
                )
        has_body = chunked or length not in (None, b"0")
        if has_body and not _is_json(content_type or ""):
            return ApiError(
                415,
                f"Content-Type must be application/json, got {content_type!r}",
                param="Content-Type",
                code="unsupported_media_type",
            )
        return None
