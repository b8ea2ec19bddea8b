"""Hashes of token sequences: stable content ids, and rolling prefix hashes for matching.

Content ids (`prompt_id`, `response_id`) are BLAKE2b-128 of the little-endian int32 ids: stable
across versions and machines. Prefix hashes are 64-bit polynomial hashes computed for every
prefix of many sequences at once with numpy (no per-token Python); callers verify matches on
the tokens themselves, so a collision can never join two different sequences.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

_BASE = 0x9E3779B97F4A7C15  # odd (golden-ratio constant): invertible modulo 2**64
_MASK = 2**64 - 1
_HASH_THREADS = 2
_ROWS_PER_TASK = 2_048


def list_parts(lists: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets int64, values, validity) of a list array, with offsets indexing `values`."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks() if lists.num_chunks != 1 else lists.chunk(0)
    if isinstance(lists, pa.LargeListArray):
        lists = lists.cast(pa.list_(lists.type.value_type))
    offsets = lists.offsets.to_numpy().astype(np.int64, copy=False)
    values = lists.values.to_numpy(zero_copy_only=False)
    valid = lists.is_valid().to_numpy(zero_copy_only=False)
    return offsets, values, valid


def content_hashes(lists: pa.Array | pa.ChunkedArray) -> pa.StringArray:
    """BLAKE2b-128 hex digest of each row's int32 ids (null rows stay null)."""
    offsets, values, valid = list_parts(lists)
    data = np.ascontiguousarray(values, dtype="<i4")
    rows = len(offsets) - 1

    def digest(start: int) -> list[str | None]:
        out: list[str | None] = []
        for i in range(start, min(start + _ROWS_PER_TASK, rows)):
            if valid[i]:
                # hashlib reads the numpy slice through the buffer protocol and releases the GIL
                out.append(
                    hashlib.blake2b(data[offsets[i] : offsets[i + 1]], digest_size=16).hexdigest()
                )
            else:
                out.append(None)
        return out

    starts = range(0, rows, _ROWS_PER_TASK)
    if rows <= _ROWS_PER_TASK:
        hexes = digest(0)
    else:
        with ThreadPoolExecutor(_HASH_THREADS) as pool:
            hexes = [h for part in pool.map(digest, starts) for h in part]
    return pa.array(hexes, pa.string())


def _powers(base: int, count: int) -> np.ndarray:
    """base**0 .. base**(count-1) modulo 2**64."""
    out = np.empty(max(count, 1), dtype=np.uint64)
    out[0] = 1
    if count > 1:
        out[1:] = base
        np.cumprod(out, out=out)  # wraps modulo 2**64, as wanted
    return out[:count]


def prefix_hashes(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """For every token position, the hash of its row's prefix ending there (inclusive).

    Row i spans values[offsets[i]:offsets[i+1]]. H(x_0..x_k) = sum_j (x_j + 1) * B**(k - j)
    modulo 2**64, computed for all positions with one cumulative sum:
    H_k = B**k * (C_k - C_{start-1}) where C accumulates (x_j + 1) * B**-(j - start).
    """
    total = int(offsets[-1] - offsets[0])
    if total == 0:
        return np.empty(0, dtype=np.uint64)
    lengths = np.diff(offsets)
    starts = np.repeat(offsets[:-1] - offsets[0], lengths)
    local = np.arange(total, dtype=np.int64) - starts
    longest = int(lengths.max())
    forward = _powers(_BASE, longest)
    inverse = _powers(pow(_BASE, -1, 2**64), longest)
    x = values[offsets[0] : offsets[-1]].astype(np.uint64) + np.uint64(1)
    weighted = x * inverse[local]
    running = np.cumsum(weighted, dtype=np.uint64)
    before = np.zeros(len(lengths), dtype=np.uint64)
    nonempty = lengths > 0
    first = offsets[:-1][nonempty] - offsets[0]
    before[nonempty] = np.where(first > 0, running[np.maximum(first - 1, 0)], np.uint64(0))
    return forward[local] * (running - np.repeat(before, lengths))


def sequence_hash(tokens: list[int] | np.ndarray) -> int:
    """The prefix hash of a whole sequence (reference for tests and single lookups)."""
    value = 0
    for token in np.asarray(tokens, dtype=np.int64).tolist():
        value = (value * _BASE + token + 1) & _MASK
    return value
