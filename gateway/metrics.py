"""Prometheus metrics of one gateway (its own registry, so several apps can coexist)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
SIZE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)


class GatewayMetrics:
    """Counters, gauges and histograms the gateway exports at `/metrics`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "claw_gateway_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "claw_gateway_request_seconds",
            "Request latency",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.records = Counter(
            "claw_gateway_records", "Records made durable, by kind", ["kind"], registry=r
        )
        self.duplicates = Counter(
            "claw_gateway_duplicate_records", "Retried records acknowledged again", registry=r
        )
        self.rejected = Counter(
            "claw_gateway_rejected_requests", "Requests refused, by reason", ["reason"], registry=r
        )
        self.wal_backlog_records = Gauge(
            "claw_gateway_wal_backlog_records", "Durable records not yet in bronze", registry=r
        )
        self.wal_backlog_bytes = Gauge(
            "claw_gateway_wal_backlog_bytes", "WAL bytes not yet in bronze", registry=r
        )
        self.wal_sync_seconds = Histogram(
            "claw_gateway_wal_sync_seconds",
            "Write + fsync of one commit group",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.wal_group_records = Histogram(
            "claw_gateway_wal_group_records",
            "Records per fsync group",
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.flush_seconds = Histogram(
            "claw_gateway_flush_seconds",
            "Latency of one bronze commit",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_records = Histogram(
            "claw_gateway_batch_records",
            "Records per bronze commit",
            buckets=SIZE_BUCKETS,
            registry=r,
        )
        self.flush_failures = Counter(
            "claw_gateway_flush_failures",
            "Bronze commits that failed and will be retried",
            registry=r,
        )
        self.replayed_records = Counter(
            "claw_gateway_replayed_records", "Records replayed from the WAL at start", registry=r
        )

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
