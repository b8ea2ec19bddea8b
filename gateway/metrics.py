"""Prometheus metrics of one gateway (its own registry, so several apps can coexist)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

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


@lru_cache(maxsize=4096)
def labelled(metric: Any, *values: str) -> Any:
    """`metric.labels(*values)`, cached: `labels` takes a lock and builds a key on every call,
    which adds up on the per-request path (label values must be bounded: routes, kinds)."""
    return metric.labels(*values)


class GatewayMetrics:
    """Counters, gauges and histograms the gateway exports at `/metrics`."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.info = Gauge(
            "claw_gateway_info", "1, labelled with this gateway's id and the lake it writes",
            ["gateway_id", "lake"], registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "claw_gateway_requests", "HTTP requests by route and status", ["route", "status"],
            registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "claw_gateway_request_seconds", "Request latency", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.records = Counter(
            "claw_gateway_records", "Records made durable, by kind", ["kind"], registry=r
        )
        self.duplicates = Counter(
            "claw_gateway_duplicate_records", "Retried records acknowledged again", registry=r
        )
        self.rejected = Counter(
            "claw_gateway_rejected_requests",
            "Requests answered with an error, by its code (e.g. invalid_value, overloaded)",
            ["reason"],
            registry=r,
        )
        self.wal_backlog_bytes = Gauge(
            "claw_gateway_wal_backlog_bytes", "Durable WAL bytes not yet in bronze", registry=r
        )
        self.wal_sealed_segments = Gauge(
            "claw_gateway_wal_sealed_segments", "Sealed WAL segments awaiting the flusher",
            registry=r,
        )  # fmt: skip
        self.wal_open_records = Gauge(
            "claw_gateway_wal_open_records", "Records in the open WAL segment", registry=r
        )
        self.wal_sync_seconds = Histogram(
            "claw_gateway_wal_sync_seconds", "Durable write of one commit group",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.wal_syncs = Counter(
            "claw_gateway_wal_syncs",
            "Commit groups made durable, by who ran the fdatasync (the event loop for a lone "
            "write on an idle log, else the syncer process)",
            ["by"],
            registry=r,
        )
        self.wal_group_records = Histogram(
            "claw_gateway_wal_group_records", "Records per commit group",
            buckets=SIZE_BUCKETS, registry=r,
        )  # fmt: skip
        self.replayed_records = Counter(
            "claw_gateway_replayed_records", "Records found in the WAL at start", registry=r
        )
        # Reported by the flusher process (gateway.wal.flusher), refreshed on each scrape.
        self.flusher = {
            key: Gauge(f"claw_flusher_{name}", help_text, registry=r)
            for key, name, help_text in (
                ("alive", "up", "1 while the bronze flusher process runs"),
                ("commits", "bronze_commits", "Bronze commits since the flusher started"),
                ("records", "bronze_records", "Records landed since the flusher started"),
                ("flush_seconds_total", "flush_seconds_total", "Seconds spent committing"),
                ("last_flush_seconds", "last_flush_seconds", "Latency of the last commit"),
                ("last_batch_records", "last_batch_records", "Records in the last commit"),
                ("failures", "failures", "Commits that failed and were retried"),
            )
        }

    def record_flusher(self, status: dict) -> None:
        """Copy the flusher's last status into gauges."""
        for key, gauge in self.flusher.items():
            value = status.get(key)
            if value is not None:
                gauge.set(float(value))

    def render(self) -> bytes:
        """Prometheus text exposition."""
        return generate_latest(self.registry)
