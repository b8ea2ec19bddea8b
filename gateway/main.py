"""The gateway application: `create_app()` builds it; the lifespan owns its long-lived parts."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import claw_pipelines
from claw_pipelines.lake.delta import Lake
from claw_pipelines.settings import ClawSettings
from gateway.auth import KeyRing
from gateway.deadlines import ReadDeadlines
from gateway.dispatch import Dispatcher
from gateway.errors import install_error_handlers
from gateway.landing import Landing
from gateway.metrics import GatewayMetrics
from gateway.numbering import RecordedSteps
from gateway.openapi import document_routes, registered_routes
from gateway.proxy import ProxyService
from gateway.proxy.capture_mode import CaptureMode
from gateway.proxy.replicas import Replicas
from gateway.routes import ROUTES
from gateway.routes.ops import open_paths
from gateway.services import GatewayServices

log = logging.getLogger(__name__)
NOT_HERE = (
    "the gateway serves its routes from gateway.routes' table through gateway.dispatch, "
    "where FastAPI middlewares, dependencies and routes would not run: add cross-cutting "
    "work to gateway.dispatch.Dispatcher and routes to the table"
)


class GatewayApp(FastAPI):
    """FastAPI behind the gateway's dispatcher (gateway.dispatch), which serves every route
    of the table and hands the rest (docs, 404, 405) to FastAPI. Middlewares, dependencies
    and routes added to the app itself are refused: they would not run on the table's
    routes."""

    dispatcher: Dispatcher | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.dispatcher is None:
            return await super().__call__(scope, receive, send)
        await self.dispatcher(scope, receive, send)

    def add_middleware(self, middleware_class: Any, *args: Any, **kwargs: Any) -> None:
        """Refused: see NOT_HERE."""
        raise TypeError(NOT_HERE)

    def build_middleware_stack(self) -> ASGIApp:
        """FastAPI's own stack, once the app is checked to hold only what the table made."""
        check_only_table_routes(self)
        return super().build_middleware_stack()


def check_only_table_routes(app: FastAPI) -> None:
    """Raise unless the app's routes are exactly the table's, with no dependencies and no
    middleware of its own (which the dispatcher's requests would skip)."""
    documented = registered_routes(app)
    table = {(route.method, route.path) for route in ROUTES.routes}
    extra, missing = sorted(documented - table), sorted(table - documented)
    dependencies = app.router.dependencies or [
        route.path for route in app.routes if getattr(route, "dependencies", None)
    ]
    if extra or missing or dependencies or app.user_middleware:
        raise RuntimeError(
            f"{NOT_HERE} (routes outside the table: {extra}; table routes not documented: "
            f"{missing}; dependencies: {dependencies}; middlewares: {app.user_middleware})"
        )


def create_app(
    settings: ClawSettings | None = None,
    landing: Landing | None = None,
    capture: CaptureMode | None = None,
) -> GatewayApp:
    """A gateway app for `settings` (default: from the environment). `landing` replaces the
    durable landing (WAL, syncer and flusher processes), e.g. to serve in-process in tests
    of validation and routing: it is started and stopped with the app. `capture`: how token
    ids are captured, as `gateway.serve` found it at start (default: from CLAW_TOKENIZER,
    the upstream not asked)."""
    settings = settings or ClawSettings()
    capture = capture or CaptureMode(settings.tokenizer)
    metrics = GatewayMetrics()
    keys = KeyRing.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: GatewayApp) -> AsyncIterator[None]:
        # the step indices the WAL and bronze hold, read at start when there is a proxy
        recorded = RecordedSteps() if settings.upstream_url else None
        landed = landing or Landing(settings, Lake.from_settings(settings), metrics, recorded)
        upstream = None
        if settings.upstream_url:
            upstream = Replicas.from_setting(
                settings.upstream_url, settings.upstream_timeout_s, settings.upstream_client
            )
            if capture.probe is not None and capture.probe.token_ids is False:
                upstream.refuses_token_ids(stream=False)  # known at start: not asked again
        proxy = ProxyService(settings, landed, upstream, metrics.registry, capture, recorded)
        deadlines = ReadDeadlines(settings.body_read_timeout_s)
        services = GatewayServices(settings, keys, metrics, landed, proxy, deadlines, upstream)
        await landed.start()
        metrics.info.labels(settings.gateway_id, landed.lake.uri).set(1)
        app.dispatcher.services = services
        log.info("gateway %s ready; lake %s", settings.gateway_id, landed.lake.uri)
        if upstream is not None:
            log.info("capture: %s", capture.summary())
        try:
            yield
        finally:
            deadlines.stop()
            if upstream is not None:
                await upstream.aclose()
            await landed.stop()

    app = GatewayApp(
        title="Claw gateway",
        version=claw_pipelines.__version__,
        description="Durable ingestion of agent LLM interactions for RL, and an "
        "OpenAI-compatible proxy. A 2xx means the record survives a crash.",
        lifespan=lifespan,
    )
    install_error_handlers(app)
    app.dispatcher = Dispatcher(
        partial(FastAPI.__call__, app),
        ROUTES,
        metrics,
        settings.max_body_bytes,
        keys,
        open_paths(settings),
    )
    document_routes(app, ROUTES, lambda: app.dispatcher.services)
    return app
