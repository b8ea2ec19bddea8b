"""OpenAI's Responses API through the proxy: a `POST /v1/responses` call is translated to a chat
completion for the upstream, and its answer (or stream) back into a response object (or the
Responses API's semantic events).

Input: a string, or items: messages (`role` system, developer, user, assistant; text parts),
`function_call` and `function_call_output` items (reasoning items are skipped: a chat upstream
has no such input). `instructions` becomes the first system message (not carried over by
`previous_response_id`, as OpenAI does). `previous_response_id` is resolved from what the
gateway stored (`response_store.py`) into the whole conversation, and the call continues that
response's trajectory. Only function tools translate; other tools, images and files are
refused naming the field.
"""

from __future__ import annotations

import time
from typing import Any

import pydantic_core

from claw_pipelines.contracts.access import DEFAULT_TENANT
from gateway.errors import ApiError, envelope
from gateway.proxy.dialects.base import DialectCall, DialectStream, new_id, sse
from gateway.proxy.dialects.response_store import ResponseStore, StoredResponse
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.scope import Scope

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Responses fields with a chat counterpart of the same name and meaning
_SAME = ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "stop", "top_k")
# fields a chat upstream cannot honour: refused rather than silently dropped
_REFUSED = ("background", "conversation", "prompt")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _text_of(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(where, "must be a string or a list of content parts")
    parts = []
    for position, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _invalid(
                f"{where}[{position}]",
                f"only text parts ({', '.join(_TEXT_PARTS)}) reach a chat upstream, got {kind!r}",
            )
        parts.append(part["text"])
    return parts[0] if len(parts) == 1 else [{"type": "text", "text": t} for t in parts]


def _output_text(value: Any) -> str:
    """A function call output as tool message text."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return pydantic_core.to_json(value).decode()


def input_messages(items: Any, param: str = "input") -> list[dict[str, Any]]:
    """Responses input (a string or items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _invalid(param, "must be a string or a list of items")
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(items):
        where = f"{param}[{position}]"
        if not isinstance(item, dict):
            raise _invalid(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise _invalid(f"{where}.role", "must be system, developer, user or assistant")
            content = _text_of(item.get("content"), f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise _invalid(f"{where}.{name}", "must be a string")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _invalid(f"{where}.call_id", "must be a string")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _output_text(item.get("output")),
                }
            )
        elif kind == "reasoning":
            continue  # a chat upstream takes no reasoning input
        else:
            raise _invalid(f"{where}.type", f"{kind!r} items cannot reach a chat upstream")
    return messages


def chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools (other kinds refused naming the field)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _invalid("tools", "must be a list")
    out = []
    for position, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise _invalid(
                f"tools[{position}].type", f"only named function tools are served, got {kind!r}"
            )
        function = {"name": tool["name"]}
        for name in ("description", "parameters", "strict"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice: Any) -> Any:
    """Responses `tool_choice` as chat's."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid("tool_choice", "must be auto, none, required or a named function")


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _invalid("text.format.type", "must be text, json_object or json_schema")


def usage_of(chat_usage: Any) -> dict[str, Any] | None:
    """Chat usage as Responses usage."""
    if not isinstance(chat_usage, dict):
        return None
    prompt = chat_usage.get("prompt_tokens") or 0
    completion = chat_usage.get("completion_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def text_logprobs(chat_logprobs: Any) -> list[dict[str, Any]]:
    """Chat log-probs (`logprobs.content`) as an output_text's `logprobs`."""
    content = chat_logprobs.get("content") if isinstance(chat_logprobs, dict) else None
    out = []
    for entry in content or ():
        if isinstance(entry, dict):
            tops = [
                {
                    "token": t.get("token"),
                    "bytes": t.get("bytes") or [],
                    "logprob": t.get("logprob"),
                }
                for t in entry.get("top_logprobs") or ()
            ]
            out.append(
                {
                    "token": entry.get("token"),
                    "bytes": entry.get("bytes") or [],
                    "logprob": entry.get("logprob"),
                    "top_logprobs": tops,
                }
            )
    return out


class ResponsesCall(DialectCall):
    """One `POST /v1/responses` call, translated to a chat completion."""

    name = "responses"

    def __init__(
        self,
        body: dict[str, Any],
        previous: StoredResponse | None,
        scope: Scope,
        store: ResponseStore,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        self.request = body
        self.previous = previous
        self.scope = scope
        self.store = store
        self.tenant = tenant
        self.response_id = new_id("resp_")
        self.created_at = int(time.time())
        include = body.get("include") or ()
        self.logprobs = LOGPROBS_INCLUDE in include or body.get("top_logprobs") is not None
        earlier = list(previous.messages) if previous else []
        self.messages = earlier + input_messages(body.get("input"))
        if not self.messages or all(m["role"] == "system" for m in self.messages):
            raise _invalid("input", "needs at least one message or item")
        instructions = body.get("instructions")
        head = (
            [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        )
        chat: dict[str, Any] = {"model": body["model"], "messages": head + self.messages}
        if (tools := chat_tools(body.get("tools"))) is not None:
            chat["tools"] = tools
        if (choice := chat_tool_choice(body.get("tool_choice"))) is not None:
            chat["tool_choice"] = choice
        for name in _SAME:
            if body.get(name) is not None:
                chat[name] = body[name]
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if (fmt := _response_format(body.get("text"))) is not None:
            chat["response_format"] = fmt
        if self.logprobs:
            chat["logprobs"] = True
            if isinstance(body.get("top_logprobs"), int):
                chat["top_logprobs"] = body["top_logprobs"]
        if body.get("stream") is True:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat = chat

    @classmethod
    def check(cls, body: dict[str, Any]) -> None:
        """Refuse a body the translation cannot serve (400 naming the field)."""
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise _invalid("model", "is required (a string)")
        if body.get("input") is None:
            raise _invalid("input", "is required")
        for name in _REFUSED:
            if body.get(name) not in (None, False):
                raise _invalid(name, "is not served by the gateway (a chat upstream)")
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise _invalid("previous_response_id", "must be a string")
        if body.get("stream") not in (None, True, False):
            raise _invalid("stream", "must be a boolean")
        maximum = body.get("max_output_tokens")
        if maximum is not None and (not isinstance(maximum, int) or maximum < 1):
            raise _invalid("max_output_tokens", "must be a positive integer")
        include = body.get("include")
        if include is not None and not isinstance(include, list):
            raise _invalid("include", "must be a list")

    # -- answers ----------------------------------------------------------------------------
    def envelope(self, model: Any, status: str) -> dict[str, Any]:
        """The response object around its output (echoing the request's settings)."""
        body = self.request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": model if isinstance(model, str) else body["model"],
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": body.get("reasoning") or {"effort": None, "summary": None},
            "store": body.get("store", True),
            "temperature": body.get("temperature", 1.0),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0),
            "truncation": body.get("truncation", "disabled"),
            "usage": None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }

    def finished(self, response: dict[str, Any], finish_reason: Any, usage: Any) -> dict[str, Any]:
        """The response with its final status and usage."""
        if finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"
        response["usage"] = usage_of(usage)
        return response

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The response object of a whole chat answer."""
        choices = chat.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        response = self.envelope(chat.get("model"), "completed")
        output = []
        if message.get("content"):
            logprobs = text_logprobs(choice.get("logprobs")) if self.logprobs else []
            output.append(message_item(new_id("msg_"), message["content"], logprobs, "completed"))
        for call in message.get("tool_calls") or ():
            output.append(function_item(new_id("fc_"), call, "completed"))
        response["output"] = output
        return self.finished(response, choice.get("finish_reason"), chat.get("usage"))

    def stream(self) -> ResponsesStream:
        """A translator of this call's chat stream into Responses events."""
        return ResponsesStream(self)

    def error_body(self, status: int, message: str, code: str | None = None) -> bytes:
        """OpenAI's error envelope."""
        return pydantic_core.to_json(envelope(status, message, code=code))

    def metadata(self) -> dict[str, Any]:
        """The protocol, and the previous response this one continues."""
        extra: dict[str, Any] = {"protocol": self.name}
        if self.previous is not None:
            extra["previous_response_id"] = self.previous.response_id
        return extra

    def record_extra(self, reply: dict[str, Any]) -> bytes | None:
        """The conversation behind this response (what a `previous_response_id` resolves to)."""
        conversation = {"messages": self.messages, "reply": reply}
        return b'"conversation":' + pydantic_core.to_json(conversation)

    def remember(self, trajectory_uid: str, step_index: int, reply: dict[str, Any]) -> None:
        """Keep this response's conversation, durable now, for calls that continue it."""
        stored = StoredResponse(
            self.response_id,
            trajectory_uid,
            step_index,
            self.scope.prompt_uid,
            self.messages,
            reply,
            self.tenant,
        )
        self.store.add(stored)


def message_item(
    item_id: str, text: str, logprobs: list[dict[str, Any]], status: str
) -> dict[str, Any]:
    """An assistant message output item with one output_text part."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def function_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    """A function_call output item of a chat tool call."""
    function = call.get("function") or {}
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call.get("id") or new_id("call_"),
        "name": function.get("name") or "",
        "arguments": function.get("arguments") or "",
    }


class ResponsesStream(DialectStream):
    """Chat chunks as Responses events: created, items and parts added, text and argument
    deltas; the done events and `response.completed` once the step is durable."""

    def __init__(self, call: ResponsesCall) -> None:
        self.call = call
        self.sequence = 0
        self.model: Any = None
        self.text: dict[str, Any] | None = None  # the message item, once text arrived
        self.text_parts: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.calls: dict[int, dict[str, Any]] = {}  # function_call items by chat tool index
        self.order: list[dict[str, Any]] = []  # output items in output_index order
        self.finish_reason: Any = None
        self.usage: Any = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse(kind, data)

    def start(self) -> bytes:
        """`response.created` and `response.in_progress`."""
        response = self.call.envelope(None, "in_progress")
        return self._event("response.created", response=response) + self._event(
            "response.in_progress", response=response
        )

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """The events of one chat chunk."""
        out = []
        for choice in self.first_choices(chunk):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out.append(self._text(delta["content"], choice.get("logprobs")))
            for call in delta.get("tool_calls") or ():
                out.append(self._call(call))
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _text(self, text: str, chat_logprobs: Any) -> bytes:
        out = b""
        if self.text is None:
            self.text = message_item(new_id("msg_"), "", [], "in_progress")
            self.text["content"] = []
            self.order.append(self.text)
            index = len(self.order) - 1
            out += self._event("response.output_item.added", output_index=index, item=self.text)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event(
                "response.content_part.added",
                item_id=self.text["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        self.text_parts.append(text)
        logprobs = text_logprobs(chat_logprobs) if self.call.logprobs else []
        self.logprobs += logprobs
        return out + self._event(
            "response.output_text.delta",
            item_id=self.text["id"],
            output_index=self.order.index(self.text),
            content_index=0,
            delta=text,
            logprobs=logprobs,
        )

    def _call(self, delta: dict[str, Any]) -> bytes:
        index = delta.get("index", len(self.calls))
        function = delta.get("function") or {}
        out = b""
        item = self.calls.get(index)
        if item is None:
            call = {"id": delta.get("id"), "function": {"name": function.get("name") or ""}}
            item = self.calls[index] = function_item(new_id("fc_"), call, "in_progress")
            self.order.append(item)
            out += self._event(
                "response.output_item.added", output_index=len(self.order) - 1, item=dict(item)
            )
        elif function.get("name"):
            item["name"] += function["name"]
        if delta.get("id") and not item["call_id"]:
            item["call_id"] = delta["id"]
        if arguments := function.get("arguments"):
            item["arguments"] += arguments
            out += self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self.order.index(item),
                delta=arguments,
            )
        return out

    def _output(self) -> list[dict[str, Any]]:
        if self.text is not None:
            text = "".join(self.text_parts)
            done = message_item(self.text["id"], text, self.logprobs, "completed")
            self.text.update(done)
        for item in self.calls.values():
            item["status"] = "completed"
        return self.order

    def final(self) -> dict[str, Any]:
        """The response as the client got it."""
        response = self.call.envelope(self.model, "completed")
        response["output"] = self._output()
        return self.call.finished(response, self.finish_reason, self.usage)

    def finish(self) -> bytes:
        """The items' done events, then `response.completed` (or `response.incomplete`)."""
        response = self.final()
        out = []
        for index, item in enumerate(response["output"]):
            if item["type"] == "message":
                part = item["content"][0]
                ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
                out.append(
                    self._event(
                        "response.output_text.done",
                        **ids,
                        text=part["text"],
                        logprobs=part["logprobs"],
                    )
                )
                out.append(self._event("response.content_part.done", **ids, part=part))
            else:
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=item["name"],
                        arguments=item["arguments"],
                    )
                )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=response))
        return b"".join(out)

    def error(self, failure: UpstreamFailure) -> bytes:
        """An `error` event, then `response.failed`."""
        response = self.final()
        response["status"] = "failed"
        response["error"] = {"code": "server_error", "message": failure.message}
        return self._event(
            "error", code=failure.code, message=failure.message, param=None
        ) + self._event("response.failed", response=response)


class Responses:
    """The gateway's Responses API: calls opened against its store of earlier responses."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def open(
        self, body: dict[str, Any], scope: Scope, tenant: str = DEFAULT_TENANT
    ) -> ResponsesCall:
        """The translated call: its previous response resolved (404 naming the field when
        unknown, 403 when another tenant's), its scope that response's trajectory unless the
        call names one."""
        ResponsesCall.check(body)
        previous = None
        if (previous_id := body.get("previous_response_id")) is not None:
            previous = await self.store.get(previous_id)
            if previous is None:
                raise ApiError(
                    404,
                    f"previous_response_id: no response {previous_id!r} was recorded here",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            if previous.tenant != tenant:  # never continue, nor read, another tenant's
                raise ApiError(
                    403,
                    f"previous_response_id: response {previous_id!r} belongs to another "
                    f"tenant than this key's ({tenant!r})",
                    param="previous_response_id",
                    code="previous_response_forbidden",
                )
            if scope.trajectory_uid is None:
                scope = Scope(
                    previous.trajectory_uid,
                    previous.prompt_uid,
                    scope.policy_version,
                    "previous_response",
                )
        return ResponsesCall(body, previous, scope, self.store, tenant)
