"""WAL frames: a bronze record serialized, length-prefixed and checksummed; and reading a
segment file back (a torn tail, never acknowledged, ends it)."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from gateway.records import TOKEN_FIELDS, BronzeRecord, PackedColumn, RecordColumns

log = logging.getLogger(__name__)
_NULL_LEN = 0xFFFFFFFF
_PREFIX = struct.Struct("<II")  # body length, crc32(body)
_U32 = struct.Struct("<I")


def frame(body: bytes) -> bytes:
    """Length-prefix and checksum an encoded record."""
    return _PREFIX.pack(len(body), zlib.crc32(body)) + body


def encode_frame(record: BronzeRecord) -> bytes:
    """Serialize a record as one checksummed, length-prefixed WAL frame."""
    return frame(encode_record(record))


def encode_record(record: BronzeRecord) -> bytes:
    """Serialize a record (the frame body, before its checksum)."""
    header = json.dumps(
        [record.event_id, record.kind, record.tenant, record.received_us, record.token_source],
        separators=(",", ":"),
        check_circular=False,
    ).encode()
    parts = [_U32.pack(len(header)), header, _U32.pack(len(record.payload)), record.payload]
    for packed in record.arrays():
        if packed is None:
            parts.append(_U32.pack(_NULL_LEN))
        else:
            parts.append(_U32.pack(len(packed)))
            parts.append(packed)
    return b"".join(parts)


def _bodies(buffer: bytes) -> tuple[list[tuple[int, int]], int]:
    """The (start, end) of each valid frame's body, and the number of valid bytes: frames
    end at the first torn or corrupt one, or at zeros (a torn tail was never acknowledged)."""
    bodies: list[tuple[int, int]] = []
    view = memoryview(buffer)
    offset = 0
    while offset + _PREFIX.size <= len(buffer):
        length, crc = _PREFIX.unpack_from(buffer, offset)
        if length == 0:  # no frame is empty: the zeros a segment was preallocated with
            break
        start, end = offset + _PREFIX.size, offset + _PREFIX.size + length
        if end > len(buffer) or zlib.crc32(view[start:end]) != crc:
            break
        bodies.append((start, end))
        offset = end
    return bodies, offset


def _parts(buffer: bytes, start: int) -> tuple[int, int, int, int, list[tuple[int, int] | None]]:
    """Where a body's parts lie in `buffer`: header start and length, payload start and
    length, and each token array's (start, length), None when null."""
    unpack = _U32.unpack_from
    (header_len,) = unpack(buffer, start)
    header = start + 4
    (payload_len,) = unpack(buffer, header + header_len)
    pos = payload = header + header_len + 4
    pos += payload_len
    arrays: list[tuple[int, int] | None] = []
    for _ in TOKEN_FIELDS:
        (n,) = unpack(buffer, pos)
        pos += 4
        if n == _NULL_LEN:
            arrays.append(None)
        else:
            arrays.append((pos, n))
            pos += n
    return header, header_len, payload, payload_len, arrays


def decode_frames(buffer: bytes) -> tuple[list[BronzeRecord], int]:
    """Decode consecutive frames; stop at the first torn or corrupt one, or at zeros.

    Returns the records and the number of valid bytes (a torn tail was never acknowledged).
    """
    bodies, valid = _bodies(buffer)
    return [_decode_body(buffer, start) for start, _end in bodies], valid


def _decode_body(buffer: bytes, start: int) -> BronzeRecord:
    header, header_len, payload, payload_len, arrays = _parts(buffer, start)
    event_id, kind, tenant, received_us, token_source = json.loads(
        buffer[header : header + header_len]
    )
    packed = [None if a is None else buffer[a[0] : a[0] + a[1]] for a in arrays]
    return BronzeRecord(
        event_id,
        kind,
        tenant,
        received_us,
        buffer[payload : payload + payload_len],
        token_source,
        *packed,
    )


def decode_columns(buffers: Sequence[bytes]) -> tuple[RecordColumns, list[int]]:
    """The records of consecutive frames in each buffer (stopping as `decode_frames` does),
    as columns, and each buffer's valid bytes: the flusher's path, with no Python object
    per record beyond its header's."""
    headers: list[memoryview] = []
    payloads: list[memoryview] = []
    arrays: list[list[memoryview | None]] = [[] for _ in TOKEN_FIELDS]
    valid: list[int] = []
    for buffer in buffers:
        view = memoryview(buffer)
        bodies, ok = _bodies(buffer)
        valid.append(ok)
        for start, _end in bodies:
            header, header_len, payload, payload_len, spans = _parts(buffer, start)
            headers.append(view[header : header + header_len])
            payloads.append(view[payload : payload + payload_len])
            for column, span in zip(arrays, spans, strict=True):
                column.append(None if span is None else view[span[0] : span[0] + span[1]])
    envelope = json.loads(b"[" + b",".join(headers) + b"]")
    n = len(envelope)
    offsets = np.zeros(n + 1, np.int32)
    np.cumsum(np.fromiter((len(p) for p in payloads), np.int64, n), out=offsets[1:])
    payload = pa.StringArray.from_buffers(
        n, pa.py_buffer(offsets), pa.py_buffer(b"".join(payloads))
    )
    payload.validate(full=True)  # UTF-8, as the records were accepted
    columns = RecordColumns(
        [e[0] for e in envelope],
        [e[1] for e in envelope],
        [e[2] for e in envelope],
        np.fromiter((e[3] for e in envelope), np.int64, n),
        [e[4] for e in envelope],
        payload,
        tuple(PackedColumn.of(column) for column in arrays),
    )
    return columns, valid


def read_segment(path: Path) -> list[BronzeRecord]:
    """The records of a segment file (a torn tail, never acknowledged, is ignored; so are the
    zeros of a spare a crash left unfilled)."""
    data = path.read_bytes()
    records, valid = decode_frames(data)
    _check_tail(path, data, valid)
    return records


def read_segments(paths: Sequence[Path]) -> RecordColumns:
    """The records of segment files, as columns (what `read_segment` reads, for landing)."""
    buffers = [path.read_bytes() for path in paths]
    columns, valid = decode_columns(buffers)
    for path, data, ok in zip(paths, buffers, valid, strict=True):
        _check_tail(path, data, ok)
    return columns


def _check_tail(path: Path, data: bytes, valid: int) -> None:
    if valid != len(data) and data.count(0, valid) != len(data) - valid:
        log.warning("WAL %s: ignoring %d torn bytes at the tail", path, len(data) - valid)
