"""Pure-ASGI middleware: early refusal of oversized or non-JSON bodies, and request metrics."""

from __future__ import annotations

import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import envelope
from gateway.metrics import GatewayMetrics

BODY_METHODS = {"POST", "PUT", "PATCH"}


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


async def _refuse(send: Send, status: int, message: str, param: str | None, code: str) -> None:
    body = json.dumps(envelope(status, message, param, code)).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyGuard:
    """Refuse a declared Content-Length over the limit (413) and non-JSON bodies (415)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return await _refuse(send, 400, "invalid Content-Length", None, "invalid_header")
            if declared > self.max_body_bytes:
                return await _refuse(
                    send,
                    413,
                    f"body of {declared} bytes exceeds the limit of {self.max_body_bytes} bytes",
                    None,
                    "body_too_large",
                )
        content_type = headers.get(b"content-type", b"").decode("latin-1")
        has_body = length not in (None, b"0") or b"transfer-encoding" in headers
        if has_body and not _is_json(content_type):
            return await _refuse(
                send,
                415,
                f"Content-Type must be application/json, got {content_type!r}",
                "Content-Type",
                "unsupported_media_type",
            )
        return await self.app(scope, receive, send)


class RequestMetrics:
    """Count requests by route template and status; time them."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(name, str(status)).inc()
            self.metrics.request_seconds.labels(name).observe(time.perf_counter() - started)
