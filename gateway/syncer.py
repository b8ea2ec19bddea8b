"""The WAL syncer: a tiny process that makes the gateway's WAL segments durable.

The gateway appends frames to a segment (page cache) and sends `SYNC seq position` over a
socket; the syncer runs fdatasync on that segment and answers `position`. `SEAL seq position`
also renames the synced segment `.wal` for the flusher. Being a separate process, its wait on
the disk never contends for the gateway's GIL; the gateway's event loop reads the answers like
any other socket. Commands are coalesced: one fdatasync answers every SYNC read at once.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from pathlib import Path

COMMAND = struct.Struct("<BQQ")  # op, segment seq, log position
ANSWER = struct.Struct("<BQ")  # status (0 ok, 1 failed), log position
SYNC, SEAL = 1, 2
OPEN_SUFFIX, SEALED_SUFFIX = ".open", ".wal"


def _segment(directory: Path, seq: int, suffix: str) -> Path:
    return directory / f"{seq:020d}{suffix}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def serve(directory: Path, channel: socket.socket) -> None:
    """Answer commands until the gateway closes its end."""
    files: dict[int, int] = {}  # seq -> fd
    buffer = b""
    while True:
        chunk = channel.recv(65536)
        if not chunk:
            break
        buffer += chunk
        channel.setblocking(False)
        try:
            while more := channel.recv(65536):
                buffer += more
        except BlockingIOError:
            pass
        finally:
            channel.setblocking(True)
        usable = len(buffer) - len(buffer) % COMMAND.size
        commands = [COMMAND.unpack_from(buffer, i) for i in range(0, usable, COMMAND.size)]
        buffer = buffer[usable:]
        status, position = 0, 0
        try:
            pending_sync: int | None = None
            for op, seq, pos in commands:
                if seq not in files:
                    path = _segment(directory, seq, OPEN_SUFFIX)
                    files[seq] = os.open(path, os.O_RDONLY)
                    _fsync_dir(directory)  # the new segment's name survives a power loss
                if op == SYNC:
                    pending_sync = seq
                else:  # SEAL: everything of this segment, then hand it to the flusher
                    fd = files.pop(seq)
                    os.fdatasync(fd)
                    os.close(fd)
                    _segment(directory, seq, OPEN_SUFFIX).rename(
                        _segment(directory, seq, SEALED_SUFFIX)
                    )
                    _fsync_dir(directory)
                    if pending_sync == seq:
                        pending_sync = None
                position = pos
            if pending_sync is not None and pending_sync in files:
                os.fdatasync(files[pending_sync])
        except OSError:
            status = 1
        try:
            channel.sendall(ANSWER.pack(status, position))
        except (BrokenPipeError, ConnectionResetError):  # the gateway is gone
            break
    for fd in files.values():
        os.fdatasync(fd)
        os.close(fd)


def main() -> int:
    """Entry point: `python -m gateway.syncer DIRECTORY` with the socket as stdin."""
    channel = socket.socket(fileno=os.dup(sys.stdin.fileno()))
    serve(Path(sys.argv[1]), channel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
