"""When and by whom the WAL's writes are made durable: the event loop itself, or the syncer.

Under load the syncer process (gateway.wal.syncer) runs the fdatasyncs, so that the loop keeps
serving while the disk works; each answer acknowledges every write made before the request it
answers. A lone write on an idle log is synced by the loop itself: waking the syncer and being
woken by its answer cost as much as the fdatasync (~0.3 ms), and nothing else waits. The loop
does so only into a segment whose name the syncer has made durable, and after an fdatasync
slower than INLINE_SYNC_LIMIT_S leaves every sync to the syncer for a while
(INLINE_BACKOFF_S), so a slow disk cannot keep holding the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Protocol

from gateway.wal.layout import open_segments, segment_seq
from gateway.wal.syncer import ANSWER, COMMAND, OPEN, SEAL, SYNC

log = logging.getLogger(__name__)
MAX_SYNCS_IN_FLIGHT = 64
SYNCER_STOP_TIMEOUT_S = 30.0
INLINE_SYNC_LIMIT_S = 0.005  # an fdatasync slower than this may not hold the event loop...
INLINE_BACKOFF_S = (1.0, 60.0)  # ...so the syncer takes every sync for a while: 1 s, doubling
# while the loop's syncs stay slow (a hiccup costs one slow sync, a slow disk a few)


class WalUnavailable(Exception):
    """The WAL could not make a record durable (disk full, unwritable, closed)."""


class SyncTarget(Protocol):
    """What the scheduler needs of the log it makes durable (gateway.wal.log.WriteAheadLog)."""

    directory: Path

    @property
    def written(self) -> int:
        """Bytes appended across all segments: the log position."""

    @property
    def pending_writes(self) -> int:
        """Writes appended and not yet acknowledged."""

    def open_file(self) -> tuple[int, int] | None:
        """The open segment's (seq, fd), if any."""

    def durable(self, position: int, seconds: float | None, by: str) -> None:
        """Every write up to `position` is durable (`seconds` since its sync was asked)."""

    def failed(self, position: int, error: WalUnavailable) -> None:
        """Every write up to `position` could not be made durable."""


