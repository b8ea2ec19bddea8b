"""Plain ASGI responses for the fast paths: two messages, no response object."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import Send

JSON = "application/json"


async def send_body(
    send: Send,
    status: int,
    body: bytes,
    media_type: str = JSON,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Send a complete response: status, content type and length, extra headers, body."""
    raw = [
        (b"content-type", media_type.encode("latin-1")),
        (b"content-length", str(len(body)).encode()),
    ]
    if headers:
        raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
