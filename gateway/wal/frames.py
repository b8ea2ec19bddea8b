"""WAL frames: a bronze record serialized, length-prefixed and checksummed; and reading a
segment file back (a torn tail, never acknowledged, ends it)."""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path

from gateway.records import TOKEN_FIELDS, BronzeRecord

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


def decode_frames(buffer: bytes) -> tuple[list[BronzeRecord], int]:
    """Decode consecutive frames; stop at the first torn or corrupt one, or at zeros.

    Returns the records and the number of valid bytes (a torn tail was never acknowledged).
    """
    records: list[BronzeRecord] = []
    view = memoryview(buffer)
    offset = 0
    while offset + _PREFIX.size <= len(buffer):
        length, crc = _PREFIX.unpack_from(buffer, offset)
        if length == 0:  # no frame is empty: the zeros a segment was preallocated with
            break
        start, end = offset + _PREFIX.size, offset + _PREFIX.size + length
        if end > len(buffer) or zlib.crc32(view[start:end]) != crc:
            break
        records.append(_decode_body(view[start:end]))
        offset = end
    return records, offset


def _decode_body(body: memoryview) -> BronzeRecord:
    pos = 0

    def take(n: int) -> memoryview:
        nonlocal pos
        chunk = body[pos : pos + n]
        pos += n
        return chunk

    (header_len,) = _U32.unpack(take(4))
    event_id, kind, tenant, received_us, token_source = json.loads(bytes(take(header_len)))
    (payload_len,) = _U32.unpack(take(4))
    payload = bytes(take(payload_len))
    arrays: list[bytes | None] = []
    for _ in TOKEN_FIELDS:
        (n,) = _U32.unpack(take(4))
        arrays.append(None if n == _NULL_LEN else bytes(take(n)))
    return BronzeRecord(event_id, kind, tenant, received_us, payload, token_source, *arrays)


def read_segment(path: Path) -> list[BronzeRecord]:
    """The records of a segment file (a torn tail, never acknowledged, is ignored; so are the
    zeros of a spare a crash left unfilled)."""
    data = path.read_bytes()
    records, valid = decode_frames(data)
    if valid != len(data) and data.count(0, valid) != len(data) - valid:
        log.warning("WAL %s: ignoring %d torn bytes at the tail", path, len(data) - valid)
    return records
