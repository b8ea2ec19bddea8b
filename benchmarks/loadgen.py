"""A small closed-loop HTTP/1.1 load generator: keep-alive connections, pre-encoded requests."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np

from benchmarks.harness import percentiles


@dataclass
class LoadResult:
    """Throughput and latency of one run."""

    requests: int = 0
    errors: int = 0
    acknowledged_all: int = 0  # 200s including the warm-up's
    statuses: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    server_ms: dict[str, list[float]] = field(default_factory=dict)  # from Server-Timing

    def merge(self, other: LoadResult) -> None:
        """Add another run's counts and latencies."""
        self.requests += other.requests
        self.errors += other.errors
        self.acknowledged_all += other.acknowledged_all
        self.seconds += other.seconds
        self.latencies += other.latencies
        for name, values in other.server_ms.items():
            self.server_ms.setdefault(name, []).extend(values)
        for status, count in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + count

    def summary(self) -> dict[str, float]:
        """rps and latency percentiles in milliseconds."""
        p50, p99 = percentiles_ms(np.asarray(self.latencies) * 1000)
        return {
            "requests": self.requests,
            "errors": self.errors,
            "rps": round(self.requests / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": p50,
            "p99_ms": p99,
        }


def percentiles_ms(values) -> tuple[float, float]:
    """p50 and p99 of millisecond values, rounded to the microsecond (0 when empty)."""
    found = percentiles(values, (50, 99), digits=3, empty=0.0)
    return found["p50"], found["p99"]


def encode_post(host: str, port: int, path: str, body: bytes, headers: dict | None = None) -> bytes:
    """One keep-alive HTTP/1.1 POST request, ready to write."""
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: keep-alive",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, dict[str, float]]:
    """Status, body and the Server-Timing durations (ms by name) of one response."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length, timings = 0, {}
    for line in head.split(b"\r\n"):
        lowered = line.lower()
        if lowered.startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
        elif lowered.startswith(b"server-timing:"):
            for metric in line.split(b":", 1)[1].decode().split(","):
                name, _, duration = metric.strip().partition(";dur=")
                timings[name] = float(duration)
    return status, await reader.readexactly(length), timings


async def run_load(
    host: str,
    port: int,
    request: bytes,
    *,
    connections: int,
    seconds: float,
    warmup: float = 1.0,
    stagger: float = 0.0,
) -> LoadResult:
    """Drive `connections` closed loops for `warmup + seconds`; count only after warm-up.

    `stagger` spreads the loops' first requests evenly over that many seconds (within the
    warm-up), as independent clients would be, instead of starting them all at once."""
    result = LoadResult()
    started = time.perf_counter()
    measure_from = started + warmup
    stop_at = measure_from + seconds

    async def loop(index: int) -> None:
        reader, writer = await asyncio.open_connection(host, port)
        await asyncio.sleep(stagger * index / connections)
        try:
            while True:
                sent = time.perf_counter()
                if sent >= stop_at:
                    return
                writer.write(request)
                status, _, timings = await _read_response(reader)
                done = time.perf_counter()
                result.acknowledged_all += status == 200
                if sent >= measure_from:
                    result.statuses[status] = result.statuses.get(status, 0) + 1
                    if status == 200:
                        result.requests += 1
                        result.latencies.append(done - sent)
                        for name, ms in timings.items():
                            result.server_ms.setdefault(name, []).append(ms)
                    else:
                        result.errors += 1
        finally:
            writer.close()

    await asyncio.gather(*(loop(i) for i in range(connections)))
    result.seconds = time.perf_counter() - measure_from
    return result
