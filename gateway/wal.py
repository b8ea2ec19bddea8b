"""Write-ahead log: pipelined group commit; a write is acknowledged once fdatasync covers it.

Segments are files `<seq>.open` while written and `<seq>.wal` once sealed; the bronze flusher
(a separate process) lands sealed segments and deletes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from gateway.records import BronzeRecord, decode_frames

log = logging.getLogger(__name__)
OPEN_SUFFIX = ".open"
SEALED_SUFFIX = ".wal"


class WalUnavailable(Exception):
    """The WAL could not make a record durable (disk full, unwritable, closed)."""


@dataclass
class Segment:
    """One WAL file; once sealed, its records land in bronze as batch `seq`."""

    seq: int
    path: Path
    records: int = 0
    nbytes: int = 0
    opened_at: float = field(default_factory=time.monotonic)
    fd: int | None = None


@dataclass(slots=True)
class Write:
    """One request's WAL frames and the future its handler waits on."""

    frames: bytes
    records: int
    future: asyncio.Future[None]


def segment_seq(path: Path) -> int:
    """The sequence number in a segment's file name."""
    return int(path.name.split(".", 1)[0])


def sealed_segments(directory: Path) -> list[Path]:
    """Sealed segment files, oldest first."""
    return sorted(directory.glob(f"*{SEALED_SUFFIX}"), key=segment_seq)


def read_segment(path: Path) -> list[BronzeRecord]:
    """The records of a segment file (a torn tail, never acknowledged, is ignored)."""
    data = path.read_bytes()
    records, valid = decode_frames(data)
    if valid != len(data):
        log.warning("WAL %s: ignoring %d torn bytes at the tail", path, len(data) - valid)
    return records


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def take_lock(path: Path, blocking: bool) -> int | None:
    """An exclusive flock on `path` (None when not blocking and someone else holds it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class WriteAheadLog:
    """Pipelined group commit. The event loop appends each request's frames to the open
    segment at once (page cache); a sync thread runs fdatasync back to back, each covering
    everything written before it began, and then acknowledges those writes on the loop.
    Sealing hands the segment to the sync thread, which syncs it before renaming it `.wal`.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._current: Segment | None = None
        self._next_seq = 0
        self._written = 0  # bytes appended across all segments (a log position)
        self._waiting: deque[tuple[int, Write]] = deque()
        self._retired: list[tuple[int, Segment]] = []  # sealed, not yet synced and renamed
        self._fd_lock = threading.Lock()
        self._dirty = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.on_group = None  # optional callback(records, seconds), on the loop

    # -- lifecycle --------------------------------------------------------------------------
    def lock(self) -> None:
        """Take this WAL directory for this process (a second gateway with the same id fails)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = take_lock(self.directory / "LOCK", blocking=False)
        if self._lock_fd is None:
            raise RuntimeError(
                f"WAL {self.directory} is in use by another gateway process "
                "(give each replica its own CLAW_GATEWAY_ID)"
            )

    def seal_leftovers(self) -> list[Path]:
        """Seal segments a previous process left open; return every sealed segment."""
        for path in self.directory.glob(f"*{OPEN_SUFFIX}"):
            path.rename(path.with_suffix(SEALED_SUFFIX))
        return sealed_segments(self.directory)

    def start(self, next_seq: int) -> None:
        """Open a fresh segment numbered `next_seq` and start the sync thread."""
        self._loop = asyncio.get_running_loop()
        self._next_seq = next_seq
        self._open_segment()
        self._thread = threading.Thread(target=self._sync_loop, name="claw-wal-sync", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Refuse writes, make everything durable, seal the open segment, release the WAL."""
        self._closed = True
        self.seal()
        with self._fd_lock:
            if self._current is not None:  # empty: nothing to keep
                os.close(self._fd)
                self._current.path.unlink(missing_ok=True)
                self._current = self._fd = None
        self._dirty.set()
        if self._thread is not None:
            self._thread.join()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- appends ----------------------------------------------------------------------------
    def submit(self, write: Write) -> None:
        """Append a write now; its future resolves once an fdatasync covers it."""
        if self._closed:
            raise WalUnavailable("the gateway is shutting down")
        try:
            if self._current is None:
                self._open_segment()
            self._append(write.frames)
        except OSError as exc:
            raise WalUnavailable(f"write-ahead log unavailable: {exc.strerror or exc}") from exc
        segment = self._current
        if not segment.records:
            segment.opened_at = time.monotonic()
        segment.records += write.records
        segment.nbytes += len(write.frames)
        self._written += len(write.frames)
        self._waiting.append((self._written, write))
        self._dirty.set()

    @property
    def current(self) -> Segment | None:
        """The open segment."""
        return self._current

    def _append(self, data: bytes) -> None:
        segment = self._current
        try:
            view, written = memoryview(data), 0
            while written < len(data):
                written += os.write(self._fd, view[written:])
        except OSError:
            # Cut partial frames so the next write starts on a clean frame boundary.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, segment.nbytes)
                os.lseek(self._fd, segment.nbytes, os.SEEK_SET)
            raise

    def _sync_loop(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            with self._fd_lock:
                retired, self._retired = self._retired, []
                fd, target = self._fd, self._written
            started = time.perf_counter()
            try:
                for _, segment in retired:
                    os.fdatasync(segment.fd)
                    os.close(segment.fd)
                    segment.path.rename(segment.path.with_suffix(SEALED_SUFFIX))
                    segment.path = segment.path.with_suffix(SEALED_SUFFIX)
                if retired:
                    _fsync_dir(self.directory)
                if fd is not None:
                    os.fdatasync(fd)
            except OSError as exc:
                error = WalUnavailable(f"write-ahead log unavailable: {exc.strerror or exc}")
                self._loop.call_soon_threadsafe(self._fail_waiting, target, error)
            else:
                self._loop.call_soon_threadsafe(
                    self._acknowledge, target, time.perf_counter() - started
                )
            if self._closed and not self._retired and not self._dirty.is_set():
                return

    def _acknowledge(self, target: int, seconds: float) -> None:
        records = 0
        waiting = self._waiting
        while waiting and waiting[0][0] <= target:
            write = waiting.popleft()[1]
            records += write.records
            if not write.future.done():
                write.future.set_result(None)
        if records and self.on_group is not None:
            self.on_group(records, seconds)

    def _fail_waiting(self, target: int, error: WalUnavailable) -> None:
        waiting = self._waiting
        while waiting and waiting[0][0] <= target:
            write = waiting.popleft()[1]
            if not write.future.done():
                write.future.set_exception(error)

    # -- sealing ----------------------------------------------------------------------------
    def seal(self) -> Segment | None:
        """Retire the open segment (if it holds records) and open the next one; the sync
        thread makes the retired one durable and renames it `.wal` for the flusher."""
        with self._fd_lock:
            segment = self._current
            if segment is None or not segment.records:
                return None
            segment.fd = self._fd
            self._retired.append((self._written, segment))
            self._current = self._fd = None
            if not self._closed:
                with contextlib.suppress(OSError):  # retried by the next write
                    self._open_segment()
        self._dirty.set()
        return segment

    def _open_segment(self) -> None:
        seq = self._next_seq
        path = self.directory / f"{seq:020d}{OPEN_SUFFIX}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fd, self._current, self._next_seq = fd, Segment(seq, path), seq + 1
