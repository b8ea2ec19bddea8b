"""The ceiling for gateway_ingest: FastAPI that validates the same Step model and drops it."""

from __future__ import annotations

from fastapi import FastAPI, Request

from claw_pipelines.contracts.wire import StepBatch


def create_baseline_app() -> FastAPI:
    """Parse and validate exactly as the gateway does, then answer without storing."""
    app = FastAPI()

    @app.post("/v1/steps")
    async def drop_steps(request: Request) -> dict[str, int]:
        batch = StepBatch.model_validate_json(await request.body())
        return {"accepted": len(batch.steps)}

    return app
