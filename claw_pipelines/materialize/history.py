"""What a follower knows of silver's past, on its local disk: the view's rows by trajectory.

A follower keeps in memory only the trajectories that can still change or were touched
lately (`SilverView`'s open window). Everything it ever took is also written here, so that
what closed history is needed for (a late reward or rescore for a trajectory closed long
ago, a duplicate event, stitching into an old conversation) is read back by key.

The store is RocksDB (`rocksdict`; docs/DESIGN.md §11 says why, with the measurements): an embedded
key-value store whose memory is bounded (its block cache and memtables), whose write batch
is atomic (a round's rows and the versions they bring it to land together or not at all, so
a follower killed mid-round finds the store at the last round it finished), and which lives
on the follower's disk only: it is a cache of the lake, rebuilt from it when lost or behind.

Layout (keys are bytes; `uid` a trajectory uid):
- `s` segment chunk table: the rows of one table one write took, as Arrow IPC; a write's rows
  are split into chunks by uid so that reading one trajectory back reads a small chunk;
- `u` uid NUL segment chunk: the chunks holding rows of that trajectory (facts are filed
  under every trajectory they address);
- `e` event_id -> uid (steps and the partials joined into them), `f` feedback_id (facts),
  `g` group NUL uid, `o` origin step key -> uid, `p` origin trajectory NUL uid, `w` created
  time NUL uid (stitched steps, by time), `t` uid -> last seen (the open trajectories);
- `meta`: the silver versions the store stands at and the view's clocks and counters.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from rocksdict import Options, Rdict, ReadOptions, WriteBatch

from claw_pipelines.transforms.curation import GROUP

TABLES = ("steps", "facts", "rewards", "trajectories", "removed")
_CODE = {name: bytes([i]) for i, name in enumerate(TABLES)}
CHUNK_ROWS = 64  # rows of one table in one chunk (a trajectory's rows sit in one chunk)
WRITE_BUFFER_BYTES = 16 << 20  # a memtable (RocksDB's default, 64 MiB, twice, is more)
_META = b"meta"
_SEP = b"\x00"
_US = 1_000_000


def _segment_key(segment: int, chunk: int, table: str) -> bytes:
    return b"s" + struct.pack(">QI", segment, chunk) + _CODE[table]


def _ipc(table: pa.Table) -> bytes:
    """`table` as Arrow IPC stream bytes."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _polars(table: pa.Table) -> pl.DataFrame:
    frame = pl.from_arrow(table)
    assert isinstance(frame, pl.DataFrame)
    return frame


def _encoded(values: Iterable[Any]) -> list[bytes]:
    return [str(v).encode() for v in values]


def fact_addresses(facts: pl.DataFrame) -> pl.Series:
    """Per fact, the trajectories it addresses (its `trajectory_uid`, and the trajectory of
    its `step_key`), as a list column."""
    of_step = pl.col("step_key").str.replace(r":[0-9]+$", "")
    addresses = pl.concat_list(pl.col("trajectory_uid"), of_step).list.drop_nulls().list.unique()
    return facts.select(addresses.alias("addresses")).to_series()


