"""The bronze flusher: a process beside the gateway that lands sealed WAL segments in Delta.

It runs apart from the gateway so that Parquet encoding and object-store latency never take
the gateway's GIL. Each commit carries a delta-rs transaction (`app_id` = gateway id,
`version` = the newest segment's sequence), so a replay after any crash lands nothing twice.
Run by the gateway as `python -m gateway.wal.flusher` with a pipe on stdin; it exits once that
pipe closes (graceful stop or a killed gateway) and every sealed segment has landed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import sys
import time
from pathlib import Path

from claw_pipelines.contracts.tables import BRONZE_EVENTS, BRONZE_EVENTS_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import published_version
from claw_pipelines.settings import ClawSettings
from gateway.records import bronze_table
from gateway.wal.frames import read_segments
from gateway.wal.layout import (
    FLUSHER_LOCK,
    STATUS_FILE,
    sealed_segments,
    segment_seq,
    take_lock,
)

log = logging.getLogger("claw.flusher")
MAX_RETRY_DELAY = 5.0
STATUS_HEARTBEAT_S = 5.0  # the status file is rewritten at least this often
POLICY_REFRESH_S = 1.0  # how often the published policy version is read from the lake


class BronzeFlusher:
    """Lands sealed segments oldest first, in commits bounded by `flush_max_bytes`."""

    def __init__(self, settings: ClawSettings) -> None:
        self.settings = settings
        self.directory = settings.resolved_wal_dir
        self.lake = Lake.from_settings(settings)
        self.gateway_id = settings.gateway_id
        self.status = {
            "commits": 0,
            "records": 0,
            "flush_seconds_total": 0.0,
            "last_flush_seconds": 0.0,
            "last_batch_records": 0,
            "failures": 0,
            "last_error": None,
            "pid": os.getpid(),
            "policy_version": None,
        }
        self._policy_read_at = 0.0
        self._landed_seq: int | None = None
        self._published: tuple[dict, float] = ({}, 0.0)  # status last written, and when

    def land_pending(self) -> int:
        """Land every sealed segment now on disk; return how many records landed."""
        landed = 0
        while segments := sealed_segments(self.directory):
            chunk, size = [], 0
            for path in segments:
                nbytes = path.stat().st_size
                if chunk and size + nbytes > self.settings.flush_max_bytes:
                    break
                chunk.append(path)
                size += nbytes
            landed += self._land(chunk)
        return landed

    def _land(self, paths: list[Path]) -> int:
        batch_seq = segment_seq(paths[-1])
        if self._landed_seq is None:  # first commit of this process: ask the table
            self._landed_seq = self.lake.transaction_version(BRONZE_EVENTS, self.gateway_id) or 0
        pending = [p for p in paths if segment_seq(p) > self._landed_seq]
        records = read_segments(pending)
        if len(records):
            started = time.perf_counter()
            try:
                self.lake.append(
                    BRONZE_EVENTS_SPEC,
                    bronze_table(records, self.gateway_id, batch_seq),
                    metadata={
                        "gateway_id": self.gateway_id,
                        "batch_seq": batch_seq,
                        "records": len(records),
                    },
                    transaction=(self.gateway_id, batch_seq),
                )
            except Exception:
                self._landed_seq = None  # the commit may have landed: verify on retry
                raise
            seconds = time.perf_counter() - started
            self.status["commits"] += 1
            self.status["commit_conflicts"] = self.lake.commit_conflicts.get(BRONZE_EVENTS, 0)
            self.status["records"] += len(records)
            self.status["flush_seconds_total"] += seconds
            self.status["last_flush_seconds"] = seconds
            self.status["last_batch_records"] = len(records)
        self._landed_seq = max(self._landed_seq, batch_seq)
        for path in paths:
            path.unlink(missing_ok=True)
        return len(records)

    def refresh_policy(self) -> None:
        """Read the newest published policy version (at most every POLICY_REFRESH_S) into the
        status: the gateway stamps it on steps that name none."""
        now = time.monotonic()
        if now - self._policy_read_at < POLICY_REFRESH_S:
            return
        self._policy_read_at = now
        try:
            self.status["policy_version"] = published_version(self.lake)
        except Exception as exc:  # the lake is unreachable: keep the version known
            log.warning("could not read the published policy version: %s", exc)

    def write_status(self) -> None:
        """Publish counters for the gateway's /metrics (atomic replace) when they changed, or
        as a heartbeat: a rename per poll would cost more than an idle flusher does."""
        published, at = self._published
        now = time.monotonic()
        if self.status == published and now - at < STATUS_HEARTBEAT_S:
            return
        self._published = (dict(self.status), now)
        tmp = self.directory / (STATUS_FILE + ".tmp")
        tmp.write_text(json.dumps(self.status | {"updated_at": time.time()}))
        tmp.replace(self.directory / STATUS_FILE)

    def run(self, control: int) -> None:
        """Land sealed segments until `control` (the gateway's pipe) reaches EOF, then drain.

        EOF comes from a graceful stop (after the last segment is sealed) and equally from a
        gateway killed with SIGKILL, whose pipe end the kernel closes.
        """
        lock = take_lock(self.directory / FLUSHER_LOCK, blocking=True)  # one flusher per WAL
        self.lake.ensure(BRONZE_EVENTS_SPEC)
        poll = min(0.05, self.settings.flush_interval_ms / 4000)
        stopping, delay = False, 0.0
        try:
            while True:
                try:
                    self.land_pending()
                    delay = 0.0
                    self.status["last_error"] = None
                except Exception as exc:
                    self.status["failures"] += 1
                    self.status["last_error"] = f"{type(exc).__name__}: {exc}"
                    delay = min(MAX_RETRY_DELAY, max(0.1, delay * 2))
                    log.warning("bronze commit failed (retrying in %.1fs): %s", delay, exc)
                self.refresh_policy()
                self.write_status()
                if stopping and not delay:
                    return
                if stopping:  # a pipe at EOF is always readable: select would not wait
                    time.sleep(delay)
                    continue
                readable, _, _ = select.select([control], [], [], delay or poll)
                if readable and not os.read(control, 4096):
                    stopping = True
        finally:
            os.close(lock)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the flusher process."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s flusher %(levelname)s %(message)s")
    BronzeFlusher(ClawSettings()).run(control=sys.stdin.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
