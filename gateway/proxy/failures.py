"""Upstream failures and how the client sees them: a timeout is 504, anything else 502."""

from __future__ import annotations

import json


class UpstreamFailure(Exception):
    """The upstream gave no usable answer: it timed out (504), was unreachable or failed (502)."""

    def __init__(
        self, status: int, code: str, message: str, upstream_status: int | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.upstream_status = upstream_status


def upstream_message(body: bytes, limit: int = 300) -> str:
    """The message of an upstream error body (OpenAI envelope or plain text), shortened."""
    try:
        error = json.loads(body).get("error")
        text = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        text = None
    text = str(text) if text else body.decode("utf-8", "replace").strip()
    return text[:limit] or "(empty body)"


def failure_of_status(status: int, body: bytes) -> UpstreamFailure:
    """The 502 for an upstream 5xx answer."""
    return UpstreamFailure(
        502, "upstream_error", f"upstream answered {status}: {upstream_message(body)}", status
    )
