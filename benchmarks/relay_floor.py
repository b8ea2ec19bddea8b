"""The floor for proxy_overhead: a relay that records nothing.

uvicorn (same loop and HTTP parser as the gateway), the gateway's upstream client, and the
JSON work any recording proxy must do (parse the request, add `return_token_ids` and
`logprobs`, parse the answer, take them back out). No scope, no records, no WAL, no fdatasync:
what the gateway adds beyond this is the price of recording durably.

    python benchmarks/relay_floor.py PORT UPSTREAM_BASE_URL
"""

from __future__ import annotations

import sys
from pathlib import Path

import pydantic_core
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.proxy.capture import CHAT_KIND, augment, stripped
from gateway.proxy.upstream import Upstream

_JSON = [(b"content-type", b"application/json")]


def create_relay(upstream_url: str):
    """An ASGI app relaying POST /v1/chat/completions to `upstream_url`, recording nothing."""
    upstream = Upstream(upstream_url)

    async def app(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await upstream.aclose()
            return await send({"type": "lifespan.shutdown.complete"})
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        status, answer = 200, b'{"status":"ok"}'
        if scope["method"] == "POST":
            request = pydantic_core.from_json(body)
            upstream_body, added = augment(body, request, CHAT_KIND)
            reply = await upstream.post("/chat/completions", upstream_body)
            status = reply.status
            answer = pydantic_core.to_json(stripped(pydantic_core.from_json(reply.body), added))
        headers = [*_JSON, (b"content-length", str(len(answer)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": answer})

    return app


if __name__ == "__main__":
    port, upstream_url = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(
        create_relay(upstream_url),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        access_log=False,
        proxy_headers=False,
    )
