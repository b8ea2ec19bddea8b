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


class GatewayMiddleware:
    """Refuse a declared Content-Length over the limit (413) and non-JSON bodies (415)
    before any parsing; count and time every request by route template and status."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: GatewayMetrics) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self._children: dict[tuple[str, int], tuple] = {}  # cached labelled metrics

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
            refusal = self._refusal(scope) if scope["method"] in BODY_METHODS else None
            if refusal is not None:
                await _refuse(send_with_status, *refusal)
            else:
                await self.app(scope, receive, send_with_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            children = self._children.get((route, status))
            if children is None:
                children = self._children[(route, status)] = (
                    self.metrics.requests.labels(route, str(status)),
                    self.metrics.request_seconds.labels(route),
                )
            children[0].inc()
            children[1].observe(time.perf_counter() - started)

    def _refusal(self, scope: Scope) -> tuple | None:
        length = content_type = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                length = value
            elif name == b"content-type":
                content_type = value.decode("latin-1")
            elif name == b"transfer-encoding":
                chunked = True
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return (400, "invalid Content-Length", None, "invalid_header")
            if declared > self.max_body_bytes:
                return (
                    413,
                    f"body of {declared} bytes exceeds the limit of {self.max_body_bytes} bytes",
                    None,
                    "body_too_large",
                )
        has_body = chunked or length not in (None, b"0")
        if has_body and not _is_json(content_type or ""):
            return (
                415,
                f"Content-Type must be application/json, got {content_type!r}",
                "Content-Type",
                "unsupported_media_type",
            )
        return None
