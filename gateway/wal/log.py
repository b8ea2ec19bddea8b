"""The write-ahead log: pipelined group commit; a write is acknowledged once fdatasync covers it.

Segments are files `<seq>.open` while written and `<seq>.wal` once sealed (gateway.wal.layout);
the bronze flusher (gateway.wal.flusher, a separate process) lands sealed segments and deletes
them. Who runs each fdatasync, and when, is gateway.wal.scheduling's decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gateway.wal.layout import (
    GATEWAY_LOCK,
    OPEN_SUFFIX,
    SEALED_SUFFIX,
    SPARE,
    open_segments,
    sealed_segments,
    segment_path,
    take_lock,
)
from gateway.wal.scheduling import SyncScheduler, WalUnavailable

# callback(records, seconds since their sync was asked, by: "loop" | "syncer")
OnGroup = Callable[[int, float, str], None]


@dataclass
class Segment:
    """One WAL file; once sealed, its records land in bronze as batch `seq`."""

    seq: int
    path: Path
    records: int = 0
    nbytes: int = 0
    opened_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Write:
    """One request's WAL frames and the future its handler waits on."""

    frames: bytes
    records: int
    future: asyncio.Future[None]


class WriteAheadLog:
    """Pipelined group commit. The event loop appends each request's frames to the open
    segment at once (page cache); once per loop iteration one fdatasync covers every write
    made so far (SyncScheduler). Sealing asks the syncer to sync the segment and rename it
    `.wal` for the flusher."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._current: Segment | None = None
        self._next_seq = 0
        self._written = 0  # bytes appended across all segments: the log position
        self._waiting: deque[tuple[int, Write]] = deque()
        self._drained: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._sync = SyncScheduler(self)
        self.on_group: OnGroup | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def lock(self) -> None:
        """Take this WAL directory for this process (a second gateway with the same id fails)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = take_lock(self.directory / GATEWAY_LOCK, blocking=False)
        if self._lock_fd is None:
            raise RuntimeError(
                f"WAL {self.directory} is in use by another gateway process "
                "(give each replica its own CLAW_GATEWAY_ID)"
            )

    def seal_leftovers(self) -> list[Path]:
        """Seal segments a previous process left open; return every sealed segment."""
        for path in open_segments(self.directory):
            path.rename(path.with_suffix(SEALED_SUFFIX))
        return sealed_segments(self.directory)

    def start(self, next_seq: int) -> None:
        """Start the syncer process and open a fresh segment numbered `next_seq`."""
        self._loop = asyncio.get_running_loop()
        self._next_seq = next_seq
        self._sync.start()
        self._open_segment()

    async def close(self) -> None:
        """Refuse writes, make everything durable, seal the open segment, release the WAL."""
        self._closed = True
        self._sync.closing()
        self.seal()
        if self._current is not None:  # empty: nothing to keep
            os.close(self._fd)
            self._current.path.unlink(missing_ok=True)
            self._current = self._fd = None
        if self._waiting or self._sync.in_flight:  # answers still to come (the last seal's too)
            self._drained = self._loop.create_future()
            with contextlib.suppress(WalUnavailable):
                await self._drained
        await self._sync.stop()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- appends ----------------------------------------------------------------------------
    def submit(self, write: Write) -> None:
        """Append a write now; its future resolves once it is durable."""
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
        self._sync.wrote()

    @property
    def current(self) -> Segment | None:
        """The open segment."""
        return self._current

    @property
    def written(self) -> int:
        """Bytes appended across all segments: the log position."""
        return self._written

    @property
    def pending_writes(self) -> int:
        """Writes appended and not yet acknowledged."""
        return len(self._waiting)

    def open_file(self) -> tuple[int, int] | None:
        """The open segment's (seq, fd), if any."""
        return None if self._current is None else (self._current.seq, self._fd)

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

    # -- outcomes (from the scheduler) ------------------------------------------------------
    def durable(self, position: int, seconds: float | None, by: str) -> None:
        """Resolve every write up to `position` (`seconds` since its sync was asked)."""
        records = 0
        waiting = self._waiting
        while waiting and waiting[0][0] <= position:
            write = waiting.popleft()[1]
            records += write.records
            if not write.future.done():
                write.future.set_result(None)
        if records and self.on_group is not None and seconds is not None:
            self.on_group(records, seconds, by)
        self._check_drained(None)

    def failed(self, position: int, error: WalUnavailable) -> None:
        """Fail every write up to `position`."""
        waiting = self._waiting
        while waiting and waiting[0][0] <= position:
            write = waiting.popleft()[1]
            if not write.future.done():
                write.future.set_exception(error)
        self._check_drained(error)

    def _check_drained(self, error: WalUnavailable | None) -> None:
        drained = self._drained
        if drained is None or drained.done() or self._waiting or self._sync.in_flight:
            return
        if error is None:
            drained.set_result(None)
        else:
            drained.set_exception(error)

    # -- sealing ----------------------------------------------------------------------------
    def seal(self) -> Segment | None:
        """Close the open segment (if it holds records), ask the syncer to make it durable
        and hand it to the flusher, and open the next one."""
        segment = self._current
        if segment is None or not segment.records:
            return None
        with contextlib.suppress(OSError):  # readers stop at the zeros anyway
            os.ftruncate(self._fd, segment.nbytes)  # the spare's unused zeros
        os.close(self._fd)
        self._current = self._fd = None
        self._sync.sealed(segment.seq)
        if not self._closed:
            with contextlib.suppress(OSError):  # retried by the next write
                self._open_segment()
        return segment

    def _open_segment(self) -> None:
        seq = self._next_seq
        path = segment_path(self.directory, seq, OPEN_SUFFIX)
        try:  # the spare the syncer filled with zeros: writes then never grow the file
            os.rename(self.directory / SPARE, path)
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fd, self._current, self._next_seq = fd, Segment(seq, path), seq + 1
        self._sync.opened(seq)
