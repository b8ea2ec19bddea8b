"""Landing: records become durable in the WAL before the ack; a flusher process lands them."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import subprocess
import sys
import time

import polars as pl

from claw_pipelines.contracts.tables import BRONZE_EVENTS, BRONZE_EVENTS_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.settings import ClawSettings
from gateway.idempotency import IdempotencyIndex
from gateway.metrics import GatewayMetrics, labelled
from gateway.numbering import RecordedSteps, proxied_steps, wal_steps
from gateway.records import BronzeRecord
from gateway.redaction import redact_payload
from gateway.wal.frames import encode_frame, read_segment
from gateway.wal.layout import FLUSHER_LOCK, STATUS_FILE, sealed_sizes, segment_seq, take_lock
from gateway.wal.log import Write, WriteAheadLog
from gateway.wal.scheduling import WalUnavailable

log = logging.getLogger(__name__)
FLUSHER_STOP_TIMEOUT_S = 60.0
FLUSHER_RESTART_BACKOFF_S = 5.0


class Overloaded(Exception):
    """The gateway cannot take more right now; the client should retry after a pause."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Landing:
    """The durable path of every record: idempotency, WAL group commit, sealing for bronze.

    The event loop admits requests and commits WAL groups; every `flush_interval_ms` it seals
    the open segment; the flusher process (gateway.wal.flusher) lands sealed segments in
    `bronze/events`, so Parquet encoding and lake latency never hold this process's GIL.

    `recorded`: filled at start with the step indices of the proxied trajectories the WAL and
    bronze hold (gateway.numbering), so the proxy's numbering resumes after them.
    """

    def __init__(
        self,
        settings: ClawSettings,
        lake: Lake,
        metrics: GatewayMetrics,
        recorded: RecordedSteps | None = None,
    ) -> None:
        self.settings = settings
        self.recorded = recorded
        self.lake = lake
        self.metrics = metrics
        self.gateway_id = settings.gateway_id
        self.wal = WriteAheadLog(settings.resolved_wal_dir)
        self.wal.on_group = self._after_group
        self.index = IdempotencyIndex(settings.dedup_capacity)
        self.flusher: subprocess.Popen | None = None
        self._sealer: asyncio.Task[None] | None = None
        self._sealed_bytes = 0
        self._flusher_restart_at = 0.0
        self.ready = False
        self.policy_version: int | None = None  # the newest published (the flusher reads it)

    # -- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Take the WAL, start the flusher (it lands what a crash left), accept records."""
        next_seq = await asyncio.to_thread(self._recover)
        self.wal.start(next_seq)
        self._spawn_flusher()
        self.backlog()
        self._sealer = asyncio.get_running_loop().create_task(self._seal_periodically())
        self.ready = True

    def _recover(self) -> int:
        self.wal.lock()
        self.lake.ensure(BRONZE_EVENTS_SPEC)
        # A flusher left by a killed gateway drains the WAL and exits; wait for it, so that
        # every event id is either in bronze or in a segment when we read them below.
        flusher_lock = take_lock(self.wal.directory / FLUSHER_LOCK, blocking=True)
        try:
            leftovers = self.wal.seal_leftovers()
            self._load_recent_event_ids()
            recent = [] if self.recorded is None else [self._recorded_steps()]
            for path in leftovers:
                records = read_segment(path)
                self.index.remember(r.event_id for r in records)
                self.metrics.replayed_records.inc(len(records))
                if self.recorded is not None:
                    recent.append(wal_steps(records))
            if self.recorded is not None:
                self.recorded.add(pl.concat(recent))
            landed = self.lake.transaction_version(BRONZE_EVENTS, self.gateway_id) or 0
        finally:
            os.close(flusher_lock)
        return max([landed, *(segment_seq(p) for p in leftovers)]) + 1

    def _spawn_flusher(self) -> None:
        # Its own session: a Ctrl-C in the terminal stops the gateway, which then closes the
        # flusher's stdin; the flusher drains the WAL and exits.
        self.flusher = subprocess.Popen(
            [sys.executable, "-m", "gateway.wal.flusher"],
            stdin=subprocess.PIPE,
            env={**os.environ, **self.settings.to_env()},
            start_new_session=True,
        )

    async def stop(self) -> None:
        """Graceful shutdown: refuse new records, seal the WAL, let the flusher land it all."""
        self.ready = False
        if self._sealer is not None:
            self._sealer.cancel()
        await self.wal.close()
        if self.flusher is not None and self.flusher.poll() is None:
            self.flusher.stdin.close()
            try:
                await asyncio.to_thread(self.flusher.wait, FLUSHER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.error("flusher did not finish; what it left replays on next start")
                self.flusher.kill()

    async def _seal_periodically(self) -> None:
        """Seal the open segment once it is `flush_interval_ms` old; watch the flusher."""
        interval = self.settings.flush_interval_ms / 1000
        while True:
            segment = self.wal.current
            age = time.monotonic() - segment.opened_at if segment and segment.records else 0.0
            await asyncio.sleep(max(0.002, interval - age))
            segment = self.wal.current
            if segment and segment.records and time.monotonic() - segment.opened_at >= interval:
                self.wal.seal()
            self.backlog()
            self.policy_version = self._read_status().get("policy_version", self.policy_version)
            exited = self.flusher is not None and self.flusher.poll() is not None
            if exited and time.monotonic() >= self._flusher_restart_at:
                log.error("bronze flusher exited (%s); restarting it", self.flusher.returncode)
                self._flusher_restart_at = time.monotonic() + FLUSHER_RESTART_BACKOFF_S
                self._spawn_flusher()

    # -- the ack path -----------------------------------------------------------------------
    async def land(self, records: list[BronzeRecord]) -> tuple[int, int]:
        """Make records durable; return (written, duplicates). Raises Overloaded."""
        if not self.ready:
            raise Overloaded("the gateway is starting or stopping", retry_after=1)
        segment = self.wal.current
        backlog = self._sealed_bytes + (segment.nbytes if segment else 0)
        if backlog > self.settings.wal_max_backlog_bytes:
            raise Overloaded(
                f"write-ahead log backlog is {backlog} bytes, over its bound; retry shortly",
                retry_after=2,
            )
        fresh_positions, waits = self.index.claim([r.event_id for r in records])
        fresh = [records[i] for i in fresh_positions]
        if self.settings.redact_secrets:
            for record in fresh:
                record.payload = redact_payload(record.payload)
        if fresh:
            future = asyncio.get_running_loop().create_future()
            self.index.begin([r.event_id for r in fresh], future)
            frames = b"".join(encode_frame(r) for r in fresh)
            try:
                self.wal.submit(Write(frames, len(fresh), future))
            except WalUnavailable as exc:
                self.index.finish([r.event_id for r in fresh], ok=False)
                raise Overloaded(str(exc), retry_after=1) from exc
            future.add_done_callback(lambda done, batch=fresh: self._finished(batch, done))
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

    def _finished(self, fresh: list[BronzeRecord], future: asyncio.Future[None]) -> None:
        ok = not future.cancelled() and future.exception() is None
        self.index.finish([r.event_id for r in fresh], ok=ok)
        if not ok:
            return
        for record in fresh:
            labelled(self.metrics.records, record.kind).inc()

    def _after_group(self, records: int, seconds: float, by: str) -> None:
        labelled(self.metrics.wal_syncs, by).inc()
        self.metrics.wal_sync_seconds.observe(seconds)
        self.metrics.wal_group_records.observe(records)
        segment = self.wal.current
        s = self.settings
        if segment is not None and (
            segment.records >= s.flush_max_records or segment.nbytes >= s.flush_max_bytes
        ):
            self._sealed_bytes += segment.nbytes
            self.wal.seal()

    # -- state ------------------------------------------------------------------------------
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

    def _recorded_steps(self) -> pl.DataFrame:
        """The newest step index of each proxied trajectory bronze received since yesterday:
        a query of its own, reduced to a row a trajectory as it is read (collected in the
        event ids' scan, its columns held ~100 bytes a record at the peak)."""
        since = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)
        return proxied_steps(
            self.lake.scan(BRONZE_EVENTS).filter(pl.col("ingest_date") >= since)
        ).collect()

    def backlog(self) -> dict[str, int]:
        """Durable bytes not yet in bronze: sealed segments on disk plus the open one."""
        sizes = sealed_sizes(self.settings.resolved_wal_dir)
        self._sealed_bytes = sum(sizes)
        segment = self.wal.current
        open_bytes = segment.nbytes if segment else 0
        self.metrics.wal_backlog_bytes.set(self._sealed_bytes + open_bytes)
        self.metrics.wal_sealed_segments.set(len(sizes))
        self.metrics.wal_open_records.set(segment.records if segment else 0)
        return {
            "bytes": self._sealed_bytes + open_bytes,
            "sealed_segments": len(sizes),
            "open_records": segment.records if segment else 0,
        }

    def _read_status(self) -> dict:
        """The flusher's status file (empty before it wrote one)."""
        try:
            return json.loads((self.settings.resolved_wal_dir / STATUS_FILE).read_text())
        except (OSError, ValueError):
            return {}

    def flusher_status(self) -> dict:
        """What the flusher process last reported (commits, latency, errors), and liveness."""
        status = self._read_status()
        status["alive"] = self.flusher is not None and self.flusher.poll() is None
        self.metrics.record_flusher(status)
        return status
