"""The upstream over httpx instead of gateway.proxy.http1: the same interface (`request`, and
responses with `status`, lower-case `headers`, `read`, `aiter_bytes`, `aclose`), selected by
`CLAW_UPSTREAM_CLIENT=httpx`. Kept so that the hand-written client's advantage is measured
against the standard one in the same benchmark run (benchmarks/proxy_overhead.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx

from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.http1 import Origin


@contextmanager
def _failures(when: str) -> Iterator[None]:
    """httpx errors as UpstreamFailure: a timeout 504, anything else 502."""
    try:
        yield
    except httpx.TimeoutException:
        raise UpstreamFailure(504, "upstream_timeout", f"upstream timed out {when}") from None
    except httpx.ConnectError as exc:
        raise UpstreamFailure(
            502, "upstream_unreachable", f"cannot connect to upstream: {exc}"
        ) from None
    except httpx.HTTPError as exc:
        raise UpstreamFailure(502, "upstream_error", f"upstream failed {when}: {exc!r}") from None


class HttpxResponse:
    """An httpx response behind Http1Response's interface."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status = response.status_code
        self.headers = {k.lower(): v for k, v in response.headers.items()}

    async def read(self) -> bytes:
        """The whole body."""
        try:
            with _failures("mid-answer"):
                return await self.response.aread()
        finally:
            await self.response.aclose()

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        """The body as it arrives."""
        try:
            with _failures("mid-answer"):
                async for piece in self.response.aiter_bytes():
                    yield piece
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        """Stop reading."""
        await self.response.aclose()


class HttpxPool:
    """Keep-alive connections to one origin through an `httpx.AsyncClient`."""

    def __init__(self, base_url: str, timeout_s: float, connect_timeout_s: float) -> None:
        self.origin = Origin(base_url)
        timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)

    def url(self, path: str) -> str:
        """The full URL of `path` under the base URL."""
        return self.origin.url + path

    async def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> HttpxResponse:
        """Send a request; returns once the status line and headers are in."""
        request = self.client.build_request(method, self.url(path), content=body, headers=headers)
        with _failures("before answering"):
            return HttpxResponse(await self.client.send(request, stream=True))

    async def aclose(self) -> None:
        """Close the client's connections."""
        await self.client.aclose()
