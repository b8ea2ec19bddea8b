"""Landing: records become durable in the WAL, then land in `bronze/events` in micro-batches."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import time

import polars as pl

from claw_pipelines.contracts.tables import BRONZE_EVENTS, BRONZE_EVENTS_SPEC
from claw_pipelines.lake import Lake
from claw_pipelines.settings import ClawSettings
from gateway.idempotency import IdempotencyIndex
from gateway.metrics import GatewayMetrics
from gateway.records import BronzeRecord, encode_frame, to_bronze_table
from gateway.wal import Segment, WalUnavailable, Write, WriteAheadLog

log = logging.getLogger(__name__)
MAX_RETRY_DELAY = 5.0


class Overloaded(Exception):
    """The gateway cannot take more right now; the client should retry after a pause."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Landing:
    """The durable path of every record: idempotency, WAL group commit, bronze micro-batches.

    Threads: the event loop admits requests; the WAL writer thread fsyncs groups; the flusher
    thread seals WAL segments and commits them to `bronze/events`.
    """

    def __init__(self, settings: ClawSettings, lake: Lake, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.lake = lake
        self.metrics = metrics
        self.gateway_id = settings.gateway_id
        self.wal = WriteAheadLog(settings.resolved_wal_dir, self._group_done)
        self.index = IdempotencyIndex(settings.dedup_capacity)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sealed: list[Segment] = []
        self._kick = threading.Event()
        self._flusher: threading.Thread | None = None
        self._stopping = False
        self.ready = False
        self.last_flush_error: str | None = None
        self.landed_batches = 0

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the WAL, land what a previous process left in it, then accept records."""
        self._loop = asyncio.get_running_loop()
        next_seq = await asyncio.to_thread(self._recover)
        self.wal.start(next_seq)
        self._flusher = threading.Thread(
            target=self._flush_loop, name="claw-bronze-flusher", daemon=True
        )
        self._flusher.start()
        self.ready = True
        self._update_gauges()

    def _recover(self) -> int:
        self.wal.lock()
        self.lake.ensure(BRONZE_EVENTS_SPEC)
        leftovers = self.wal.recover()
        landed_seq = self.lake.transaction_version(BRONZE_EVENTS, self.gateway_id) or 0
        self._load_recent_event_ids()
        for segment in leftovers:
            self.index.remember(r.event_id for r in segment.records)
            self.wal.sealed_backlog_bytes += segment.nbytes
            self.wal.sealed_backlog_records += len(segment.records)
            self.metrics.replayed_records.inc(len(segment.records))
        self._sealed.extend(leftovers)
        if leftovers:
            log.info("replaying %d WAL segments", len(leftovers))
            self._land_sealed_blocking(verify=True)
        return max([landed_seq, *(s.seq for s in leftovers)]) + 1

    async def stop(self) -> None:
        """Graceful shutdown: refuse new records, land everything durable, release the WAL."""
        self.ready = False
        await asyncio.to_thread(self._stop_blocking)

    def _stop_blocking(self) -> None:
        last = self.wal.close()
        self._stopping = True
        self._kick.set()
        if self._flusher is not None:
            self._flusher.join()
        if last is not None:
            self._sealed.append(last)
        if self._sealed:
            try:
                self._land_sealed_blocking(verify=True)
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
        fresh_positions, waits = self.index.claim([r.event_id for r in records])
        fresh = [records[i] for i in fresh_positions]
        if fresh:
            future = self._loop.create_future()
            fresh_ids = [r.event_id for r in fresh]
            self.index.begin(fresh_ids, future)
            try:
                self.wal.submit(Write(fresh, b"".join(encode_frame(r) for r in fresh), future))
            except WalUnavailable as exc:
                self.index.finish(fresh_ids, ok=False)
                raise Overloaded(str(exc), retry_after=1) from exc
            waits.append(future)
        for waited in waits:
            try:
                # shielded: a cancelled request never cancels a write others may wait on
                await asyncio.shield(waited)
            except WalUnavailable as exc:
                raise Overloaded(str(exc), retry_after=5) from exc
        duplicates = len(records) - len(fresh)
        if duplicates:
            self.metrics.duplicates.inc(duplicates)
        return len(fresh), duplicates

    def _group_done(self, group: list[Write], error: BaseException | None, seconds: float):
        """WAL writer thread: a group is durable (or failed); finish it on the loop."""
        if error is None:
            self.metrics.wal_sync_seconds.observe(seconds)
            self.metrics.wal_group_records.observe(sum(len(w.records) for w in group))
            s = self.settings
            if (
                self.wal.current_records >= s.flush_max_records
                or self.wal.current_bytes >= s.flush_max_bytes
            ):
                self._kick.set()
        else:
            self.metrics.rejected.labels("wal").inc()
        self._loop.call_soon_threadsafe(self._finish_group, group, error)

    def _finish_group(self, group: list[Write], error: BaseException | None) -> None:
        kinds: dict[str, int] = {}
        for write in group:
            self.index.finish([r.event_id for r in write.records], ok=error is None)
            future: asyncio.Future[None] = write.token
            if future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
            for record in write.records:
                kinds[record.kind] = kinds.get(record.kind, 0) + 1
        for kind, count in kinds.items():
            self.metrics.records.labels(kind).inc(count)

    # -- the flush path ---------------------------------------------------------------------
    def _flush_loop(self) -> None:
        interval = self.settings.flush_interval_ms / 1000
        delay = 0.0
        while not self._stopping:
            self._kick.wait(delay or max(0.002, interval - self.wal.current_age))
            self._kick.clear()
            if self._stopping:
                return
            full = self.wal.current_records >= self.settings.flush_max_records
            if full or self.wal.current_age >= interval:
                segment = self.wal.seal()
                if segment is not None:
                    self._sealed.append(segment)
            if not self._sealed:
                continue
            try:
                self._land_sealed_blocking(verify=delay > 0)
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
