"""Relay a streamed answer: chunks go to the client as they arrive, the steps are recorded
when the stream ends, however it ends.

The step keys are assigned when the stream opens, one per choice the call asks for, and sent
as the response's `X-Claw-Step-Keys` header; a choice the stream never delivers has no step
under its key. Only the choices that arrived are recorded.

Endings and the finish_reason of choices that arrived but were not finished:
- the upstream's `data: [DONE]`: the steps are made durable, then `[DONE]` is relayed;
- the client goes away: `client_disconnected` (what was received so far is recorded);
- the upstream connection breaks or stalls: `upstream_error`, plus an `upstream_error`
  event, and the client gets an OpenAI error event (its status line was already sent);
- the upstream closes without `[DONE]`: `upstream_ended` (servers that never send `[DONE]`,
  such as `transformers serve`, finish their choices first, so nothing is marked cut).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio
import pydantic_core
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.errors import envelope
from gateway.proxy.call import CallRecorder, ProxyCall
from gateway.proxy.capture import Added, stripped
from gateway.proxy.http1 import Http1Response
from gateway.proxy.steps import StepPlace, step_keys
from gateway.proxy.stream import DONE, StreamAccumulator, sse_data
from gateway.proxy.upstream import UpstreamFailure

log = logging.getLogger(__name__)

_DONE_EVENT = b"data: [DONE]\n\n"
DRAIN_TIMEOUT_S = 0.2
_COMPACT = {"ensure_ascii": False, "separators": (",", ":")}


class StreamRelay:
    """One streamed call: `body` yields the SSE bytes for the client; `close()` records."""

    def __init__(
        self,
        service: CallRecorder,
        call: ProxyCall,
        response: Http1Response,
        added: Added,
        places: list[StepPlace],
    ) -> None:
        self.service = service
        self.call = call
        self.response = response
        self.added = added
        self.places = places  # by choice index, assigned as the stream opened
        self.status = response.status
        self.content_type = response.headers.get("content-type", "text/event-stream")
        self.accumulator = StreamAccumulator(call.endpoint.kind)
        # a call in another protocol: its events are made from the chat chunks
        self.translator = call.dialect.stream() if call.dialect is not None else None
        self.recorded = False
        self.on_close: Callable[[], None] | None = None  # the replica's call ended
        self.on_failure: Callable[[UpstreamFailure], None] | None = None  # the replica broke
        self.started = time.perf_counter()
        self.body = self._events()

    async def _events(self) -> AsyncIterator[bytes]:
        events = sse_data(self.response.aiter_bytes())
        translator = self.translator
        if translator is not None:
            yield translator.start()
        try:
            async for data in events:
                if data == DONE:
                    await self._record(None)
                    yield _DONE_EVENT if translator is None else translator.finish()
                    await _drain(events)
                    return
                try:
                    chunk = pydantic_core.from_json(data)
                except ValueError:
                    chunk = None
                if isinstance(chunk, dict):
                    self._accumulate(chunk)
                    view = stripped(chunk, self.added) if self.added.any else chunk
                    if view is None:
                        continue  # a usage chunk only the gateway asked for
                    if translator is not None:
                        if events_out := translator.chunk(view):
                            yield events_out
                        continue
                    if view is not chunk:
                        data = pydantic_core.to_json(view)
                elif translator is not None:
                    continue  # nothing a translated stream can carry
                yield b"data: " + data + b"\n\n"
            await self._record("upstream_ended")
            if translator is not None:
                yield translator.finish()
        except UpstreamFailure as failure:
            if self.on_failure is not None:
                self.on_failure(failure)
            await self._record("upstream_error", failure)
            if translator is not None:
                yield translator.error(failure)
                return
            error = envelope(failure.status, failure.message, code=failure.code)
            yield b"data: " + json.dumps(error).encode() + b"\n\n"

    def _accumulate(self, chunk: dict) -> None:
        try:
            self.accumulator.add(chunk)
        except (TypeError, AttributeError, ValueError) as exc:  # relayed all the same
            log.warning("unexpected stream chunk from the upstream (%s): %.200s", exc, chunk)

    async def close(self) -> None:
        """End the relay: stop the generator, release the upstream, record if not yet done."""
        with anyio.CancelScope(shield=True):
            await self.body.aclose()
            await self.response.aclose()
            await self._record("client_disconnected")
            if self.on_close is not None:
                self.on_close, on_close = None, self.on_close
                on_close()

    async def _record(self, unfinished: str | None, failure: UpstreamFailure | None = None) -> None:
        """Make the steps durable (once; shielded from cancellation)."""
        if self.recorded:
            return
        self.recorded = True
        with anyio.CancelScope(shield=True):
            call, service, accumulator = self.call, self.service, self.accumulator
            captured = accumulator.captured(unfinished)
            if self.translator is not None:
                answer = self.translator.final()
                for choice in captured:
                    choice.response = answer
            model = accumulator.envelope.get("model")
            elapsed_ms = round((time.perf_counter() - self.started) * 1000, 2)
            steps = service.call_steps(
                call, captured, model, elapsed_ms, accumulator.usage, self.places
            )
            failed = [] if failure is None else [service.failure_record(failure, call.tenant, call)]
            await service.land_steps(call, steps, also=failed)


async def _drain(events: AsyncIterator[bytes]) -> None:
    """Read the upstream body to its end after `[DONE]`, so its connection can be reused;
    an upstream that keeps the stream open past that is not waited for."""
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for _ in events:
                pass
    except (TimeoutError, UpstreamFailure):
        pass


class RelayResponse(StreamingResponse):
    """Streams a relay to the client, and always ends it (recording what was received)."""

    def __init__(self, relay: StreamRelay) -> None:
        super().__init__(
            relay.body,
            status_code=relay.status,
            media_type=relay.content_type,
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "X-Claw-Step-Keys": step_keys(relay.places),
            },
        )
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.relay.close()
