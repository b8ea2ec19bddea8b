"""Plain ASGI answers: a complete `Answer` is two messages, no response object; a streamed
answer is an ASGI app of its own (e.g. gateway.proxy.relay.RelayResponse)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

JSON = "application/json"


@dataclass(slots=True)
class Answer:
    """A complete response: status, body, media type, extra headers."""

    status: int
    body: bytes
    media_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


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


async def send_answer(answer: Answer | ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """Send a handler's answer: a complete one as is, a streamed one by running it."""
    if isinstance(answer, Answer):
        await send_body(send, answer.status, answer.body, answer.media_type, answer.headers)
    else:
        await answer(scope, receive, send)
