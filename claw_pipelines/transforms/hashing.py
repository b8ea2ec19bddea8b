"""Hashes of token sequences: stable content ids, and rolling prefix hashes for matching.

Content ids (`prompt_id`, `response_id`) are BLAKE2b-128 of the little-endian int32 ids: stable
across versions and machines. Prefix hashes are 64-bit polynomial hashes computed for every
prefix of many sequences at once with numpy (no per-token Python); callers verify matches on
the tokens themselves, so a collision can never join two different sequences.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise

import numpy as np
import polars as pl
import pyarrow as pa

_BASE = 0x9E3779B97F4A7C15  # odd (golden-ratio constant): invertible modulo 2**64
_MASK = 2**64 - 1
_HASH_THREADS = 2
_ROWS_PER_TASK = 2_048
CHUNK_TOKENS = 2**21  # ~16 MiB of uint64 temporaries per chunk


def list_parts(lists: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets int64, values, validity) of a list array, with offsets indexing `values`."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks() if lists.num_chunks != 1 else lists.chunk(0)
    # the offsets read off their buffer: pyarrow's `.offsets` costs what the values hold
    # (~0.3 s for a column of 27 M ids), the buffer what the rows do
    kind = np.int64 if isinstance(lists, pa.LargeListArray) else np.int32
    buffer = lists.buffers()[1]
    if buffer is None:  # no rows
        offsets = np.zeros(1, dtype=np.int64)
    else:
        raw = np.frombuffer(buffer, dtype=kind)
        offsets = raw[lists.offset : lists.offset + len(lists) + 1].astype(np.int64)
    values = primitive_values(lists.values)
    if lists.null_count:
        valid = lists.is_valid().to_numpy(zero_copy_only=False)
    else:  # the common case, without pyarrow's boolean conversion (it imports pandas)
        valid = np.ones(len(lists), dtype=bool)
    return offsets, values, valid


def primitive_values(array: pa.Array) -> np.ndarray:
    """An Arrow array of numbers as numpy: without nulls, a view of its data buffer
    (`to_numpy` copies a column exported by polars: ~0.3 s for 27 M ids)."""
    kind = array.type
    if array.null_count or not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return array.to_numpy(zero_copy_only=False)
    data = array.buffers()[1]
    if data is None:
        return np.empty(0, dtype=kind.to_pandas_dtype())
    return np.frombuffer(data, dtype=kind.to_pandas_dtype())[
        array.offset : array.offset + len(array)
    ]


def content_hashes(lists: pa.Array | pa.ChunkedArray) -> pa.StringArray:
    """BLAKE2b-128 hex digest of each row's int32 ids (null rows stay null)."""
    offsets, values, valid = list_parts(lists)
    return _digests(values, offsets[:-1], offsets[1:], valid)


def slice_content_hashes(
    lists: pa.Array | pa.ChunkedArray, start: np.ndarray, stop: np.ndarray
) -> pa.StringArray:
    """The content hash of each row's ids[start:stop] (null when the row is too short)."""
    offsets, values, valid = list_parts(lists)
    lengths = np.diff(offsets)
    fits = valid & (start >= 0) & (start <= stop) & (stop <= lengths)
    return _digests(values, offsets[:-1] + start, offsets[:-1] + stop, fits)


def _digests(
    values: np.ndarray, begin: np.ndarray, end: np.ndarray, valid: np.ndarray
) -> pa.StringArray:
    """BLAKE2b-128 of values[begin[i]:end[i]] per row, on two threads (hashlib frees the GIL)."""
    data = np.ascontiguousarray(values, dtype="<i4")
    rows = len(begin)
    begin, end, valid = begin.tolist(), end.tolist(), valid.tolist()

    def digest(first: int) -> list[str | None]:
        out: list[str | None] = []
        for i in range(first, min(first + _ROWS_PER_TASK, rows)):
            if valid[i]:
                row = data[begin[i] : end[i]]  # read through the buffer protocol, no copy
                out.append(hashlib.blake2b(row, digest_size=16).hexdigest())
            else:
                out.append(None)
        return out

    if rows <= _ROWS_PER_TASK:
        hexes = digest(0)
    else:
        with ThreadPoolExecutor(_HASH_THREADS) as pool:
            parts = pool.map(digest, range(0, rows, _ROWS_PER_TASK))
            hexes = [h for part in parts for h in part]
    return strings(hexes)


