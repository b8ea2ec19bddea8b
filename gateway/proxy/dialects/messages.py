"""Anthropic's Messages API through the proxy: a `POST /v1/messages` call is translated to a
chat completion for the upstream, and its answer (or stream) back into a message (or
Anthropic's streamed events); errors are in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`).

`system` becomes the first system message; content blocks `text`, `tool_use` (an assistant's
tool calls) and `tool_result` (tool messages, placed before the user's text) translate;
`thinking` blocks are skipped; images and documents are refused naming the field. Custom
tools (`name`, `input_schema`) become function tools; `tool_choice` `auto`, `any`, `tool`,
`none` map to chat's. `stop_reason`: `end_turn`, `max_tokens`, `stop_sequence` (vLLM says
which stop string matched), `tool_use`.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic_core

from gateway.errors import ApiError, anthropic_envelope
from gateway.proxy.dialects.base import DialectCall, DialectStream, new_id, sse
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.scope import Scope

VERSION_HEADER = "anthropic-version"
_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_request_error")


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid(where, "must be a string or a list of content blocks")
    for position, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _invalid(f"{where}[{position}]", "must be a content block with a type")
    return content


def _text(parts: list[str]) -> str | list[dict[str, Any]]:
    return parts[0] if len(parts) == 1 else [{"type": "text", "text": t} for t in parts]


def _tool_result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for position, block in enumerate(_blocks(content, where)):
        if block["type"] != "text":
            raise _invalid(
                f"{where}[{position}].type", "tool results reach a chat upstream as text"
            )
        texts.append(block.get("text") or "")
    return "".join(texts)


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Anthropic messages as chat messages."""
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "must be a non-empty list")
    out: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise _invalid(f"{where}.role", "must be user or assistant")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for number, block in enumerate(_blocks(message.get("content"), f"{where}.content")):
            at, kind = f"{where}.content[{number}]", block["type"]
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise _invalid(at, "tool_use needs an id and a name")
                arguments = pydantic_core.to_json(block.get("input") or {}).decode()
                function = {"name": block["name"], "arguments": arguments}
                calls.append({"id": block["id"], "type": "function", "function": function})
            elif kind == "tool_result" and role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise _invalid(f"{at}.tool_use_id", "must be a string")
                text = _tool_result_text(block.get("content"), f"{at}.content")
                results.append(
                    {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue  # a chat upstream takes no thinking input
            else:
                raise _invalid(f"{at}.type", f"{kind!r} blocks cannot reach a chat upstream")
        out += results
        if role == "assistant":
            reply: dict[str, Any] = {
                "role": "assistant",
                "content": _text(texts) if texts else None,
            }
            if calls:
                reply["tool_calls"] = calls
            out.append(reply)
        elif texts:
            out.append({"role": "user", "content": _text(texts)})
    return out


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    texts = []
    for position, block in enumerate(_blocks(system, "system")):
        if block["type"] != "text" or not isinstance(block.get("text"), str):
            raise _invalid(f"system[{position}]", "only text blocks")
        texts.append(block["text"])
    return [{"role": "system", "content": _text(texts)}] if texts else []


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic custom tools as chat function tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list")
    out = []
    for position, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _invalid(f"tools[{position}].type", f"only custom tools are served, got {kind!r}")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise _invalid(f"tools[{position}]", "needs a name and an input_schema")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice: Any) -> Any:
    """Anthropic `tool_choice` as chat's."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid("tool_choice.type", "must be auto, any, tool (with a name) or none")


def _input(arguments: Any) -> dict[str, Any]:
    try:
        value = pydantic_core.from_json(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage_of(chat_usage: Any) -> dict[str, Any]:
    """Chat usage as Anthropic usage."""
    usage = chat_usage if isinstance(chat_usage, dict) else {}
    return {
        "input_tokens": usage.get("prompt_tokens") or 0,
        "output_tokens": usage.get("completion_tokens") or 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def stop_of(choice: dict[str, Any]) -> tuple[str | None, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` of a chat choice."""
    finish = choice.get("finish_reason")
    matched = choice.get("stop_reason")  # vLLM: the stop string that ended the reply
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if finish is None:
        return None, None
    return _STOP.get(finish, "end_turn"), None


class MessagesCall(DialectCall):
    """One `POST /v1/messages` call, translated to a chat completion."""

    name = "messages"

    def __init__(self, body: dict[str, Any], version: str | None) -> None:
        self.request = body
        self.version = version
        self.message_id = new_id("msg_")
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise _invalid("model", "is required (a string)")
        maximum = body.get("max_tokens")
        if not isinstance(maximum, int) or isinstance(maximum, bool) or maximum < 1:
            raise _invalid("max_tokens", "is required (a positive integer)")
        if body.get("stream") not in (None, True, False):
            raise _invalid("stream", "must be a boolean")
        messages = _system(body.get("system")) + chat_messages(body.get("messages"))
        chat: dict[str, Any] = {"model": body["model"], "messages": messages, "max_tokens": maximum}
        if (tools := chat_tools(body.get("tools"))) is not None:
            chat["tools"] = tools
        if (choice := chat_tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
            if body["tool_choice"].get("disable_parallel_tool_use") is True:
                chat["parallel_tool_calls"] = False
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise _invalid("stop_sequences", "must be a list of strings")
            chat["stop"] = stops
        for name in ("temperature", "top_p", "top_k"):
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat = chat

    def envelope(self, model: Any) -> dict[str, Any]:
        """The message object around its content."""
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": model if isinstance(model, str) else self.request["model"],
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_of(None),
        }

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The message of a whole chat answer."""
        choices = chat.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        answer = self.envelope(chat.get("model"))
        if message.get("content"):
            answer["content"].append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            answer["content"].append(
                {
                    "type": "tool_use",
                    "id": call.get("id") or new_id("toolu_"),
                    "name": function.get("name") or "",
                    "input": _input(function.get("arguments")),
                }
            )
        answer["stop_reason"], answer["stop_sequence"] = stop_of(choice)
        answer["usage"] = usage_of(chat.get("usage"))
        return answer

    def stream(self) -> MessagesStream:
        """A translator of this call's chat stream into Anthropic's events."""
        return MessagesStream(self)

    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        """Anthropic's error shape."""
        return pydantic_core.to_json(anthropic_envelope(status, message))

    def metadata(self) -> dict[str, Any]:
        """The protocol and the API version the client asked for."""
        extra: dict[str, Any] = {"protocol": self.name}
        if self.version is not None:
            extra["anthropic_version"] = self.version
        return extra


class MessagesStream(DialectStream):
    """Chat chunks as Anthropic's events: message_start, content blocks started and
    delta'd; the blocks' stops, message_delta and message_stop once the step is durable."""

    def __init__(self, call: MessagesCall) -> None:
        self.call = call
        self.model: Any = None
        self.blocks: list[dict[str, Any]] = []  # content blocks in order, as they grow
        self.open_block: int | None = None
        self.arguments: dict[int, list[str]] = {}  # a tool_use block's argument pieces
        self.tool_blocks: dict[int, int] = {}  # chat tool index -> block index
        self.choice: dict[str, Any] = {}
        self.usage: Any = None

    def start(self) -> bytes:
        """`message_start`."""
        message = self.call.envelope(None)
        return sse("message_start", {"type": "message_start", "message": message})

    def _open(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self.blocks.append(block)
        self.open_block = index = len(self.blocks) - 1
        start = dict(block) | ({"input": {}} if block["type"] == "tool_use" else {"text": ""})
        event = {"type": "content_block_start", "index": index, "content_block": start}
        return out + sse("content_block_start", event)

    def _close(self) -> bytes:
        if self.open_block is None:
            return b""
        index, self.open_block = self.open_block, None
        return sse("content_block_stop", {"type": "content_block_stop", "index": index})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        event = {"type": "content_block_delta", "index": self.open_block, "delta": delta}
        return sse("content_block_delta", event)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events of one chat chunk."""
        out = []
        for choice in self.first_choices(chunk):
            delta = choice.get("delta") or {}
            if text := delta.get("content"):
                block = self.blocks[self.open_block] if self.open_block is not None else None
                if block is None or block["type"] != "text":
                    out.append(self._open({"type": "text", "text": ""}))
                    block = self.blocks[-1]
                block["text"] += text
                out.append(self._delta({"type": "text_delta", "text": text}))
            for call in delta.get("tool_calls") or ():
                out.append(self._tool(call))
            if choice.get("finish_reason") is not None:
                self.choice = choice
        return b"".join(out)

    def _tool(self, call: dict[str, Any]) -> bytes:
        index = call.get("index", len(self.tool_blocks))
        function = call.get("function") or {}
        out = b""
        if index not in self.tool_blocks:
            block = {
                "type": "tool_use",
                "id": call.get("id") or new_id("toolu_"),
                "name": function.get("name") or "",
            }
            out += self._open(block)
            self.tool_blocks[index] = self.open_block
            self.arguments[self.open_block] = []
        if arguments := function.get("arguments"):
            self.arguments[self.tool_blocks[index]].append(arguments)
            if self.open_block == self.tool_blocks[index]:
                out += self._delta({"type": "input_json_delta", "partial_json": arguments})
        return out

    def final(self) -> dict[str, Any]:
        """The message as the client got it."""
        message = self.call.envelope(self.model)
        content = []
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = block | {"input": _input("".join(self.arguments[index]))}
            content.append(block)
        message["content"] = content
        message["stop_reason"], message["stop_sequence"] = stop_of(self.choice)
        message["usage"] = usage_of(self.usage)
        return message

    def finish(self) -> bytes:
        """The open block's stop, `message_delta` (stop reason, usage) and `message_stop`."""
        message = self.final()
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        event = {"type": "message_delta", "delta": delta, "usage": message["usage"]}
        return (
            self._close()
            + sse("message_delta", event)
            + sse("message_stop", {"type": "message_stop"})
        )

    def error(self, failure: UpstreamFailure) -> bytes:
        """An `error` event in Anthropic's shape."""
        return sse("error", anthropic_envelope(failure.status, failure.message))


def open_messages(body: dict[str, Any], headers: Any, scope: Scope) -> MessagesCall:
    """The translated call (400 naming the field when it cannot be)."""
    version = headers.get(VERSION_HEADER)
    if version is not None and not _VERSION.match(version.strip()):
        raise ApiError(
            400,
            f"anthropic-version: must be a date such as 2023-06-01, got {version!r}",
            param="anthropic-version",
            code="invalid_request_error",
        )
    call = MessagesCall(body, version)
    call.scope = scope
    return call