class SyncScheduler:
    """Makes a log's appends durable: one sync per event-loop iteration covers every write
    made so far, run inline or by the syncer process (see the module docstring)."""

    def __init__(self, target: SyncTarget) -> None:
        self.target = target
        self._requested = 0  # position the syncer was last asked to make durable
        self._named = 0  # one past the newest segment the syncer has made the name of durable
        self._inline_off_until = 0.0
        self._inline_backoff = INLINE_BACKOFF_S[0]
        self._asked_at: deque[tuple[int, float]] = deque()
        self._scheduled = False
        self._syncer: subprocess.Popen | None = None
        self._channel: socket.socket | None = None
        self._answers = b""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    @property
    def in_flight(self) -> bool:
        """Whether the syncer still owes answers."""
        return bool(self._asked_at)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the syncer process (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        self._spawn_syncer()

    def _spawn_syncer(self) -> None:
        ours, theirs = socket.socketpair()
        self._syncer = subprocess.Popen(
            [sys.executable, "-m", "gateway.wal.syncer", str(self.target.directory)],
            stdin=theirs,
            start_new_session=True,  # a terminal's Ctrl-C reaches the gateway only
        )
        theirs.close()
        ours.setblocking(False)
        self._channel = ours
        self._loop.add_reader(ours.fileno(), self._on_answers)

    def closing(self) -> None:
        """The log refuses writes from now on: a syncer lost now fails what waits."""
        self._closing = True

    async def stop(self) -> None:
        """Close the channel (the syncer syncs what it holds and exits) and wait for it."""
        if self._channel is not None:
            self._loop.remove_reader(self._channel.fileno())
            self._channel.close()
            self._channel = None
        if self._syncer is None:
            return
        try:
            await asyncio.to_thread(self._syncer.wait, SYNCER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("WAL syncer did not finish; segments left open are sealed on next start")
            self._syncer.kill()

    # -- requests from the log --------------------------------------------------------------
    def wrote(self) -> None:
        """The log appended a write: sync once this loop iteration is over."""
        if not self._scheduled:  # one sync per loop iteration covers its writes
            self._scheduled = True
            self._loop.call_soon(self._sync)

    def opened(self, seq: int) -> None:
        """Tell the syncer about a new segment now, so that the fsync of the directory that
        makes its name durable is not on the path of its first write. Claims no position."""
        if self._channel is not None:
            self._send(OPEN, seq, self._requested)

    def sealed(self, seq: int) -> None:
        """Ask the syncer to make a closed segment durable and hand it to the flusher."""
        self._ask(SEAL, seq)

    # -- syncing ----------------------------------------------------------------------------
    def _sync(self) -> None:
        self._scheduled = False
        if not self._asked_at and self._may_sync_inline():
            self._sync_inline()
        else:
            self._request_sync()

    def _may_sync_inline(self) -> bool:
        """A lone write, into a segment with a durable name, while the disk has been fast."""
        opened = self.target.open_file()
        return (
            self.target.pending_writes == 1
            and opened is not None
            and self._named > opened[0]
            and self.target.written > self._requested
            and time.monotonic() >= self._inline_off_until
        )

    def _sync_inline(self) -> None:
        position, started = self.target.written, time.perf_counter()
        _seq, fd = self.target.open_file()
        try:
            os.fdatasync(fd)
        except OSError as exc:
            self._failed(position, WalUnavailable(f"write-ahead log unavailable: {exc}"))
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
        self.target.durable(position, time.perf_counter() - started, "loop")

    def _request_sync(self) -> None:
        self._scheduled = False
        # A bounded number of requests in flight keeps the socket from ever filling up when
        # the disk stalls; each answer asks again for whatever was written meanwhile.
        if len(self._asked_at) >= MAX_SYNCS_IN_FLIGHT:
            return
        opened = self.target.open_file()
        if self.target.written > self._requested and opened is not None:
            self._ask(SYNC, opened[0])

    def _ask(self, op: int, seq: int) -> None:
        if self._channel is None:  # the syncer died while closing: next start seals leftovers
            return
        written = self.target.written
        self._requested = written
        self._asked_at.append((written, time.perf_counter()))
        self._send(op, seq, written)

    def _send(self, op: int, seq: int, position: int) -> None:
        try:
            self._channel.sendall(COMMAND.pack(op, seq, position))
        except (BlockingIOError, OSError):
            self._syncer_lost()

    # -- answers ----------------------------------------------------------------------------
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
                self._durable(position)
            else:
                self._failed(
                    position, WalUnavailable("write-ahead log unavailable: fdatasync failed")
                )
        self._answers = self._answers[usable:]
        if self.target.written > self._requested and not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._request_sync)

    def _answered(self, position: int) -> float | None:
        """Forget the requests an answer up to `position` covers; when the oldest was asked."""
        asked = None
        while self._asked_at and self._asked_at[0][0] <= position:
            asked = self._asked_at.popleft()[1]
        return asked

    def _durable(self, position: int) -> None:
        asked = self._answered(position)
        seconds = None if asked is None else time.perf_counter() - asked
        self.target.durable(position, seconds, "syncer")

    def _failed(self, position: int, error: WalUnavailable) -> None:
        self._answered(position)
        self.target.failed(position, error)

    def _syncer_lost(self) -> None:
        """The syncer died: start another and ask again. What waits stays waiting: its bytes
        are in the segments, and the new syncer's fdatasync makes them durable."""
        log.error("WAL syncer exited; restarting it")
        self._loop.remove_reader(self._channel.fileno())
        self._channel.close()
        self._channel = None
        self._asked_at.clear()
        if self._closing:
            self.target.failed(
                self.target.written, WalUnavailable("write-ahead log syncer lost at shutdown")
            )
            return
        self._spawn_syncer()
        opened = self.target.open_file()
        current = opened[0] if opened else None
        for path in open_segments(self.target.directory):
            if segment_seq(path) != current:
                self._ask(SEAL, segment_seq(path))
        if current is not None and self.target.pending_writes:
            self._ask(SYNC, current)
