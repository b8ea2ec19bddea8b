"""The gateway's routes: handlers grouped by area, and the one table they form."""

from gateway.routes import claw_r1, ingest, ops, otlp, proxy
from gateway.routes.table import Route, RouteTable

ROUTES = RouteTable([*ingest.ROUTES, *otlp.ROUTES, *claw_r1.ROUTES, *proxy.ROUTES, *ops.ROUTES])

__all__ = ["ROUTES", "Route", "RouteTable"]
