"""What the gateway's handlers work with, typed: settings, keys, metrics, landing, proxy."""

from __future__ import annotations

from dataclasses import dataclass

from claw_pipelines.settings import ClawSettings
from gateway.auth import KeyRing
from gateway.deadlines import ReadDeadlines
from gateway.landing import Landing
from gateway.metrics import GatewayMetrics
from gateway.proxy import ProxyService
from gateway.proxy.replicas import Replicas


@dataclass(frozen=True, slots=True)
class GatewayServices:
    """The long-lived parts of a running gateway, built by the app's lifespan."""

    settings: ClawSettings
    keys: KeyRing
    metrics: GatewayMetrics
    landing: Landing
    proxy: ProxyService
    deadlines: ReadDeadlines  # of request-body reads (CLAW_BODY_READ_TIMEOUT_S)
    upstream: Replicas | None = None  # the inference replicas the proxy forwards to
