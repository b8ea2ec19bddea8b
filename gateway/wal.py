"""Write-ahead log: a writer thread group-commits (one fsync per group) before any ack."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.records import BronzeRecord, decode_frames

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


@dataclass(slots=True)
class Write:
    """One request's records, their WAL frames, and who to tell when durable."""

    records: list[BronzeRecord]
    frames: bytes
    token: Any = None


GroupDone = Callable[[list[Write], BaseException | None, float], None]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteAheadLog:
    """Segmented append-only log. `submit` queues a write; the writer thread takes every
    queued write at once, writes them durably together, then calls `on_group_done`."""

    def __init__(self, directory: Path, on_group_done: GroupDone) -> None:
        self.directory = directory
        self.on_group_done = on_group_done
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._current: Segment | None = None
        self._next_seq = 0
        self._queue: list[Write] = []
        self._wakeup = threading.Condition()
        self._io_lock = threading.Lock()  # the open segment: writer vs sealer
        self._thread: threading.Thread | None = None
        self._closed = False
        self.sealed_backlog_bytes = 0
        self.sealed_backlog_records = 0

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
        """Open a fresh segment numbered `next_seq` and start the writer thread."""
        self._next_seq = next_seq
        self._open_segment()
        self._thread = threading.Thread(target=self._run, name="claw-wal-writer", daemon=True)
        self._thread.start()

    def close(self) -> Segment | None:
        """Stop accepting, write what is queued, and return the last segment sealed."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
        segment = self.seal()
        with self._io_lock:
            if self._current is not None:  # empty: nothing to keep
                os.close(self._fd)
                self._current.path.unlink(missing_ok=True)
                self._current = self._fd = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        return segment

    # -- appends ----------------------------------------------------------------------------
    def submit(self, write: Write) -> None:
        """Queue a write (thread-safe); `on_group_done` reports its fate."""
        with self._wakeup:
            if self._closed:
                raise WalUnavailable("the gateway is shutting down")
            self._queue.append(write)
            self._wakeup.notify()

    @property
    def current_records(self) -> int:
        """Records in the open segment (durable, not yet sealed into a batch)."""
        segment = self._current
        return len(segment.records) if segment else 0

    @property
    def current_bytes(self) -> int:
        """Bytes in the open segment."""
        segment = self._current
        return segment.nbytes if segment else 0

    @property
    def current_age(self) -> float:
        """Seconds since the open segment got its first record."""
        segment = self._current
        if not segment or not segment.records:
            return 0.0
        return time.monotonic() - segment.opened_at

    def _run(self) -> None:
        while True:
            with self._wakeup:
                while not self._queue and not self._closed:
                    self._wakeup.wait()
                group, self._queue = self._queue, []
                if not group and self._closed:
                    return
            self._commit(group)

    def _commit(self, group: list[Write]) -> None:
        data = b"".join(write.frames for write in group)
        started = time.perf_counter()
        error: BaseException | None = None
        with self._io_lock:
            try:
                if self._current is None:
                    self._open_segment()
                self._write_and_sync(data)
            except OSError as exc:
                error = WalUnavailable(f"write-ahead log unavailable: {exc.strerror or exc}")
            else:
                segment = self._current
                if not segment.records:
                    segment.opened_at = time.monotonic()
                for write in group:
                    segment.records.extend(write.records)
                segment.nbytes += len(data)
        self.on_group_done(group, error, time.perf_counter() - started)

    def _write_and_sync(self, data: bytes) -> None:
        # O_DSYNC: each write returns once its data is on stable storage, so a group costs
        # one syscall (and one release of the GIL) instead of a write plus an fdatasync.
        segment = self._current
        try:
            view, written = memoryview(data), 0
            while written < len(data):
                written += os.write(self._fd, view[written:])
        except OSError:
            # Cut the partial frames so the next group starts on a clean frame boundary.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, segment.nbytes)
                os.lseek(self._fd, segment.nbytes, os.SEEK_SET)
            raise

    # -- sealing ----------------------------------------------------------------------------
    def seal(self) -> Segment | None:
        """Close the open segment (if it holds records) and start the next one."""
        with self._io_lock:
            segment = self._current
            if segment is None or not segment.records:
                return None
            os.close(self._fd)
            self._current = self._fd = None
            self.sealed_backlog_bytes += segment.nbytes
            self.sealed_backlog_records += len(segment.records)
            if not self._closed:
                with contextlib.suppress(OSError):  # retried by the next write
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
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DSYNC, 0o644)
        try:
            _fsync_dir(self.directory)
        except OSError:
            os.close(fd)
            raise
        self._fd, self._current, self._next_seq = fd, Segment(seq, path), seq + 1
