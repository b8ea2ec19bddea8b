"""`claw sim-llm`: the bundled simulated OpenAI-compatible model, an honest test double of vLLM.

It is not a language model: answers come from a phrase bank and a small arithmetic solver,
chosen deterministically from (seed, request seed, prompt token ids, choice index), and are
tokenized with the bundled tokenizer, so token ids, log-probs and streams are exact and
reproducible. `GET /v1/models` says `owned_by: claw-simulated`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any

import pydantic_core
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from claw_pipelines.simulation.protocol import ChatCompletionRequest, CompletionRequest
from claw_pipelines.simulation.serving import SimRequestError, SimulatedModel
from claw_pipelines.tokenization import load_tokenizer

__all__ = ["create_sim_app", "serve"]

_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error"}


def _error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class _JSON(JSONResponse):
    """JSON encoded in Rust: an answer with token ids and log-probs costs ~2x less than with
    `json.dumps`, as a real inference server's serving cost is small next to its sampling."""

    def render(self, content: Any) -> bytes:
        return pydantic_core.to_json(content)


def _param(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "content")` -> `messages[0].content`."""
    text = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".") or None


async def _on_validation_error(_: Request, exc: Exception) -> JSONResponse:
    first = exc.errors()[0] if isinstance(exc, RequestValidationError) and exc.errors() else {}
    if first.get("type") == "json_invalid":
        return _error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    param = _param(tuple(first.get("loc", ())))
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    where = param or ("body" if first.get("type") == "missing" else None)
    return _error(400, f"{where}: {message}" if where else message, param, "invalid_value")


async def _on_sim_error(_: Request, exc: Exception) -> JSONResponse:
    return _error(400, str(exc), getattr(exc, "param", None), "invalid_value")


async def _on_http_error(_: Request, exc: Exception) -> JSONResponse:
    status = getattr(exc, "status_code", 500)
    return _error(status, str(getattr(exc, "detail", "error")))


def get_sim(request: Request) -> SimulatedModel:
    """The app's simulated model."""
    return request.app.state.sim


Sim = Annotated[SimulatedModel, Depends(get_sim)]


def _sse(chunks: Iterator[dict[str, Any]], latency_s: float) -> StreamingResponse:
    """Server-sent events, the request's latency spread evenly over its chunks."""
    ready = list(chunks)
    pause = latency_s / max(len(ready), 1)

    async def events() -> AsyncIterator[bytes]:
        for chunk in ready:
            if pause:
                await asyncio.sleep(pause)
            yield b"data: " + pydantic_core.to_json(chunk) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def create_sim_app(
    seed: int = 0,
    latency_ms: float = 0.0,
    model_id: str = "claw-sim-llm",
    drift: float = 0.0,
    token_ids: bool = True,
) -> FastAPI:
    """The simulated model's FastAPI app (deterministic for a seed; `drift`: the share of
    choices whose sampled ids re-encoding their text does not give back; without
    `token_ids`, `return_token_ids` is refused as OpenAI refuses it: a server without ids)."""
    app = FastAPI(
        title="claw simulated LLM",
        summary="A deterministic, simulated OpenAI-compatible model for demos and tests.",
    )
    app.state.sim = SimulatedModel(load_tokenizer(), seed=seed, model_id=model_id, drift=drift)
    latency_s = max(latency_ms, 0.0) / 1000.0
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(SimRequestError, _on_sim_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)

    def refuse_token_ids(asked: bool) -> None:
        if asked and not token_ids:
            message = "Unrecognized request argument supplied: return_token_ids"
            raise SimRequestError(message, "return_token_ids")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """Liveness: the simulated model is up."""
        return {"status": "ok", "simulated": True}

    @app.get("/v1/models")
    async def models(sim: Sim) -> dict[str, Any]:
        """The one simulated model."""
        return sim.models()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, sim: Sim
    ) -> JSONResponse | StreamingResponse:
        """OpenAI chat completions, with vLLM's `return_token_ids`."""
        refuse_token_ids(body.return_token_ids)
        run = sim.chat(body, pydantic_core.from_json(await request.body()))
        if body.stream:
            return _sse(sim.chat_chunks(run, body), latency_s)
        if latency_s:
            await asyncio.sleep(latency_s)
        # A response directly: FastAPI's jsonable_encoder costs ~3 ms per 1,500 token ids.
        return _JSON(sim.chat_response(run, body))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, sim: Sim) -> JSONResponse | StreamingResponse:
        """OpenAI legacy completions: a prompt string or token ids, or a list of those."""
        refuse_token_ids(body.return_token_ids)
        run = sim.completion(body)
        if body.stream:
            return _sse(sim.completion_chunks(run, body), latency_s)
        if latency_s:
            await asyncio.sleep(latency_s)
        return _JSON(sim.completion_response(run, body))

    return app


def serve(
    host: str = "127.0.0.1",
    port: int = 8000,
    seed: int = 0,
    latency_ms: float = 0.0,
    drift: float = 0.0,
    token_ids: bool = True,
) -> None:
    """Run the simulated model with uvicorn until interrupted."""
    import uvicorn

    uvicorn.run(
        create_sim_app(seed=seed, latency_ms=latency_ms, drift=drift, token_ids=token_ids),
        host=host,
        port=port,
        log_level="info",
    )
