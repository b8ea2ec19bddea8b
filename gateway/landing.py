"""Landing: records become durable in the WAL, then land in `bronze/events` in micro-batches."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time

import polars as pl

from claw_pipelines.contracts.tables import BRONZE_EVENTS, BRONZE_EVENTS_SPEC
from claw_pipelines.lake import Lake
from claw_pipelines.settings import ClawSettings
from gateway.idempotency import IdempotencyIndex
from gateway.metrics import GatewayMetrics
from gateway.records import BronzeRecord, to_bronze_table
from gateway.wal import Segment, WalUnavailable, WriteAheadLog

log = logging.getLogger(__name__)
MAX_RETRY_DELAY = 5.0


class Overloaded(Exception):
    """The gateway cannot take more right now; the client should retry after a pause."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Landing:
    """The durable path of every record: idempotency, WAL group commit, bronze micro-batches."""

    def __init__(self, settings: ClawSettings, lake: Lake, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.lake = lake
        self.metrics = metrics
        self.gateway_id = settings.gateway_id
        self.wal = WriteAheadLog(settings.resolved_wal_dir)
        self.wal.on_group = self._after_group
        self.index = IdempotencyIndex(settings.dedup_capacity)
        self._sealed: list[Segment] = []
        self._writes: set[asyncio.Task[None]] = set()
        self._kick = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None
        self._stopping = False
        self.ready = False
        self.last_flush_error: str | None = None
        self.landed_batches = 0

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the WAL, land what a previous process left in it, then accept records."""
        self.wal.lock()
        self.lake.ensure(BRONZE_EVENTS_SPEC)
        leftovers = self.wal.recover()
        landed_seq = self.lake.transaction_version(BRONZE_EVENTS, self.gateway_id) or 0
        await asyncio.to_thread(self._load_recent_event_ids)
        for segment in leftovers:
            self.index.remember(r.event_id for r in segment.records)
            self.wal.sealed_backlog_bytes += segment.nbytes
            self.wal.sealed_backlog_records += len(segment.records)
            self.metrics.replayed_records.inc(len(segment.records))
        self._sealed.extend(leftovers)
        if leftovers:
            log.info("replaying %d WAL segments", len(leftovers))
            await asyncio.to_thread(self._land_sealed_blocking, True)
        next_seq = max([landed_seq, *(s.seq for s in leftovers)]) + 1
        self.wal.start(next_seq)
        self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())
        self.ready = True
        self._update_gauges()

    async def stop(self) -> None:
        """Graceful shutdown: refuse new records, land everything durable, release the WAL."""
        self.ready = False
        last = await self.wal.close()
        if last is not None:
            self._sealed.append(last)
        self._stopping = True
        self._kick.set()
        if self._flusher is not None:
            await self._flusher
        if self._sealed:
            try:
                await asyncio.to_thread(self._land_sealed_blocking, True)
            except Exception:
                log.exception(
                    "could not land %d WAL segments; they replay on next start", len(self._sealed)
                )

    # -- the ack path -----------------------------------------------------------------------
    async def land(self, records: list[BronzeRecord]) -> tuple[int, int]:
        """Make records durable; return (written, duplicates). Raises Overloaded."""
        if not self.ready:
            raise Overloaded("the gateway is starting or stopping", retry_after=1)
        backlog = self.wal.sealed_backlog_bytes + self.wal.current_bytes
        if backlog > self.settings.wal_max_backlog_bytes:
            self.metrics.rejected.labels("backlog").inc()
            raise Overloaded(
                f"write-ahead log backlog is {backlog} bytes, over its bound; retry shortly",
                retry_after=2,
            )
        ids = [r.event_id for r in records]
        fresh_positions, waits = self.index.claim(ids)
        fresh = [records[i] for i in fresh_positions]
        if fresh:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.index.begin([r.event_id for r in fresh], future)
            # The write finishes on its own even if this request is cancelled meanwhile.
            task = asyncio.get_running_loop().create_task(self._write(fresh, future))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
            waits.append(future)
        for waited in waits:
            try:
                await asyncio.shield(waited)
            except WalUnavailable as exc:
                raise Overloaded(str(exc), retry_after=5) from exc
        duplicates = len(records) - len(fresh)
        if duplicates:
            self.metrics.duplicates.inc(duplicates)
        return len(fresh), duplicates

    async def _write(self, fresh: list[BronzeRecord], future: asyncio.Future[None]) -> None:
        ids = [r.event_id for r in fresh]
        try:
            await self.wal.append(fresh)
        except WalUnavailable as exc:
            self.index.finish(ids, ok=False)
            self.metrics.rejected.labels("wal").inc()
            future.set_exception(exc)
            future.exception()  # marked retrieved; every waiter re-raises it
            return
        self.index.finish(ids, ok=True)
        future.set_result(None)
        for record in fresh:
            self.metrics.records.labels(record.kind).inc()

    def _after_group(self, records: int, seconds: float) -> None:
        self.metrics.wal_sync_seconds.observe(seconds)
        self.metrics.wal_group_records.observe(records)
        s = self.settings
        if self.wal.current_records >= s.flush_max_records or self.wal.current_bytes >= (
            s.flush_max_bytes
        ):
            self._kick.set()

    # -- the flush path ---------------------------------------------------------------------
    async def _flush_loop(self) -> None:
        interval = self.settings.flush_interval_ms / 1000
        delay = 0.0
        while not self._stopping:
            timeout = delay if delay else max(0.002, interval - self.wal.current_age)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), timeout)
            self._kick.clear()
            if self._stopping:
                return
            full = self.wal.current_records >= self.settings.flush_max_records
            if full or self.wal.current_age >= interval:
                segment = await self.wal.seal()
                if segment is not None:
                    self._sealed.append(segment)
            if not self._sealed:
                continue
            try:
                await asyncio.to_thread(self._land_sealed_blocking, delay > 0)
                delay = 0.0
                self.last_flush_error = None
            except Exception as exc:
                self.metrics.flush_failures.inc()
                self.last_flush_error = f"{type(exc).__name__}: {exc}"
                delay = min(MAX_RETRY_DELAY, max(0.1, delay * 2))
                log.warning("bronze commit failed (retrying in %.1fs): %s", delay, exc)
            self._update_gauges()

    def _land_sealed_blocking(self, verify: bool) -> None:
        """Land every sealed segment, oldest first, in commits bounded by flush_max_bytes.

        With `verify`, batches the table already has (by transaction version) are skipped:
        after a crash or a failed commit we cannot know whether the last commit landed.
        """
        while self._sealed:
            chunk, size = [], 0
            for segment in self._sealed:
                if chunk and size + segment.nbytes > self.settings.flush_max_bytes:
                    break
                chunk.append(segment)
                size += segment.nbytes
            batch_seq = chunk[-1].seq
            landed = (
                self.lake.transaction_version(BRONZE_EVENTS, self.gateway_id) or 0 if verify else 0
            )
            pending = [s for s in chunk if s.seq > landed]
            if pending:
                records = [r for s in pending for r in s.records]
                started = time.perf_counter()
                table = to_bronze_table(records, self.gateway_id, batch_seq)
                self.lake.append(
                    BRONZE_EVENTS_SPEC,
                    table,
                    metadata={
                        "gateway_id": self.gateway_id,
                        "batch_seq": batch_seq,
                        "records": len(records),
                    },
                    transaction=(self.gateway_id, batch_seq),
                )
                self.metrics.flush_seconds.observe(time.perf_counter() - started)
                self.metrics.batch_records.observe(len(records))
                self.landed_batches += 1
            for segment in chunk:
                self.wal.retire(segment)
            del self._sealed[: len(chunk)]

    def _load_recent_event_ids(self) -> None:
        """Remember event ids bronze received since yesterday, so retries stay idempotent."""
        if self.settings.dedup_capacity <= 0:
            return
        since = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)
        recent = (
            self.lake.scan(BRONZE_EVENTS)
            .filter(pl.col("ingest_date") >= since)
            .select("event_id", "received_at")
            .sort("received_at")
            .tail(self.settings.dedup_capacity)
            .collect()
        )
        self.index.remember(recent["event_id"].to_list())

    def _update_gauges(self) -> None:
        self.metrics.wal_backlog_records.set(
            self.wal.sealed_backlog_records + self.wal.current_records
        )
        self.metrics.wal_backlog_bytes.set(self.wal.sealed_backlog_bytes + self.wal.current_bytes)

    def backlog(self) -> dict[str, int]:
        """Durable records and bytes not yet in bronze."""
        self._update_gauges()
        return {
            "records": self.wal.sealed_backlog_records + self.wal.current_records,
            "bytes": self.wal.sealed_backlog_bytes + self.wal.current_bytes,
        }
