"""Upstream failures and how the client sees them: a timeout is 504, anything else 502."""

from __future__ import annotations

import html
import json
import re
from typing import Any

from gateway.errors import envelope


class UpstreamFailure(Exception):
    """The upstream gave no usable answer: it timed out (504), was unreachable or failed (502)."""

    def __init__(
        self, status: int, code: str, message: str, upstream_status: int | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.upstream_status = upstream_status


_TAG = re.compile(r"<[^>]+>")
_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.IGNORECASE | re.DOTALL)
_HIDDEN = re.compile(r"<(script|style|head)[^>]*>.*?</\1>", re.IGNORECASE | re.DOTALL)


def _json_message(data: Any) -> str | None:
    """The message of a JSON error body: OpenAI's `{"error": {"message"}}` (or a string
    error), the flat `{"message"}` of SGLang and older vLLM, FastAPI's `{"detail"}` (a string,
    or validation errors with `msg` and `loc`)."""
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(error, str) and error:
        return error
    if isinstance(data.get("message"), str) and data["message"]:
        return data["message"]
    detail = data.get("detail")
    if isinstance(detail, str) and detail:
        return detail
    if isinstance(detail, list) and detail:
        parts = []
        for item in detail:
            if isinstance(item, dict):
                where = ".".join(str(p) for p in item.get("loc") or () if p != "body")
                text = str(item.get("msg", item))
                parts.append(f"{where}: {text}" if where else text)
            else:
                parts.append(str(item))
        return "; ".join(parts)
    return None


def _text_message(body: bytes) -> str:
    """Plain text, or an HTML page's title (else its visible text), collapsed to one line."""
    text = body.decode("utf-8", "replace")
    if "<" in text and ">" in text:
        title = _TITLE.search(text)
        text = title.group(1) if title and title.group(1).strip() else _HIDDEN.sub(" ", text)
        text = html.unescape(_TAG.sub(" ", text))
    return " ".join(text.split())


def upstream_message(body: bytes, limit: int = 300) -> str:
    """The message of an upstream error body (JSON in any common shape, plain text or
    HTML), on one line and shortened."""
    try:
        text = _json_message(json.loads(body))
    except ValueError:
        text = None
    text = " ".join(text.split()) if text else _text_message(body)
    return text[:limit] or "(empty body)"


def is_openai_error(body: bytes) -> bool:
    """Whether a body is already OpenAI's error envelope (`{"error": {"message": ...}}`)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def openai_error_body(status: int, body: bytes) -> bytes | None:
    """An upstream error answer as OpenAI's envelope, carrying its status and message; None
    when it is one already (passed on unchanged)."""
    if is_openai_error(body):
        return None
    error = envelope(status, f"upstream answered {status}: {upstream_message(body)}")
    error["error"]["code"] = "upstream_error"
    return json.dumps(error).encode()


def failure_of_status(status: int, body: bytes) -> UpstreamFailure:
    """The 502 for an upstream 5xx answer."""
    return UpstreamFailure(
        502, "upstream_error", f"upstream answered {status}: {upstream_message(body)}", status
    )
