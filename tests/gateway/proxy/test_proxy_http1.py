"""The proxy's HTTP/1.1 upstream client against a raw asyncio server: body framings,
keep-alive reuse, connections the server dropped while idle, timeouts and refusals."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.http1 import Http1Pool
from tests.support.servers import free_port

Handler = Callable[[bytes, asyncio.StreamWriter], Awaitable[bool]]  # -> keep the connection


async def serve(handler: Handler) -> tuple[asyncio.Server, list[int]]:
    """A server calling `handler` once per request; counts connections."""
    connections: list[int] = []

    async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                if not await handler(body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connection, "127.0.0.1", 0)
    return server, connections


def url_of(server: asyncio.Server) -> str:
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


def run(coroutine):
    return asyncio.run(coroutine)


def test_bodies_of_every_framing_and_keep_alive_reuse():
    async def handler(body: bytes, writer: asyncio.StreamWriter) -> bool:
        if body == b"chunked":
            writer.write(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nx-trailer: 1\r\n\r\n"
            )
        elif body == b"close":
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
            await writer.drain()
            return False
        else:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: 4\r\n\r\n" + body[:4])
        await writer.drain()
        return True

    async def main():
        server, connections = await serve(handler)
        pool = Http1Pool(url_of(server), timeout_s=5, connect_timeout_s=5)
        try:
            first = await pool.request("POST", "/x", b"chunked")
            assert (first.status, await first.read()) == (200, b"hello world")
            second = await pool.request("POST", "/x", b"abcdef")
            assert (second.status, await second.read()) == (201, b"abcd")
            assert len(connections) == 1  # reused
            last = await pool.request("POST", "/x", b"close")
            assert await last.read() == b"until the end"
            again = await pool.request("POST", "/x", b"wxyz")
            assert await again.read() == b"wxyz"
            assert len(connections) == 2  # the closed one was not reused
        finally:
            await pool.aclose()
            server.close()

    run(main())


def test_a_connection_the_server_dropped_while_idle_is_retried_on_a_new_one():
    async def handler(body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        return False  # closes without saying so, like a keep-alive timeout racing a request

    async def main():
        server, connections = await serve(handler)
        pool = Http1Pool(url_of(server), timeout_s=5, connect_timeout_s=5)
        try:
            for _ in range(5):
                response = await pool.request("POST", "/x", b"{}")
                assert await response.read() == b"ok"
            assert len(connections) == 5
        finally:
            await pool.aclose()
            server.close()

    run(main())


def test_timeouts_are_504_and_refusals_502():
    async def silent(body: bytes, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(5)
        return False

    async def main():
        server, _ = await serve(silent)
        pool = Http1Pool(url_of(server), timeout_s=0.2, connect_timeout_s=1)
        with pytest.raises(UpstreamFailure) as slow:
            await pool.request("POST", "/x", b"{}")
        assert (slow.value.status, slow.value.code) == (504, "upstream_timeout")
        server.close()
        refused = Http1Pool(f"http://127.0.0.1:{free_port()}/v1", 1, 1)
        with pytest.raises(UpstreamFailure) as down:
            await refused.request("GET", "/models")
        assert (down.value.status, down.value.code) == (502, "upstream_unreachable")

    run(main())
