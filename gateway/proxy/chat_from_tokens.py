"""A token-id completion answered to the agent as the chat completion it asked for: the
sampled ids decoded here, Hermes-style tool calls (`<tool_call>\\n{"name": ..., "arguments":
...}\\n</tool_call>`, as Qwen and the bundled ChatML template write them) parsed out, log-probs
in the chat shape, and, for a stream, the whole answer sent as one burst of chunks."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import pydantic_core

from claw_pipelines.tokenization import TOOL_CALL_END, TOOL_CALL_START, ChatTokenizer

_TOOL_CALL = re.compile(
    re.escape(TOOL_CALL_START) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_END), re.DOTALL
)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and tool calls of a decoded reply; text that is not a well-formed call
    stays content."""
    calls, first = [], None
    for match in _TOOL_CALL.finditer(text):
        try:
            call = pydantic_core.from_json(match.group(1))
        except ValueError:
            return text or None, []
        name = call.get("name") if isinstance(call, dict) else None
        if not isinstance(name, str):
            return text or None, []
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = pydantic_core.to_json(arguments).decode()
        calls.append(
            {
                "id": "call_" + os.urandom(12).hex(),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
        first = match.start() if first is None else first
    if not calls:
        return text or None, []
    return text[:first].strip() or None, calls


def reply_message(
    tokenizer: ChatTokenizer, response_ids: Sequence[int], eos_id: int
) -> dict[str, Any]:
    """The assistant message of sampled ids (the end-of-turn token dropped)."""
    ids = list(response_ids)
    if ids and ids[-1] == eos_id:
        ids.pop()
    content, calls = parse_tool_calls(tokenizer.decode(ids))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_logprobs(logprobs: Any, top: int) -> dict[str, Any] | None:
    """Legacy completions `logprobs` (tokens, token_logprobs, top_logprobs) in the chat shape."""
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    content = []
    for token, value, alternatives in zip(tokens, values, tops, strict=False):
        entry = {"token": token, "logprob": value, "bytes": list(str(token).encode())}
        ranked = sorted((alternatives or {}).items(), key=lambda kv: -kv[1])[:top]
        entry["top_logprobs"] = [
            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in ranked
        ]
        content.append(entry)
    return {"content": content, "refusal": None}


def chunk_dicts(answer: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A complete chat answer as the chunks of a stream (role, content, tool calls, finish;
    usage when asked)."""
    envelope = {
        "id": answer.get("id"),
        "object": "chat.completion.chunk",
        "created": answer.get("created"),
        "model": answer.get("model"),
    }
    chunks = []
    for choice in answer["choices"]:
        index, message = choice["index"], choice["message"]
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if message.get("content"):
            deltas.append({"content": message["content"]})
        for position, call in enumerate(message.get("tool_calls") or ()):
            deltas.append({"tool_calls": [{"index": position, **call}]})
        deltas.append({})
        logprobs = choice.get("logprobs")  # sent with the first delta that has tokens
        for number, delta in enumerate(deltas):
            last = number == len(deltas) - 1
            part = {"index": index, "delta": delta, "logprobs": logprobs if number == 1 else None}
            part["finish_reason"] = choice["finish_reason"] if last else None
            chunks.append(envelope | {"choices": [part]})
    if include_usage:
        chunks.append(envelope | {"choices": [], "usage": answer.get("usage")})
    return chunks


def chat_chunks(answer: dict[str, Any], include_usage: bool) -> bytes:
    """A complete chat answer as the server-sent events of a stream, ending `[DONE]`."""
    events = [
        b"data: " + pydantic_core.to_json(c) + b"\n\n" for c in chunk_dicts(answer, include_usage)
    ]
    events.append(b"data: [DONE]\n\n")
    return b"".join(events)