class History:
    """The follower's on-disk record of silver (see the module doc)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db = self._open()
        self.meta: dict[str, Any] = json.loads(self._db.get(_META) or b"{}")

    def _open(self) -> Rdict:
        self.path.mkdir(parents=True, exist_ok=True)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_write_buffer_size(WRITE_BUFFER_BYTES)  # what it holds in memory is bounded
        options.set_max_write_buffer_number(2)
        return Rdict(str(self.path), options)

    # -- the state it stands at --------------------------------------------------------------
    @property
    def segments(self) -> int:
        """Segments written so far (the next one's number)."""
        return int(self.meta.get("segments", 0))

    def stands_for(self, lake_uri: str) -> bool:
        """Whether the store holds a view of `lake_uri` (it may still be behind)."""
        return self.meta.get("lake") == lake_uri and "versions" in self.meta

    def clear(self, lake_uri: str) -> None:
        """Drop everything (before a rebuild from the lake)."""
        self._db.close()
        shutil.rmtree(self.path, ignore_errors=True)
        self._db = self._open()
        self.meta = {"lake": lake_uri, "segments": 0}

    def close(self) -> None:
        """Release the store (a later `History` of the same folder opens it again)."""
        self._db.close()

    # -- writes ----------------------------------------------------------------------------
    def write(self, frames: dict[str, pl.DataFrame], meta: dict[str, Any] | None = None) -> int:
        """File one write's rows (table name -> rows with `trajectory_uid`, facts with their
        `addresses`) and the indexes over them, and `meta` (merged into the store's), in one
        atomic batch; the segment's number."""
        segment = self.segments
        batch = WriteBatch(raw_mode=True)
        for table, rows in frames.items():
            if rows.is_empty():
                continue
            self._file(batch, segment, table, rows)
            self._index(batch, table, rows)
        self.meta = {**self.meta, **(meta or {}), "segments": segment + 1}
        batch.put(_META, json.dumps(self.meta, default=str).encode())
        self._db.write(batch)
        return segment

    def _file(self, batch: WriteBatch, segment: int, table: str, rows: pl.DataFrame) -> None:
        """The rows in chunks of about CHUNK_ROWS by trajectory, and each chunk's uids: the
        rows sorted by owner with one gather and made Arrow once, each chunk a slice of them
        (a gather a chunk from rows of several chunks copied them whole each time: quadratic
        in a run)."""
        column = "addresses" if table == "facts" else "trajectory_uid"
        uids = rows.select(pl.concat_list(column)).to_series()
        owner = uids.list.first().fill_null("").alias("owner")
        order = owner.to_frame().select(pl.arg_sort_by("owner", maintain_order=True)).to_series()
        owner, uids = owner.gather(order), uids.gather(order)
        rows = rows[order].to_arrow()  # once: a chunk is a slice of it (no copy)
        bounds = _chunk_bounds(owner, CHUNK_ROWS)
        for chunk, (start, end) in enumerate(bounds):
            batch.put(_segment_key(segment, chunk, table), _ipc(rows.slice(start, end - start)))
        sizes = [end - start for start, end in bounds]
        filed = pl.DataFrame({"uid": uids, "chunk": np.repeat(np.arange(len(bounds)), sizes)})
        filed = filed.explode("uid").drop_nulls().unique(maintain_order=True)
        for uid, chunk in filed.iter_rows():
            batch.put(b"u" + uid.encode() + _SEP + struct.pack(">QI", segment, chunk), b"")

    def _index(self, batch: WriteBatch, table: str, rows: pl.DataFrame) -> None:
        if table == "steps":
            events = rows.select("trajectory_uid", "event_id", "partial_event_ids")
            for event, uid in events.select("event_id", "trajectory_uid").iter_rows():
                if event is not None:
                    batch.put(b"e" + event.encode(), uid.encode())
            joined = events.explode("partial_event_ids").drop_nulls("partial_event_ids")
            for uid, event in joined.select("trajectory_uid", "partial_event_ids").iter_rows():
                batch.put(b"e" + event.encode(), uid.encode())
            pairs = rows.select(GROUP, "trajectory_uid").unique()
            for group, uid in pairs.iter_rows():
                batch.put(b"g" + str(group).encode() + _SEP + uid.encode(), b"")
            stitched = rows.filter(pl.col("origin_step_key").is_not_null()).select(
                "origin_step_key",
                "origin_trajectory",
                "trajectory_uid",
                pl.col("created_at").dt.epoch("us"),
            )
            for origin, origin_uid, uid, created in stitched.iter_rows():
                batch.put(b"o" + origin.encode(), uid.encode())
                batch.put(b"p" + origin_uid.encode() + _SEP + uid.encode(), b"")
                batch.put(b"w" + struct.pack(">q", created) + _SEP + uid.encode(), b"")
        elif table == "facts":
            for feedback_id in rows["feedback_id"]:
                batch.put(b"f" + feedback_id.encode(), b"")
        elif table == "trajectories":
            seen = rows.select(
                "trajectory_uid", "status", pl.col("last_seen_at").dt.epoch("us").fill_null(0)
            )
            for uid, status, last in seen.iter_rows():
                key = b"t" + uid.encode()
                if status == "open":
                    batch.put(key, struct.pack(">q", last))
                else:
                    batch.delete(key)

    # -- reads -----------------------------------------------------------------------------
    def rows_of(self, uids: pl.Series, upto: int | None = None) -> dict[str, pl.DataFrame]:
        """Every table's rows filed under `uids`, in the order written, from segments before
        `upto` (default: all): table name -> rows (absent: none)."""
        wanted = set(uids.drop_nulls().unique().to_list())
        chunks: set[bytes] = set()
        for uid in wanted:
            for key in self._prefixed(b"u" + uid.encode() + _SEP):
                tail = key[-12:]
                if upto is None or struct.unpack(">Q", tail[:8])[0] < upto:
                    chunks.add(tail)
        ordered = sorted(chunks)
        found: dict[str, list[pa.Table]] = {}
        keys = [b"s" + tail + _CODE[t] for tail in ordered for t in TABLES]
        for key, data in zip(keys, self._db.get(keys) if keys else [], strict=True):
            if data is not None:
                found.setdefault(TABLES[key[-1]], []).append(pa.ipc.open_stream(data).read_all())
        rows_of: dict[str, pl.DataFrame] = {}
        mine = pa.array(list(wanted), pa.string())
        for table, parts in found.items():  # filtered in Arrow, then one conversion a table
            rows = pa.concat_tables(parts, promote_options="permissive").combine_chunks()
            if table == "facts":
                addresses = rows.column("addresses").combine_chunks()
                flat = pc.is_in(pc.list_flatten(addresses), value_set=mine)
                owners = pc.list_parent_indices(addresses).filter(flat)
                rows = rows.take(pc.unique(owners).sort())
            else:
                rows = rows.filter(pc.is_in(rows.column("trajectory_uid"), value_set=mine))
            rows_of[table] = _polars(rows)
        return rows_of

    def holds(self, uids: pl.Series) -> pl.Series:
        """Which of the trajectories `uids` the store has rows of."""
        unique = uids.drop_nulls().unique()
        held = [
            uid
            for uid in unique.to_list()
            if next(self._prefixed(b"u" + uid.encode() + _SEP), None)
        ]
        return pl.Series("trajectory_uid", held, pl.String)

    def known(self, prefix: bytes, values: pl.Series) -> pl.Series:
        """Which of `values` the index `prefix` holds (`e` event ids, `f` feedback ids)."""
        unique = values.drop_nulls().unique()
        if unique.is_empty():
            return unique
        got = self._db.get([prefix + v.encode() for v in unique])
        return unique.filter(pl.Series([g is not None for g in got]))

    def owners(self, prefix: bytes, values: pl.Series) -> pl.Series:
        """The uids the index `prefix` maps `values` to (`e` event ids, `o` origin keys)."""
        unique = values.drop_nulls().unique()
        if unique.is_empty():
            return pl.Series("trajectory_uid", [], pl.String)
        got = self._db.get([prefix + v.encode() for v in unique])
        return pl.Series("trajectory_uid", [g.decode() for g in got if g is not None], pl.String)

    def members(self, prefix: bytes, values: pl.Series) -> pl.Series:
        """The uids filed under each of `values` in the index `prefix` (`g` groups, `p`
        origin trajectories)."""
        found = [
            key.rsplit(_SEP, 1)[1].decode()
            for value in values.drop_nulls().unique()
            for key in self._prefixed(prefix + str(value).encode() + _SEP)
        ]
        return pl.Series("trajectory_uid", found, pl.String).unique()

    def stitched_since(self, since_us: int) -> pl.Series:
        """The trajectories holding a stitched step created at or after `since_us`."""
        start = b"w" + struct.pack(">q", since_us)
        found = [key.rsplit(_SEP, 1)[1].decode() for key in self._range(start, b"x")]
        return pl.Series("trajectory_uid", found, pl.String).unique()

    def open_trajectories(self) -> pl.DataFrame:
        """The trajectories open as of the store's state, with when they were last seen."""
        uids, seen = [], []
        for key, value in self._items(b"t", b"u"):
            uids.append(key[1:].decode())
            seen.append(struct.unpack(">q", value)[0])
        return pl.DataFrame(
            {"trajectory_uid": uids, "last_seen_us": seen},
            schema={"trajectory_uid": pl.String, "last_seen_us": pl.Int64},
        )

    def _prefixed(self, prefix: bytes) -> Iterator[bytes]:
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        return self._range(prefix, end)

    def _range(self, start: bytes, end: bytes) -> Iterator[bytes]:
        for key, _ in self._items(start, end):
            yield key

    def _items(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        read = ReadOptions()
        read.set_iterate_upper_bound(end)
        iterator = self._db.iter(read)
        iterator.seek(start)
        while iterator.valid():
            yield iterator.key(), iterator.value()
            iterator.next()


def _chunk_bounds(owners: pl.Series, size: int) -> list[tuple[int, int]]:
    """(start, end) of chunks of about `size` rows of the sorted `owners`, never splitting
    one owner's rows."""
    n = owners.len()
    starts = np.flatnonzero(owners.ne_missing(owners.shift(1)).to_numpy())
    bounds, start = [], 0
    while start < n:
        at = int(np.searchsorted(starts, start + size, "left"))
        end = int(starts[at]) if at < len(starts) else n
        bounds.append((start, end))
        start = end
    return bounds
