"""Operations: liveness, readiness and Prometheus metrics (no API key needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "Not ready: starting, stopping or stuck"}})
async def readyz(request: Request) -> JSONResponse:
    """Readiness: the WAL is open, the flusher runs and the backlog is under its bound."""
    landing = request.app.state.landing
    backlog = landing.backlog()
    flusher = landing.flusher_status()
    ready = (
        landing.ready
        and flusher["alive"]
        and backlog["bytes"] <= landing.settings.wal_max_backlog_bytes
    )
    body = {
        "status": "ready" if ready else "not_ready",
        "gateway_id": landing.gateway_id,
        "wal_backlog": backlog,
        "flusher": flusher,
        "policy_version": landing.policy_version,  # stamped on steps that name none
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    """Prometheus text: requests, records, WAL backlog, fsync and flush latency, batch sizes."""
    landing = request.app.state.landing
    landing.backlog()  # refresh gauges
    landing.flusher_status()
    return Response(
        request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )
