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
import socket
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from gateway.records import BronzeRecord, decode_frames
from gateway.syncer import (
    ANSWER,
    COMMAND,
    OPEN,
    OPEN_SUFFIX,
    SEAL,
    SEALED_SUFFIX,
    SPARE,
    SYNC,
)

log = logging.getLogger(__name__)
MAX_SYNCS_IN_FLIGHT = 64
SYNCER_STOP_TIMEOUT_S = 30.0
INLINE_SYNC_LIMIT_S = 0.005  # an fdatasync slower than this may not hold the event loop...
INLINE_BACKOFF_S = (1.0, 60.0)  # ...so the syncer takes every sync for a while: 1 s, doubling
# while the loop's syncs stay slow (a hiccup costs one slow sync, a slow disk a few)


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
    """The records of a segment file (a torn tail, never acknowledged, is ignored; so are the
    zeros of a spare a crash left unfilled)."""
    data = path.read_bytes()
    records, valid = decode_frames(data)
    if valid != len(data) and data.count(0, valid) != len(data) - valid:
        log.warning("WAL %s: ignoring %d torn bytes at the tail", path, len(data) - valid)
    return records


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
    segment at once (page cache); once per loop iteration, one fdatasync covers every write
    made so far. Sealing asks the syncer to sync the segment and rename it `.wal` for the
    flusher.

    Under load the syncer process (gateway.syncer) runs the fdatasyncs, so that the loop keeps
    serving while the disk works; each answer acknowledges every write made before the request
    it answers. A lone write on an idle log is synced by the loop itself: waking the syncer
    and being woken by its answer cost as much as the fdatasync (~0.3 ms), and nothing else
    waits. The loop does so only into a segment whose name the syncer has made durable, and
    after an fdatasync slower than INLINE_SYNC_LIMIT_S leaves every sync to the syncer for a
    while (INLINE_BACKOFF_S), so a slow disk cannot keep holding the loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._current: Segment | None = None
        self._next_seq = 0
        self._written = 0  # bytes appended across all segments: the log position
        self._requested = 0  # position the syncer was last asked to make durable
        self._named = 0  # one past the newest segment the syncer has made the name of durable
        self._inline_off_until = 0.0
        self._inline_backoff = INLINE_BACKOFF_S[0]
        self._waiting: deque[tuple[int, Write]] = deque()
        self._asked_at: deque[tuple[int, float]] = deque()
        self._sync_scheduled = False
        self._syncer: subprocess.Popen | None = None
        self._channel: socket.socket | None = None
        self._answers = b""
        self._drained: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.on_group = None  # optional callback(records, seconds, by: "loop"|"syncer")

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
        """Start the syncer process and open a fresh segment numbered `next_seq`."""
        self._loop = asyncio.get_running_loop()
        self._next_seq = next_seq
        self._spawn_syncer()
        self._open_segment()

    def _spawn_syncer(self) -> None:
        ours, theirs = socket.socketpair()
        self._syncer = subprocess.Popen(
            [sys.executable, "-m", "gateway.syncer", str(self.directory)],
            stdin=theirs,
            start_new_session=True,  # a terminal's Ctrl-C reaches the gateway only
        )
        theirs.close()
        ours.setblocking(False)
        self._channel = ours
        self._loop.add_reader(ours.fileno(), self._on_answers)

    async def close(self) -> None:
        """Refuse writes, make everything durable, seal the open segment, release the WAL."""
        self._closed = True
        self.seal()
        if self._current is not None:  # empty: nothing to keep
            os.close(self._fd)
            self._current.path.unlink(missing_ok=True)
            self._current = self._fd = None
        if self._waiting or self._asked_at:  # answers still to come (the last seal's too)
            self._drained = self._loop.create_future()
            with contextlib.suppress(WalUnavailable):
                await self._drained
        if self._channel is not None:
            self._loop.remove_reader(self._channel.fileno())
            self._channel.close()
            self._channel = None
        try:
            await asyncio.to_thread(self._syncer.wait, SYNCER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("WAL syncer did not finish; segments left open are sealed on next start")
            self._syncer.kill()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- appends ----------------------------------------------------------------------------
    def submit(self, write: Write) -> None:
        """Append a write now; its future resolves once the syncer has made it durable."""
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
        if not self._sync_scheduled:  # one sync per loop iteration covers its writes
            self._sync_scheduled = True
            self._loop.call_soon(self._sync)

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

    def _sync(self) -> None:
        self._sync_scheduled = False
        if not self._asked_at and self._may_sync_inline():
            self._sync_inline()
        else:
            self._request_sync()

    def _may_sync_inline(self) -> bool:
        """A lone write, into a segment with a durable name, while the disk has been fast."""
        segment = self._current
        return (
            len(self._waiting) == 1
            and segment is not None
            and self._named > segment.seq
            and self._written > self._requested
            and time.monotonic() >= self._inline_off_until
        )

    def _sync_inline(self) -> None:
        position, started = self._written, time.perf_counter()
        try:
            os.fdatasync(self._fd)
        except OSError as exc:
            self._fail(position, WalUnavailable(f"write-ahead log unavailable: {exc}"))
            return
        took = time.perf_counter() - started
        if took > INLINE_SYNC_LIMIT_S:
            self._inline_off_until = time.monotonic() + self._inline_backoff
            log.info(
                "WAL fdatasync took %.1f ms: the syncer process takes every sync for %.0f s",
                took * 1000,
                self._inline_backoff,
            )
            self._inline_backoff = min(self._inline_backoff * 2, INLINE_BACKOFF_S[1])
        else:
            self._inline_backoff = INLINE_BACKOFF_S[0]
        self._requested = position
        self._acknowledge(position, synced_since=started)

    def _request_sync(self) -> None:
        self._sync_scheduled = False
        # A bounded number of requests in flight keeps the socket from ever filling up when
        # the disk stalls; each answer asks again for whatever was written meanwhile.
        if len(self._asked_at) >= MAX_SYNCS_IN_FLIGHT:
            return
        if self._written > self._requested and self._current is not None:
            self._ask(SYNC, self._current.seq)

    def _ask(self, op: int, seq: int) -> None:
        if self._channel is None:  # the syncer died while closing: next start seals leftovers
            return
        self._requested = self._written
        self._asked_at.append((self._written, time.perf_counter()))
        self._send(op, seq, self._written)

    def _send(self, op: int, seq: int, position: int) -> None:
        try:
            self._channel.sendall(COMMAND.pack(op, seq, position))
        except (BlockingIOError, OSError):
            self._syncer_lost()

    def _announce(self, seq: int) -> None:
        """Tell the syncer about a new segment now, so that the fsync of the directory that
        makes its name durable is not on the path of its first write. Claims no position."""
        if self._channel is not None:
            self._send(OPEN, seq, self._requested)

    def _on_answers(self) -> None:
        try:
            data = self._channel.recv(65536)
        except BlockingIOError:
            return
        if not data:
            self._syncer_lost()
            return
        self._answers += data
        usable = len(self._answers) - len(self._answers) % ANSWER.size
        for offset in range(0, usable, ANSWER.size):
            status, position, named = ANSWER.unpack_from(self._answers, offset)
            self._named = max(self._named, named)
            if status == 0:
                self._acknowledge(position)
            else:
                self._fail(
                    position, WalUnavailable("write-ahead log unavailable: fdatasync failed")
                )
        self._answers = self._answers[usable:]
        if self._written > self._requested and not self._sync_scheduled:
            self._sync_scheduled = True
            self._loop.call_soon(self._request_sync)

    def _acknowledge(self, position: int, synced_since: float | None = None) -> None:
        """Resolve every write up to `position` (synced by the loop since `synced_since`, or
        by the syncer when asked)."""
        asked = synced_since
        while self._asked_at and self._asked_at[0][0] <= position:
            asked = self._asked_at.popleft()[1]
        records = 0
        waiting = self._waiting
        while waiting and waiting[0][0] <= position:
            write = waiting.popleft()[1]
            records += write.records
            if not write.future.done():
                write.future.set_result(None)
        if records and self.on_group is not None and asked is not None:
            by = "syncer" if synced_since is None else "loop"
            self.on_group(records, time.perf_counter() - asked, by)
        if self._drained is not None and not (waiting or self._asked_at or self._drained.done()):
            self._drained.set_result(None)

    def _fail(self, position: int, error: WalUnavailable) -> None:
        while self._asked_at and self._asked_at[0][0] <= position:
            self._asked_at.popleft()
        waiting = self._waiting
        while waiting and waiting[0][0] <= position:
            write = waiting.popleft()[1]
            if not write.future.done():
                write.future.set_exception(error)
        if self._drained is not None and not (waiting or self._asked_at or self._drained.done()):
            self._drained.set_exception(error)

    def _syncer_lost(self) -> None:
        """The syncer died: start another and ask again. What waits stays waiting: its bytes
        are in the segments, and the new syncer's fdatasync makes them durable."""
        log.error("WAL syncer exited; restarting it")
        self._loop.remove_reader(self._channel.fileno())
        self._channel.close()
        self._channel = None
        self._asked_at.clear()
        if self._closed:
            self._fail(self._written, WalUnavailable("write-ahead log syncer lost at shutdown"))
            return
        self._spawn_syncer()
        current = self._current.seq if self._current else None
        for path in sorted(self.directory.glob(f"*{OPEN_SUFFIX}"), key=segment_seq):
            if segment_seq(path) != current:
                self._ask(SEAL, segment_seq(path))
        if current is not None and self._waiting:
            self._ask(SYNC, current)

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
        self._ask(SEAL, segment.seq)
        if not self._closed:
            with contextlib.suppress(OSError):  # retried by the next write
                self._open_segment()
        return segment

    def _open_segment(self) -> None:
        seq = self._next_seq
        path = self.directory / f"{seq:020d}{OPEN_SUFFIX}"
        try:  # the spare the syncer filled with zeros: writes then never grow the file
            os.rename(self.directory / SPARE, path)
            fd = os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fd, self._current, self._next_seq = fd, Segment(seq, path), seq + 1
        self._announce(seq)
