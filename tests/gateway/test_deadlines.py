"""Body-read deadlines: the sweeper cuts late reads with a 408, and only those.

(The slow-loris test in test_exhaustion.py checks the same against a real gateway process.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.deadlines import ReadDeadlines
from gateway.errors import ApiError
from gateway.incoming import read_body


def receiver(*messages: dict, then_wait: bool = False):
    """An ASGI `receive` giving `messages`, then (with `then_wait`) never answering again."""
    queue = list(messages)

    async def receive() -> dict:
        if queue:
            return queue.pop(0)
        assert then_wait, "read past the body"
        await asyncio.Event().wait()

    return receive


def chunk(body: bytes, more: bool = False) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_read_past_its_deadline_gets_408_about_on_time():
    async def scenario() -> tuple[ApiError, float, ReadDeadlines]:
        deadlines = ReadDeadlines(0.2)
        started = time.monotonic()
        with pytest.raises(ApiError) as raised:
            await read_body(receiver(chunk(b"{", more=True), then_wait=True), 100, deadlines)
        took = time.monotonic() - started
        # the task goes on normally after the 408: its cancellation was withdrawn
        await asyncio.sleep(0)
        assert asyncio.current_task().cancelling() == 0
        deadlines.stop()
        return raised.value, took, deadlines

    error, took, deadlines = asyncio.run(scenario())
    assert error.status == 408 and error.code == "body_timeout"
    assert 0.2 <= took < 0.2 + deadlines.tick + 0.2
    assert not deadlines._reads and not deadlines._cut


def test_reads_on_time_are_not_cut_and_leave_nothing_behind():
    async def scenario() -> tuple[list[bytes], ReadDeadlines]:
        deadlines = ReadDeadlines(0.2)
        bodies = []
        for _ in range(5):
            receive = receiver(chunk(b'{"a"', more=True), chunk(b": 1}"))
            bodies.append(await read_body(receive, 100, deadlines))
            await asyncio.sleep(0.05)  # the sweeper passes while no read is late
        await asyncio.sleep(0.3)
        deadlines.stop()
        return bodies, deadlines

    bodies, deadlines = asyncio.run(scenario())
    assert bodies == [b'{"a": 1}'] * 5
    assert not deadlines._reads and not deadlines._cut


def test_a_cancelled_read_stays_cancelled():
    """A read cancelled by someone else (a client gone, a shutdown) is not a 408."""

    async def scenario() -> None:
        deadlines = ReadDeadlines(30)
        read = asyncio.ensure_future(
            read_body(receiver(chunk(b"{", more=True), then_wait=True), 100, deadlines)
        )
        await asyncio.sleep(0.01)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        assert not deadlines._reads and not deadlines._cut
        deadlines.stop()

    asyncio.run(scenario())


def test_size_and_disconnect_errors_are_unchanged():
    async def scenario() -> list[ApiError]:
        deadlines = ReadDeadlines(30)
        errors = []
        for receive in (
            receiver(chunk(b"x" * 60, more=True), chunk(b"x" * 60)),
            receiver({"type": "http.disconnect"}),
        ):
            with pytest.raises(ApiError) as raised:
                await read_body(receive, 100, deadlines)
            errors.append(raised.value)
        deadlines.stop()
        return errors

    too_large, gone = asyncio.run(scenario())
    assert (too_large.status, too_large.code) == (413, "body_too_large")
    assert (gone.status, gone.code) == (400, "client_disconnected")
