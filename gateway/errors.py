"""The OpenAI error envelope (and, on Anthropic's `/v1/messages`, Anthropic's error shape): one
exception type and the handlers that render every error."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from claw_pipelines.contracts.wire import ErrorResponse

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "overloaded_error",
    504: "upstream_error",
}


class ApiError(Exception):
    """An error answered to the client in the OpenAI envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def envelope(status: int, message: str, param: str | None = None, code: str | None = None):
    """The JSON body of an error."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PATH_SUFFIX = "/v1/messages"  # the routes that answer errors in Anthropic's shape


def anthropic_envelope(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(path: str, error: ApiError) -> dict[str, Any]:
    """An error's body in the shape of the route it answers: Anthropic's on `/v1/messages`,
    else OpenAI's envelope."""
    if path.endswith(ANTHROPIC_PATH_SUFFIX):
        return anthropic_envelope(error.status, error.message)
    return envelope(error.status, error.message, error.param, error.code)


def error_response(exc: ApiError) -> JSONResponse:
    """Render an ApiError."""
    return JSONResponse(
        envelope(exc.status, exc.message, exc.param, exc.code),
        status_code=exc.status,
        headers=exc.headers,
    )


def field_path(loc: Sequence[Any]) -> str:
    """`("steps", 0, "prompt_ids", 3)` -> `"steps[0].prompt_ids[3]"`."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def validation_error(errors: Sequence[dict[str, Any]], drop_prefix: tuple = ()) -> ApiError:
    """One ApiError naming the first invalid field (400 for malformed JSON, else 422)."""
    if not errors:
        return ApiError(422, "invalid request", code="invalid_value")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if loc[: len(drop_prefix)] == drop_prefix:
        loc = loc[len(drop_prefix) :]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"body is not valid JSON: {first.get('msg')}", code="invalid_json")
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    param = field_path(loc) or None
    text = f"{param}: {message}" if param else message
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more invalid field(s))"
    return ApiError(422, text, param=param, code=first.get("type"))


def from_pydantic(exc: ValidationError) -> ApiError:
    """Map a body ValidationError to the envelope."""
    return validation_error(exc.errors(include_url=False, include_input=False))


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Malformed JSON",
        401: "Missing or invalid API key",
        413: "Body too large",
        415: "Body is not JSON",
        422: "A field is invalid; `error.param` names it",
        429: "Too many requests; see Retry-After",
        503: "Overloaded or write-ahead log unavailable; see Retry-After",
    }.items()
}


def install_error_handlers(app: FastAPI) -> None:
    """Render every error, ours and the framework's, in the OpenAI envelope."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {**e, "loc": tuple(e.get("loc", ()))[1:] if e.get("loc") else ()} for e in exc.errors()
        ]
        return error_response(validation_error(errors))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        return error_response(ApiError(exc.status_code, message, headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(ApiError(500, "internal error; the request was not stored"))
