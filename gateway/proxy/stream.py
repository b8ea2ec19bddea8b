"""Server-sent events from the upstream: split into events, and chunks folded into choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from gateway.proxy.capture import (
    CHAT_KIND,
    CapturedChoice,
    choice_index,
    logprobs_of,
    response_ids_of,
)

DONE = b"[DONE]"
_ENVELOPE_KEYS = ("id", "created", "model", "system_fingerprint")


async def sse_data(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data` of each server-sent event, as the bytes arrive (comments are skipped)."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:
            if buffer.endswith(b"\r"):
                continue  # a CRLF split across reads: wait for its LF
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2 :]
            data = _event_data(event)
            if data is not None:
                yield data
    if buffer.strip():
        data = _event_data(buffer)
        if data is not None:
            yield data


def _event_data(event: bytes) -> bytes | None:
    if event.startswith(b"data:") and b"\n" not in event:
        return event[5:].removeprefix(b" ")  # the common one-line event
    lines = [
        line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None


@dataclass(slots=True)
class _Parts:
    """One choice as its chunks arrive."""

    index: int
    prompt_ids: list[int] | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    role: str = "assistant"
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None

    def add(self, choice: dict[str, Any], kind: str) -> None:
        if (ids := response_ids_of(choice, kind)) is not None:
            self.token_ids = (self.token_ids or []) + ids
        if (prompt := choice.get("prompt_token_ids")) is not None:
            self.prompt_ids = prompt
        if (logprobs := logprobs_of(choice.get("logprobs"), kind)) is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        if kind == CHAT_KIND:
            delta = choice.get("delta") or {}
            self.role = delta.get("role") or self.role
            if delta.get("content"):
                self.text.append(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._add_tool_call(call)
        elif choice.get("text"):
            self.text.append(choice["text"])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]

    def _add_tool_call(self, call: dict[str, Any]) -> None:
        slot = self.tool_calls.setdefault(
            call.get("index", len(self.tool_calls)),
            {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if call.get("id"):
            slot["id"] = call["id"]
        if call.get("type"):
            slot["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            slot["function"]["name"] += function["name"]
        if function.get("arguments"):
            slot["function"]["arguments"] += function["arguments"]

    def output(self, kind: str) -> dict[str, Any]:
        text = "".join(self.text)
        if kind != CHAT_KIND:
            return {"text": text}
        message: dict[str, Any] = {"role": self.role, "content": text or None}
        if self.tool_calls:
            message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        return message


class StreamAccumulator:
    """Folds the chunks of a streamed answer into whole choices (ids, log-probs, message)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.envelope: dict[str, Any] = {}
        self.prompt_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.choices: dict[int, _Parts] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        """Take one chunk (before anything is stripped from it)."""
        if not self.envelope:
            self.envelope = {k: chunk[k] for k in _ENVELOPE_KEYS if k in chunk}
        if (prompt := chunk.get("prompt_token_ids")) is not None:
            self.prompt_ids = prompt
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if isinstance(choice, dict):
                index = choice_index(choice, 0)
                parts = self.choices.get(index)
                if parts is None:
                    parts = self.choices[index] = _Parts(index)
                parts.add(choice, self.kind)

    def captured(self, unfinished: str | None) -> list[CapturedChoice]:
        """The choices as received so far (only those: a choice the stream never delivered
        has no step); those the upstream did not finish get `unfinished` as their
        finish_reason."""
        kind = "chat.completion" if self.kind == CHAT_KIND else "text_completion"
        captured = []
        for index in sorted(self.choices):
            parts = self.choices[index]
            output = parts.output(self.kind)
            finish = parts.finish_reason or unfinished
            choice = {"index": index, **({"message": output} if self.kind == CHAT_KIND else output)}
            response = self.envelope | {
                "object": kind,
                "choices": [choice | {"logprobs": None, "finish_reason": finish}],
            }
            if self.usage is not None:
                response["usage"] = self.usage
            captured.append(
                CapturedChoice(
                    index=index,
                    prompt_ids=parts.prompt_ids or self.prompt_ids,
                    response_ids=parts.token_ids,
                    logprobs=parts.logprobs,
                    finish_reason=finish,
                    output=output,
                    response=response,
                )
            )
        return captured
