"""Where the WAL keeps things: segment file names and suffixes, the spare, locks, status.

A gateway's WAL directory (`ClawSettings.resolved_wal_dir`) holds:

- `<seq>.open`: the segment being written (and segments a crash left open);
- `<seq>.wal`: sealed segments, durable, waiting for the flusher to land them in bronze;
- `spare.zeros` (`spare.filling` while the syncer fills it): a zero-filled file the next
  segment is renamed from;
- `LOCK`: held by the gateway process that owns the WAL; `FLUSHER.LOCK`: by its flusher;
- `flusher-status.json`: the flusher's counters, read by the gateway's /metrics and /readyz.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

OPEN_SUFFIX, SEALED_SUFFIX = ".open", ".wal"
SPARE, SPARE_PARTIAL = "spare.zeros", "spare.filling"
GATEWAY_LOCK, FLUSHER_LOCK = "LOCK", "FLUSHER.LOCK"
STATUS_FILE = "flusher-status.json"


def segment_path(directory: Path, seq: int, suffix: str) -> Path:
    """The file of segment `seq` in the state `suffix` names (OPEN_SUFFIX or SEALED_SUFFIX)."""
    return directory / f"{seq:020d}{suffix}"


def segment_seq(path: Path) -> int:
    """The sequence number in a segment's file name."""
    return int(path.name.split(".", 1)[0])


def sealed_segments(directory: Path) -> list[Path]:
    """Sealed segment files, oldest first."""
    return sorted(directory.glob(f"*{SEALED_SUFFIX}"), key=segment_seq)


def open_segments(directory: Path) -> list[Path]:
    """Segment files not sealed yet (the one being written, or a crash's), oldest first."""
    return sorted(directory.glob(f"*{OPEN_SUFFIX}"), key=segment_seq)


def sealed_sizes(directory: Path) -> list[int]:
    """The sizes of the sealed segments on disk (a segment landed meanwhile is skipped)."""
    sizes = []
    for path in directory.glob(f"*{SEALED_SUFFIX}"):
        with contextlib.suppress(FileNotFoundError):
            sizes.append(path.stat().st_size)
    return sizes


def take_lock(path: Path, blocking: bool) -> int | None:
    """An exclusive flock on `path` (None when not blocking and someone else holds it)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def fsync_dir(directory: Path) -> None:
    """Make the names in `directory` durable (after a create or a rename)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