def strings(values: list[str | None]) -> pa.StringArray:
    """Python strings as an Arrow string array, built by polars (`pa.array` on a list imports
    pandas, ~0.3 s in a fresh process)."""
    return pl.Series(values, dtype=pl.String).to_arrow().cast(pa.string())


def arrow_of(values: np.ndarray) -> pa.Array:
    """A numpy array of numbers as an Arrow array over the same memory (`pa.array` imports
    pandas, ~0.3 s in a fresh process)."""
    values = np.ascontiguousarray(values)
    kind = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(kind, len(values), [None, pa.py_buffer(values)])


def _powers(base: int, count: int) -> np.ndarray:
    """base**0 .. base**(count-1) modulo 2**64."""
    out = np.empty(max(count, 1), dtype=np.uint64)
    out[0] = 1
    if count > 1:
        out[1:] = base
        np.cumprod(out, out=out)  # wraps modulo 2**64, as wanted
    return out[:count]


def concat_ranges(table: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """table[0:l] for each l in lengths, concatenated (row-wise memcpy, no per-token work)."""
    return np.concatenate([table[:n] for n in lengths.tolist()]) if len(lengths) else table[:0]


def row_chunks(offsets: np.ndarray, budget: int = CHUNK_TOKENS) -> list[tuple[int, int]]:
    """Split rows into consecutive (first, stop) groups of at most `budget` tokens each (a
    longer row is a group of its own), so temporary arrays stay small and memory stays warm."""
    rows = len(offsets) - 1
    bounds = [0]
    while bounds[-1] < rows:
        first = bounds[-1]
        stop = int(np.searchsorted(offsets, offsets[first] + budget, side="right")) - 1
        bounds.append(min(max(stop, first + 1), rows))
    return list(pairwise(bounds)) if rows > 0 else []


def iter_prefix_hashes(values: np.ndarray, offsets: np.ndarray, budget: int = CHUNK_TOKENS):
    """Yield (first_row, stop_row, hashes) by row chunks: for every token position of those
    rows, the hash of its row's prefix ending there (inclusive).

    H(x_0..x_k) = sum_j (x_j + 1) * B**(k - j) modulo 2**64, computed for all positions with
    one cumulative sum: H_k = B**k * (C_k - C_{start-1}), C accumulating (x_j + 1) * B**-j
    (j counted from the row's start).
    """
    lengths_all = np.diff(offsets)
    longest = int(lengths_all.max()) if len(lengths_all) else 0
    forward_table = _powers(_BASE, longest)
    inverse_table = _powers(pow(_BASE, -1, 2**64), longest)
    for first, stop in row_chunks(offsets, budget):
        lengths = lengths_all[first:stop]
        lo, hi = offsets[first], offsets[stop]
        if hi == lo:
            yield first, stop, np.empty(0, dtype=np.uint64)
            continue
        weighted = values[lo:hi].astype(np.uint64)
        weighted += np.uint64(1)
        weighted *= concat_ranges(inverse_table, lengths)
        running = np.cumsum(weighted, dtype=np.uint64, out=weighted)
        starts = offsets[first:stop] - lo
        before = np.where(starts > 0, running[np.maximum(starts - 1, 0)], np.uint64(0))
        running -= np.repeat(before, lengths)
        running *= concat_ranges(forward_table, lengths)
        yield first, stop, running


def prefix_hashes(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Every position's prefix hash (see `iter_prefix_hashes`), for all rows at once."""
    parts = [h for _, _, h in iter_prefix_hashes(values, offsets)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint64)


def sequence_hash(tokens: list[int] | np.ndarray) -> int:
    """The prefix hash of a whole sequence (reference for tests and single lookups)."""
    value = 0
    for token in np.asarray(tokens, dtype=np.int64).tolist():
        value = (value * _BASE + token + 1) & _MASK
    return value
