"""The upstream inference server the proxy forwards to (vLLM, SGLang, `claw sim-llm`, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.proxy.failures import (
    UpstreamFailure,
    failure_of_status,
    openai_error_body,
    upstream_message,
)
from gateway.proxy.http1 import Http1Pool, Http1Response

__all__ = [
    "Upstream",
    "UpstreamFailure",
    "UpstreamReply",
    "failure_of_status",
    "openai_error_body",
    "upstream_message",
]

CONNECT_TIMEOUT_S = 10.0
_POST = {"Content-Type": "application/json", "Accept": "application/json"}
_STREAM = {"Content-Type": "application/json", "Accept": "text/event-stream"}
_GET = {"Accept": "application/json"}


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A complete upstream answer: status, raw body, content type and headers (lower-case)."""

    status: int
    body: bytes
    content_type: str
    headers: dict[str, str]

    @classmethod
    async def read(cls, response: Http1Response) -> UpstreamReply:
        """Read a response's whole body."""
        body = await response.read()
        return cls(
            response.status, body, response.headers.get("content-type", ""), response.headers
        )


class Upstream:
    """The OpenAI-compatible server behind the proxy, over pooled keep-alive connections.

    Only the body and JSON content headers go upstream: never the caller's API key.
    """

    def __init__(self, base_url: str, timeout_s: float = 600.0, client: str = "http1") -> None:
        connect_s = min(timeout_s, CONNECT_TIMEOUT_S)
        if client == "httpx":
            from gateway.proxy.httpx_pool import HttpxPool

            self.pool = HttpxPool(base_url, timeout_s, connect_s)
        else:
            self.pool = Http1Pool(base_url, timeout_s, connect_s)
        self.base_url = self.pool.origin.url
        # whether the upstream takes vLLM's `return_token_ids` on plain and on streamed calls
        # (SGLang refuses it on chat streams only): False once refused, then ids are
        # computed here
        self._token_ids = {False: True, True: True}

    def returns_token_ids(self, stream: bool = False) -> bool:
        """Whether to ask for token ids (not refused yet for this kind of call)."""
        return self._token_ids[stream]

    def refuses_token_ids(self, stream: bool) -> None:
        """Remember that the upstream refused `return_token_ids` (on streams, or on any call:
        a refusal of plain calls stands for streams too)."""
        self._token_ids[True] = False
        if not stream:
            self._token_ids[False] = False

    def url(self, path: str) -> str:
        """The upstream URL of `path` (e.g. `/chat/completions`)."""
        return self.pool.url(path)

    async def get(self, path: str) -> UpstreamReply:
        """GET `path` and read the answer; raises UpstreamFailure."""
        response = await self.pool.request("GET", path, headers=_GET)
        return await UpstreamReply.read(response)

    async def post(self, path: str, body: bytes) -> UpstreamReply:
        """POST a JSON body and read the whole answer; raises UpstreamFailure."""
        response = await self.pool.request("POST", path, body, _POST)
        return await UpstreamReply.read(response)

    async def open_stream(self, path: str, body: bytes) -> Http1Response:
        """POST a streaming request; returns once the status and headers are in (body unread).

        The caller owns the response and must `aclose()` it.
        """
        return await self.pool.request("POST", path, body, _STREAM)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.pool.aclose()
