"""Write-ahead log: group commit with fsync before the ack, segments sealed into batches."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from gateway.records import BronzeRecord, decode_frames, encode_frame

log = logging.getLogger(__name__)
SEGMENT_SUFFIX = ".wal"


class WalUnavailable(Exception):
    """The WAL could not make a record durable (disk full, unwritable, closed)."""


@dataclass
class Segment:
    """One WAL file; once sealed, its records land in bronze as batch `seq`."""

    seq: int
    path: Path
    records: list[BronzeRecord] = field(default_factory=list)
    nbytes: int = 0
    opened_at: float = field(default_factory=time.monotonic)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteAheadLog:
    """Appends records durably; one fsync covers every request waiting at that moment."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._current: Segment | None = None
        self._pending: list[tuple[bytes, list[BronzeRecord], asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._io_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._next_seq = 0
        self.sealed_backlog_bytes = 0
        self.sealed_backlog_records = 0
        self.last_sync_seconds = 0.0
        self.last_group_records = 0
        self.on_group = None  # optional callback(records, seconds) for metrics

    # -- lifecycle --------------------------------------------------------------------------
    def lock(self) -> None:
        """Take this WAL directory for this process (a second gateway with the same id fails)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"WAL {self.directory} is in use by another gateway process "
                "(give each replica its own CLAW_GATEWAY_ID)"
            ) from None
        self._lock_fd = fd

    def recover(self) -> list[Segment]:
        """Segments left on disk by a previous process, oldest first, with their records."""
        segments = []
        for path in sorted(self.directory.glob(f"*{SEGMENT_SUFFIX}")):
            data = path.read_bytes()
            records, valid = decode_frames(data)
            if valid != len(data):
                log.warning("WAL %s: ignoring %d torn bytes at the tail", path, len(data) - valid)
            segments.append(Segment(int(path.stem), path, records, valid))
        return segments

    def start(self, next_seq: int) -> None:
        """Open a fresh segment numbered `next_seq` and start the group-commit task."""
        self._next_seq = next_seq
        self._open_segment()
        self._task = asyncio.get_running_loop().create_task(self._commit_loop())

    async def close(self) -> Segment | None:
        """Stop accepting, finish pending groups, and return the last segment (sealed)."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task
        segment = await self.seal()
        if self._current is not None:  # empty: nothing to keep
            os.close(self._fd)
            self._current.path.unlink(missing_ok=True)
            self._current = self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        return segment

    # -- appends ----------------------------------------------------------------------------
    async def append(self, records: list[BronzeRecord]) -> None:
        """Return once `records` are on disk (fsync'ed); raise WalUnavailable otherwise."""
        if self._closed:
            raise WalUnavailable("the gateway is shutting down")
        frames = b"".join(encode_frame(r) for r in records)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((frames, records, future))
        self._wake.set()
        await future

    @property
    def current_records(self) -> int:
        """Records in the open segment (durable, not yet sealed into a batch)."""
        return len(self._current.records) if self._current else 0

    @property
    def current_bytes(self) -> int:
        """Bytes in the open segment."""
        return self._current.nbytes if self._current else 0

    @property
    def current_age(self) -> float:
        """Seconds since the open segment got its first record."""
        if not self._current or not self._current.records:
            return 0.0
        return time.monotonic() - self._current.opened_at

    async def _commit_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                group, self._pending = self._pending, []
                await self._commit_group(group)
            if self._closed and not self._pending:
                return

    async def _commit_group(self, group) -> None:
        data = b"".join(frames for frames, _, _ in group)
        async with self._io_lock:
            started = time.perf_counter()
            try:
                if self._current is None:
                    self._open_segment()
                segment = self._current
                await asyncio.to_thread(self._write_and_sync, data)
            except OSError as exc:
                error = WalUnavailable(f"write-ahead log unavailable: {exc.strerror or exc}")
                for _, _, future in group:
                    if not future.done():
                        future.set_exception(error)
                return
            self.last_sync_seconds = time.perf_counter() - started
            records = [r for _, batch, _ in group for r in batch]
            if not segment.records:
                segment.opened_at = time.monotonic()
            segment.records.extend(records)
            segment.nbytes += len(data)
            self.last_group_records = len(records)
        if self.on_group is not None:
            self.on_group(len(records), self.last_sync_seconds)
        for _, _, future in group:
            if not future.done():
                future.set_result(None)

    def _write_and_sync(self, data: bytes) -> None:
        segment = self._current
        try:
            written = 0
            while written < len(data):
                written += os.write(self._fd, data[written:] if written else data)
            os.fdatasync(self._fd)
        except OSError:
            # Cut the partial frames so the next group starts on a clean frame boundary.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, segment.nbytes)
                os.lseek(self._fd, segment.nbytes, os.SEEK_SET)
            raise

    # -- sealing ----------------------------------------------------------------------------
    async def seal(self) -> Segment | None:
        """Close the open segment (if it holds records) and start the next one."""
        async with self._io_lock:
            segment = self._current
            if segment is None or not segment.records:
                return None
            os.close(self._fd)
            self._current = self._fd = None
            self.sealed_backlog_bytes += segment.nbytes
            self.sealed_backlog_records += len(segment.records)
            if not self._closed:
                with contextlib.suppress(OSError):  # retried by the next append
                    self._open_segment()
            return segment

    def retire(self, segment: Segment) -> None:
        """Delete a segment whose batch is in bronze."""
        segment.path.unlink(missing_ok=True)
        self.sealed_backlog_bytes -= segment.nbytes
        self.sealed_backlog_records -= len(segment.records)

    def _open_segment(self) -> None:
        seq = self._next_seq
        path = self.directory / f"{seq:020d}{SEGMENT_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _fsync_dir(self.directory)
        except OSError:
            os.close(fd)
            raise
        self._fd, self._current, self._next_seq = fd, Segment(seq, path), seq + 1
