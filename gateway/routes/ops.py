"""Operations: liveness and readiness (never need an API key), Prometheus metrics (need
one when keys are configured, unless `CLAW_METRICS_PUBLIC=true`)."""

from __future__ import annotations

import json

from claw_pipelines.settings import ClawSettings
from gateway.asgi import Answer
from gateway.incoming import Incoming
from gateway.routes.table import Route

TAG = "operations"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
HEALTH_PATHS = frozenset({"/healthz", "/readyz"})


def open_paths(settings: ClawSettings) -> frozenset[str]:
    """The paths answered without an API key: health, and /metrics when asked for."""
    return HEALTH_PATHS | ({"/metrics"} if settings.metrics_public else set())


async def healthz(incoming: Incoming) -> Answer:
    """Liveness: the process answers."""
    return Answer(200, b'{"status":"ok"}')


async def readyz(incoming: Incoming) -> Answer:
    """Readiness: the WAL is open, the flusher runs and the backlog is under its bound."""
    landing = incoming.services.landing
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
    if incoming.services.upstream is not None:
        body["capture"] = incoming.services.proxy.capture.describe()
        body["replicas"] = incoming.services.upstream.describe()
    return Answer(200 if ready else 503, json.dumps(body).encode())


async def metrics(incoming: Incoming) -> Answer:
    """Prometheus text: requests, records, WAL backlog, fsync and flush latency, batch sizes."""
    landing = incoming.services.landing
    landing.backlog()  # refresh gauges
    landing.flusher_status()
    return Answer(200, incoming.services.metrics.render(), PROMETHEUS)


ROUTES = [
    Route("GET", "/healthz", healthz, TAG),
    Route(
        "GET",
        "/readyz",
        readyz,
        TAG,
        responses={503: {"description": "Not ready: starting, stopping or stuck"}},
    ),
    Route("GET", "/metrics", metrics, TAG, responses={200: {"content": {PROMETHEUS: {}}}}),
]
