"""What a call in another protocol is to the proxy: a chat completion body to send upstream,
and the way back (the whole answer, a stream's events, errors) in the client's protocol."""

from __future__ import annotations

import os
from typing import Any

import pydantic_core

from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.scope import Scope


def new_id(prefix: str) -> str:
    """A fresh object id of the protocol (`resp_…`, `msg_…`, `fc_…`)."""
    return prefix + os.urandom(16).hex()


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with a name (both protocols name their events)."""
    return b"event: " + event.encode() + b"\ndata: " + pydantic_core.to_json(data) + b"\n\n"


class DialectStream:
    """Turns the chat chunks of one streamed call into the client protocol's events."""

    model: Any = None  # the upstream's model name, from the first chunk that names it
    usage: Any = None  # the chunk usage, when the upstream sends it

    def first_choices(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """Note a chat chunk's model and usage; its choices of index 0 (the one the
        client protocols carry)."""
        self.model = self.model or chunk.get("model")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices") or ()
        return [c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0]

    def start(self) -> bytes:
        """Events sent as the stream opens."""
        return b""

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """Events for one chat chunk (as the client would have seen it)."""
        raise NotImplementedError

    def final(self) -> dict[str, Any]:
        """The whole answer as the client got it (kept in the step's payload)."""
        raise NotImplementedError

    def finish(self) -> bytes:
        """The closing events, sent once the step is durable."""
        raise NotImplementedError

    def error(self, failure: UpstreamFailure) -> bytes:
        """The event that tells the client the stream broke."""
        raise NotImplementedError


class DialectCall:
    """One call in another protocol, translated to a chat completion (`chat`)."""

    name = ""
    chat: dict[str, Any]
    scope: Scope

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The client's answer made from the chat answer (as the client would see it)."""
        raise NotImplementedError

    def stream(self) -> DialectStream:
        """A translator for this call's stream."""
        raise NotImplementedError

    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        """An error in the protocol's own shape."""
        raise NotImplementedError

    def metadata(self) -> dict[str, Any]:
        """What the call's steps add to their metadata."""
        return {"protocol": self.name}

    def record_extra(self, reply: dict[str, Any]) -> bytes | None:
        """More of the step's payload (JSON members, without braces), or None."""
        return None

    def remember(self, trajectory_uid: str, step_index: int, reply: dict[str, Any]) -> None:
        """Called once the call's step is durable."""

    def burst(self, chat: dict[str, Any], include_usage: bool = True) -> bytes:
        """A whole chat answer (token-in) as this protocol's stream, in one burst."""
        from gateway.proxy.chat_from_tokens import chunk_dicts

        stream = self.stream()
        parts = [stream.start()]
        parts += [stream.chunk(c) for c in chunk_dicts(chat, include_usage)]
        parts.append(stream.finish())
        return b"".join(parts)
