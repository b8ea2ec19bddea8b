"""The lake: the only module that builds table URIs and storage options and reads/writes Delta."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import (
    ColumnProperties,
    CommitProperties,
    DeltaTable,
    Field,
    Transaction,
    WriterProperties,
    write_deltalake,
)
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from claw_pipelines.contracts.errors import Fenced, WriteConflict
from claw_pipelines.contracts.tables import (
    LOGPROB_LIST,
    MASK_LIST,
    TABLES,
    TOKEN_LIST,
    TableSpec,
    table_spec,
)
from claw_pipelines.lake.object_store import (
    list_folders,
    list_names,
    read_bytes,
    verify_lake_store,
    write_bytes,
)
from claw_pipelines.settings import REMOTE_SCHEMES, ClawSettings
from claw_pipelines.transforms.shards import with_shard_order

log = logging.getLogger(__name__)
# What delta-rs says when the change feed cannot cover a range: the log of those versions was
# cleaned up, or a file it names was vacuumed. Anything else (a network error) is raised.
_FEED_GONE = re.compile(
    r"invalid table version|not found|no such file|does not have change data enabled", re.IGNORECASE
)

T = TypeVar("T")
COMMIT_METADATA_KEY = "claw"
REFRESH_S = 0.025  # kept table handles are refreshed at most this often (own writes: at once)
# a kept table handle is opened again (from the newest checkpoint) once it has moved this many
# commits past where it was opened: delta-rs keeps every commit since in the handle, and each
# write then costs what that segment holds (a 1-row append: 4 ms at 10 commits, 68 ms at 800,
# 17 ms with a fresh handle), so a long-running writer's commits grew slower by the hour
REOPEN_COMMITS = 50
CHANGE_FEED_PROPERTY = "delta.enableChangeDataFeed"
CHANGE_COLUMNS = ("_change_type", "_commit_version", "_commit_timestamp")


@dataclass(frozen=True)
class Guard:
    """Optimistic concurrency for one writer's commits (e.g. one silver run).

    Every guarded commit carries the Delta application transactions (`app_ids`, each at
    `version`) and is based on the table version the writer read (`read_versions[table]`).
    It lands only if no other commit of one of those app ids reached that table since; a
    whole-table overwrite lands only if no commit at all did (delta-rs would otherwise keep
    the files a concurrent compaction wrote). Anything else raises WriteConflict: nothing is
    ever committed on top of a state the writer did not see. (One app id names one writer's
    share of a table: all of silver, or one gold partition.)

    `fences` (app id -> fencing token: a shard lease's, `lake.leases`) are carried too, each
    at its token; a commit to a table where a larger token of one of them was committed
    raises Fenced instead (a newer owner took the share over).
    """

    app_ids: tuple[str, ...]
    version: int
    read_versions: Mapping[str, int]
    fences: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def transactions(self) -> list[Transaction]:
        """The application transactions every guarded commit carries."""
        given = [Transaction(app_id=app_id, version=self.version) for app_id in self.app_ids]
        return given + [Transaction(app_id=a, version=t) for a, t in self.fences.items()]

    def check_fences(self, table: DeltaTable, name: str) -> None:
        """Raise Fenced when `table` (as read) holds a larger token of one of the fences."""
        for app_id, token in self.fences.items():
            recorded = table.transaction_version(app_id)
            if recorded is not None and recorded > token:
                raise Fenced(
                    f"{name}: {app_id} is owned under token {recorded} now (this writer's: {token})"
                )


def until_landed(work: Callable[[], T], what: str, attempts: int = 50) -> tuple[T, int]:
    """Run `work` (one guarded attempt: pin, compute, commit) again after each WriteConflict,
    with jittered backoff; (its result, the number of attempts that lost)."""
    for attempt in range(attempts):
        try:
            return work(), attempt
        except WriteConflict:
            time.sleep(random.uniform(0, min(1.0, 0.02 * 2**attempt)))
    raise WriteConflict(f"{what}: lost {attempts} times in a row to concurrent writers")


REBASES = 20  # a guarded write refused only for others' commits is written again this often

# keys one Delta predicate may list (`col IN (...)`): delta-rs 1.6 segfaults on an overwrite
# whose predicate lists 30,000 (20,000 pass); a write that would list more goes whole
MAX_PREDICATE_KEYS = 10_000


def sql_strings(values: Iterable[str]) -> str:
    """Strings as a SQL list body for a Delta predicate (`col IN (...)`), sorted, quoted."""
    return ", ".join("'" + v.replace("'", "''") + "'" for v in sorted(values))


def conform(data: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast `data` to `schema`; absent nullable columns become nulls."""
    columns = []
    for field in schema:
        if field.name in data.column_names:
            columns.append(data.column(field.name).cast(field.type))
        elif field.nullable:
            columns.append(pa.nulls(data.num_rows, field.type))
        else:
            raise ValueError(f"column {field.name!r} is required by the table schema")
    return pa.Table.from_arrays(columns, schema=schema)


def empty_frame(schema: pa.Schema) -> pl.DataFrame:
    """A frame of no rows with `schema`'s columns and types. (polars turns an empty Arrow table
    into a frame through pandas dtypes: importing pandas costs ~0.3 s of a fresh process; a
    row of nulls, cleared, does not.)"""
    nullable = pa.schema([field.with_nullable(True) for field in schema])
    row = pa.Table.from_arrays([pa.nulls(1, field.type) for field in nullable], schema=nullable)
    frame = pl.from_arrow(row)
    assert isinstance(frame, pl.DataFrame)
    return frame.clear()


def _spec(spec: TableSpec | str) -> TableSpec:
    return TABLES[spec] if isinstance(spec, str) else spec


def _commit(
    metadata: Mapping[str, Any] | None,
    transactions: list[Transaction] | None = None,
    retries: int | None = None,
) -> CommitProperties:
    """Commit properties carrying the claw metadata (and transactions) of one write."""
    custom = {COMMIT_METADATA_KEY: json.dumps(dict(metadata or {}), sort_keys=True)}
    return CommitProperties(
        custom_metadata=custom, app_transactions=transactions, max_commit_retries=retries
    )


def _retry_conflicts(table: DeltaTable, write: Callable[[], None], attempts: int = 5) -> int:
    """Run a replacing write; if a concurrent commit (compaction, another writer) came first,
    base the table on the new state and write again. Returns the version written."""
    for attempt in range(1, attempts):
        try:
            write()
            return table.version()
        except CommitFailedError:
            time.sleep(0.05 * attempt)
            table.update_incremental()
    write()
    return table.version()


def _claw_metadata(entry: Mapping[str, Any]) -> dict[str, Any]:
    raw = entry.get(COMMIT_METADATA_KEY)
    return json.loads(raw) if isinstance(raw, str) else dict(raw or {})


# Columns of token ids, log-probs and masks: dictionary pages and page statistics cost half
# the encoding time (nothing prunes on them; a dictionary of ids saves ~6 % of silver's and a
# dataset's bytes, ~30 % of the trees': `compact_lists` keeps it there); zstd level 1
# compresses them well at the same cost. The other columns keep their statistics: readers
# prune files by them (and delta-rs's pyarrow dataset takes a file without statistics for a
# column to hold nulls only there, so a filter on that column would skip the file).
# delta-rs names a column's properties by a one-part path, which reaches a flat column but
# never a list's values (`prompt_ids.list.element`): so lists take the default properties
# and every flat column is named with its own.
LIST_COLUMNS = ColumnProperties(dictionary_enabled=False, statistics_enabled="NONE")
COMPACT_LIST_COLUMNS = ColumnProperties(dictionary_enabled=True, statistics_enabled="NONE")
FLAT_COLUMNS = ColumnProperties(dictionary_enabled=True, statistics_enabled="PAGE")
# Micro-batches (bronze): no dictionaries, statistics per column chunk, values in them cut
# at STATISTICS_BYTES (a payload's JSON would otherwise fill the log's stats)
APPEND_HEAVY_COLUMNS = ColumnProperties(dictionary_enabled=False, statistics_enabled="CHUNK")
STATISTICS_BYTES = 64


def _writer(spec: TableSpec, row_group_rows: int | None = None) -> WriterProperties | None:
    """Parquet writer settings of a table's appends (`row_group_rows`: instead of the spec's)."""
    tokens = [f.name for f in spec.schema if f.type in (TOKEN_LIST, LOGPROB_LIST, MASK_LIST)]
    row_group_rows = row_group_rows or spec.row_group_rows
    if not tokens and not row_group_rows and not spec.append_heavy:
        return None
    zstd = bool(tokens) or spec.append_heavy
    heavy = spec.append_heavy
    flat = [f.name for f in spec.schema if not pa.types.is_nested(f.type)]
    return WriterProperties(
        max_row_group_size=row_group_rows,
        compression="ZSTD" if zstd else None,
        compression_level=1 if zstd else None,
        statistics_truncate_length=STATISTICS_BYTES if heavy else None,
        default_column_properties=COMPACT_LIST_COLUMNS if spec.compact_lists else LIST_COLUMNS,
        column_properties=dict.fromkeys(flat, APPEND_HEAVY_COLUMNS if heavy else FLAT_COLUMNS),
    )


def row_groups_where(dataset: Any, where: pc.Expression) -> Any:
    """The row groups of a pyarrow parquet dataset whose statistics allow `where`, as a
    dataset to read whole (no row filter: filtering copies every column it keeps)."""
    import pyarrow.dataset as ds

    groups = [g for f in dataset.get_fragments() for g in f.split_by_row_group(where)]
    return ds.FileSystemDataset(groups, dataset.schema, dataset.format, dataset.filesystem)


def _read_files(
    table_uri: str,
    options: dict[str, str] | None,
    schema: pa.Schema,
    adds: Iterable[Mapping[str, Any]],
) -> Any:
    """A pyarrow dataset of some of a Delta table's data files (their `add` actions: path,
    size, partition values), read through delta-rs's own file system from a store, through
    pyarrow's own from a local table (no Python call a read: 10-50 % of a large read)."""
    import pyarrow.dataset as ds
    from deltalake.fs import DeltaStorageHandler
    from pyarrow.fs import LocalFileSystem, PyFileSystem

    adds = list(adds)
    paths = [unquote(add["path"]) for add in adds]
    local = urlparse(table_uri).scheme in ("", "file")
    if local:
        root = os.path.abspath(table_uri.removeprefix("file://"))
        files: Any = LocalFileSystem()
    else:
        sizes = {path: int(add["size"]) for path, add in zip(paths, adds, strict=True)}
        files = PyFileSystem(DeltaStorageHandler(table_uri, options, sizes))
    form = ds.ParquetFileFormat(
        default_fragment_scan_options=ds.ParquetFragmentScanOptions(pre_buffer=True)
    )
    fragments = []
    for path, add in zip(paths, adds, strict=True):
        where = pc.scalar(True)
        for column, value in (add.get("partitionValues") or {}).items():
            field = pc.field(column)
            if value is None:
                where = where & field.is_null()
            else:
                where = where & (field == pa.scalar(value).cast(schema.field(column).type))
        located = f"{root}/{path}" if local else path
        fragments.append(form.make_fragment(located, filesystem=files, partition_expression=where))
    return ds.FileSystemDataset(fragments, schema, form, files)


def _is_sorted(frame: pl.DataFrame, by: tuple[str, ...]) -> bool:
    """Whether `frame`'s rows are in the order `sort(by)` gives (one column; else: unknown)."""
    return frame.height < 2 or (len(by) == 1 and frame[by[0]].is_sorted())


class Lake:
    """A lake root (local path or object-store URI) and the Delta tables beneath it."""

    def __init__(self, uri: str, storage_options: Mapping[str, str] | None = None) -> None:
        self.is_remote = uri.startswith(REMOTE_SCHEMES)
        self.uri = uri.rstrip("/") if self.is_remote else str(Path(uri).expanduser().resolve())
        self.storage_options = dict(storage_options or {})
        self._writers: dict[str, DeltaTable] = {}
        self._latest_tables: dict[str, DeltaTable] = {}  # kept current by update_incremental
        # per kept handle (by id): the version it was opened at (see REOPEN_COMMITS)
        self._opened_at: dict[int, int] = {}
        self._refreshed_at: dict[str, float] = {}
        self._ensured: set[str] = set()
        # per table: the newest commit this lake made and its claw metadata (a writer that
        # reads back its own marker, e.g. silver's run marker, need not read the log for it)
        self._own_commits: dict[str, tuple[int, dict[str, Any]]] = {}
        self._lock = threading.RLock()
        # per table: appends of this lake whose first version was taken by another writer
        # (the store refused that conditional put and delta-rs committed at a later version)
        self.commit_conflicts: dict[str, int] = {}

    @classmethod
    def from_settings(cls, settings: ClawSettings | None = None) -> Lake:
        """The lake named by `CLAW_LAKE_URI` and `CLAW_STORAGE_OPTIONS`."""
        settings = settings or ClawSettings()
        return cls(settings.lake_uri, settings.storage_options)

    def __repr__(self) -> str:
        return f"Lake({self.uri!r})"

    def __reduce__(self):
        """Pickles as its URI and storage options (open tables are reopened where it lands)."""
        return Lake, (self.uri, self.storage_options)

    # -- naming -----------------------------------------------------------------------------
    def table_uri(self, name: str) -> str:
        """URI of table `name` (e.g. "bronze/events")."""
        if not name or name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"invalid table name {name!r}")
        return f"{self.uri}/{name}"

    def _options(self) -> dict[str, str] | None:
        return self.storage_options or None

    def verify_store(self) -> None:
        """Before this process first writes: the store must keep concurrent commits safe
        (claw_pipelines.lake.object_store; once per process and lake, nothing for a local lake)."""
        verify_lake_store(self.uri, self.storage_options)

    # -- plain files (curation specs) -------------------------------------------------------
    def _file_path(self, name: str) -> str:
        self.table_uri(name)  # same safety rules as table names
        return name if self.is_remote else f"{self.uri}/{name}"

    def write_text(self, name: str, text: str) -> None:
        """Write a small text file under the lake root (e.g. "specs/mine.yaml")."""
        path = self._file_path(name)
        if self.is_remote:
            write_bytes(self.uri, self.storage_options, path, text.encode())
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")

    def read_text(self, name: str) -> str | None:
        """A small text file under the lake root, or None when it does not exist."""
        path = self._file_path(name)
        if self.is_remote:
            data = read_bytes(self.uri, self.storage_options, path)
            return None if data is None else data.decode()
        return Path(path).read_text(encoding="utf-8") if Path(path).is_file() else None

    def list_files(self, folder: str, suffix: str = "") -> list[str]:
        """Names (relative to the lake root) of the files directly in `folder`."""
        path = self._file_path(folder)
        if self.is_remote:
            names = list_names(self.uri, self.storage_options, path)
        elif Path(path).is_dir():
            names = [p.name for p in Path(path).iterdir() if p.is_file()]
        else:
            names = []
        return sorted(f"{folder}/{n}" for n in names if n.endswith(suffix))

    def list_folders(self, folder: str) -> list[str]:
        """Names of the folders directly in `folder` (under the lake root)."""
        path = self._file_path(folder)
        if self.is_remote:
            return sorted(list_folders(self.uri, self.storage_options, path))
        if not Path(path).is_dir():
            return []
        return sorted(p.name for p in Path(path).iterdir() if p.is_dir())

    # -- metadata ---------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        """Whether table `name` has been created."""
        if name in self._latest_tables:  # a table this lake has opened stays
            return True
        return DeltaTable.is_deltatable(self.table_uri(name), storage_options=self._options())

    def column_names(self, name: str) -> list[str]:
        """The columns table `name` has now (its kept handle: no log replayed)."""
        return list(self._latest(name).schema().to_arrow().names)

    def open(self, name: str, version: int | None = None) -> DeltaTable:
        """The Delta table `name`, at `version` when given (time travel)."""
        return DeltaTable(self.table_uri(name), version=version, storage_options=self._options())

    def _latest(self, name: str) -> DeltaTable:
        """Table `name` at its newest version: one handle per table, brought up to date by
        reading only the commits it has not seen (opening a table replays its log). Calls
        within REFRESH_S of each other share one refresh; this lake's own writes are seen at
        once, other writers' within REFRESH_S (their commits would make a guarded write
        based on the older version conflict, never land on top of it)."""
        with self._lock:
            table = self._latest_tables.get(name)
            now = time.monotonic()
            if table is None:
                table = self._latest_tables[name] = self._kept(self.open(name))
            elif now - self._refreshed_at.get(name, -1.0) >= REFRESH_S:
                if self._may_have_moved(name, table.version()):
                    table.update_incremental()
                    table = self._latest_tables[name] = self._renewed(name, table)
            else:
                return table
            self._refreshed_at[name] = now
            return table

    def _kept(self, table: DeltaTable) -> DeltaTable:
        """Note the version a handle this lake keeps was opened at."""
        self._opened_at[id(table)] = table.version()
        return table

    def _renewed(self, name: str, table: DeltaTable) -> DeltaTable:
        """Kept handle `table` of `name`, opened again at its version when it has moved
        REOPEN_COMMITS past where it was opened (see REOPEN_COMMITS)."""
        version = table.version()
        if version - self._opened_at.setdefault(id(table), version) < REOPEN_COMMITS:
            return table
        self._opened_at.pop(id(table), None)
        return self._kept(self.open(name, version))

    def _may_have_moved(self, name: str, version: int) -> bool:
        """Whether table `name` may have a commit after `version`. On a local lake one look
        for the next log file answers (delta-rs would list the whole log, one stat per
        entry: a refresh would cost what the log holds); an object store lists from an
        offset, so delta-rs asks it."""
        if self.is_remote:
            return True
        return os.path.exists(f"{self.table_uri(name)}/_delta_log/{version + 1:020d}.json")

    def _wrote(self, name: str) -> None:
        """This lake committed to `name`: its next read refreshes the kept handle."""
        self._refreshed_at.pop(name, None)

    def _remember(self, name: str, version: int, commit: CommitProperties) -> None:
        """Keep the claw metadata of the commit this lake just made to `name` at `version`."""
        raw = (commit.custom_metadata or {}).get(COMMIT_METADATA_KEY)
        with self._lock:
            self._own_commits[name] = (version, json.loads(raw) if raw else {})

    def _own_commit(self, name: str, version: int) -> dict[str, Any] | None:
        """The claw metadata of version `version` of `name` if this lake made that commit."""
        kept = self._own_commits.get(name)
        return dict(kept[1]) if kept is not None and kept[0] == version else None

    def version(self, name: str) -> int | None:
        """Current version of table `name`, or None when it does not exist."""
        try:
            return self._latest(name).version()
        except TableNotFoundError:
            return None

    def ensure(self, spec: TableSpec | str) -> DeltaTable:
        """Create the table with its declared schema if it is missing (and add declared
        nullable columns an older table lacks); return it."""
        spec = _spec(spec)
        if spec.name in self._ensured:
            return self._latest(spec.name)
        self.verify_store()
        try:
            table = self.open(spec.name)
        except TableNotFoundError:
            table = None
        if table is None:
            try:
                created = DeltaTable.create(
                    self.table_uri(spec.name),
                    schema=spec.schema,
                    mode="ignore",
                    partition_by=list(spec.partition_by) or None,
                    name=spec.name.replace("/", "_"),
                    description=spec.description,
                    configuration={CHANGE_FEED_PROPERTY: "true"} if spec.change_feed else None,
                    storage_options=self._options(),
                )
                # only once it exists: another thread of this lake then opens it as it is
                self._ensured.add(spec.name)
                self._wrote(spec.name)
                return created
            except CommitFailedError:  # another process created it first
                table = self.open(spec.name)
        if spec.change_feed and table.metadata().configuration.get(CHANGE_FEED_PROPERTY) != "true":
            table.alter.set_table_properties({CHANGE_FEED_PROPERTY: "true"})  # older tables
        present = set(table.schema().to_arrow().names)
        missing = [f for f in spec.schema if f.name not in present and f.nullable]
        if missing:  # a column declared since the table was created
            table.alter.add_columns([Field.from_arrow(f) for f in missing])
        self._ensured.add(spec.name)
        self._wrote(spec.name)
        return table

    def transaction_version(self, name: str, app_id: str) -> int | None:
        """Latest transaction version committed by `app_id` to table `name`."""
        try:
            return self._latest(name).transaction_version(app_id)
        except TableNotFoundError:
            return None

    def _commits(self, name: str, newest: int, oldest: int = 0) -> Iterator[dict[str, Any]]:
        """Commit infos of table `name`, newest first, from version `newest` down to `oldest`
        (read in growing pages: usually the first few commits are all a caller needs)."""
        table = self._latest(name)  # the newest state's history numbers its versions right
        below, limit = newest + 1, table.version() - newest + 8
        while True:
            entries = table.history(limit=limit)
            for entry in entries:
                if oldest <= entry["version"] < below:
                    below = entry["version"]
                    yield entry
            if len(entries) < limit or below <= oldest:
                return
            limit *= 4

    def commit_metadata(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The claw metadata stored with a commit (the latest one by default)."""
        target = self._latest(name).version() if version is None else version
        own = self._own_commit(name, target)
        if own is not None:
            return own
        for entry in self._commits(name, target, target):
            return _claw_metadata(entry)
        return {}

    def commits_after(self, name: str, after: int) -> Iterator[tuple[int, dict[str, Any]]]:
        """(version, claw metadata) of the commits to table `name` after version `after`,
        newest first."""
        newest = self._latest(name).version()
        if newest > after:
            for entry in self._commits(name, newest, after + 1):
                yield int(entry["version"]), _claw_metadata(entry)

    def only_maintenance(self, name: str, after: int | None, until: int | None) -> bool:
        """Whether every commit to table `name` in versions `after`+1 .. `until` only
        maintained it (compaction: the same rows in fewer files), so a reader of version
        `after` holds what `until` holds."""
        if after is None or until is None or until < after:
            return False
        return all(
            "maintenance" in meta
            for version, meta in self.commits_after(name, after)
            if version <= until
        )

    def recent_commits(self, name: str, limit: int = 50) -> list[dict[str, Any]]:
        """The newest `limit` commits to table `name`, newest first: version, commit time
        (ms since the epoch) and claw metadata (empty when the table does not exist)."""
        newest = self.version(name)
        if newest is None:
            return []
        oldest = max(0, newest - limit + 1)
        return [
            {"version": int(e["version"]), "timestamp_ms": e.get("timestamp")}
            | {"metadata": _claw_metadata(e)}
            for e in self._commits(name, newest, oldest)
        ]

    def last_commit_with(
        self,
        name: str,
        key: str,
        at: int | None = None,
        *,
        equal: Any = None,
        without: str | None = None,
    ) -> tuple[int, dict[str, Any]] | None:
        """(version, claw metadata) of the newest commit at or before `at` whose metadata holds
        `key` (equal to `equal` when given; not holding `without`): commits without it, e.g.
        compactions, are passed over; None if there is none."""

        def fits(metadata: Mapping[str, Any]) -> bool:
            if key not in metadata or (without is not None and without in metadata):
                return False
            return equal is None or metadata[key] == equal

        newest = self._latest(name).version() if at is None else at
        own = self._own_commit(name, newest)
        if own is not None and fits(own):
            return newest, own
        for entry in self._commits(name, newest):
            metadata = _claw_metadata(entry)
            if fits(metadata):
                return int(entry["version"]), metadata
        return None

    # -- writes -----------------------------------------------------------------------------
    def _guarded(
        self,
        spec: TableSpec,
        guard: Guard,
        write: Callable[[DeltaTable], None],
        commit: CommitProperties,
        rebase: bool = True,
    ) -> int:
        """Run `write` (committing with `commit`) on the table as the guard's writer read
        it; the new version.

        A commit Delta refuses because of others' commits since (no commit of the guard's
        own writers or fences among them: another writer's share, e.g. another shard's keys
        or partition, or a compaction) is written again on the newest state when `rebase`
        (the write touches only the writer's own share, so what it computed still holds);
        otherwise, or when one of its own writers committed since, WriteConflict."""
        base = guard.read_versions[spec.name]
        self.verify_store()
        own = {*guard.app_ids, *guard.fences}
        with self._lock:
            latest = self._latest_tables.get(spec.name)
            if latest is not None and base is not None and rebase and latest.version() != base:
                latest = self._on_top(guard, spec.name, latest)
            table = latest if latest is not None and latest.version() >= (base or 0) else None
            if table is None or (not rebase and table.version() != base):
                table = self.open(spec.name, base)
            for _ in range(REBASES):
                guard.check_fences(table, spec.name)
                try:
                    write(table)
                    break
                except CommitFailedError as exc:
                    self._wrote(spec.name)  # someone else did: look again next time
                    conflict = WriteConflict(f"{spec.name}: {exc}".splitlines()[0])
                    if not rebase:
                        raise conflict from None
                    table = self.open(spec.name)
                    since = -1 if base is None else base
                    if self._transacted(spec.name, since, table.version(), own) is not False:
                        guard.check_fences(table, spec.name)  # a newer owner: Fenced
                        raise conflict from None  # one of its own writers: compute again
            else:
                raise WriteConflict(f"{spec.name}: lost {REBASES} times to other writers")
            self._wrote(spec.name)
            self._remember(spec.name, table.version(), commit)
            if table is latest:
                self._latest_tables[spec.name] = self._renewed(spec.name, table)
            return table.version()  # the table object now stands at its own commit

    def _on_top(self, guard: Guard, name: str, latest: DeltaTable) -> DeltaTable:
        """The kept handle of `name` brought to or past the guard's base, for a rebasable
        write to land on: what Delta would refuse and `_guarded` write again on the newer
        state anyway, without opening the table at the base (a replay of its log from a
        checkpoint). Fenced, or WriteConflict, when one of the guard's own writers or fences
        committed since the base (or the entries are gone)."""
        base = guard.read_versions[name]
        if latest.version() < base:
            self._wrote(name)
        table = self._latest(name)
        own = {*guard.app_ids, *guard.fences}
        if (
            table.version() > base
            and self._transacted(name, base, table.version(), own) is not False
        ):
            guard.check_fences(table, name)
            raise WriteConflict(f"{name}: its own writer committed since version {base}")
        return table

    def _log_entry(self, name: str, version: int) -> list[dict[str, Any]] | None:
        """The actions of version `version` of table `name` (its log entry), or None when
        the entry is gone (cleaned up after a checkpoint)."""
        text = self.read_text(f"{name}/_delta_log/{version:020d}.json")
        if text is None:
            return None
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def _transacted(self, name: str, after: int, until: int, app_ids: set[str]) -> bool | None:
        """Whether a commit of versions `after`+1 .. `until` of table `name` carries a
        transaction of one of `app_ids` (read from their log entries: only a refused write
        asks); None when an entry is gone (cleaned up: as good as yes)."""
        for version in range(after + 1, until + 1):
            actions = self._log_entry(name, version)
            if actions is None:
                return None
            if any(a.get("txn", {}).get("appId") in app_ids for a in actions):
                return True
        return False

    def fence(self, spec: TableSpec | str, app_id: str, token: int) -> int:
        """Record fencing token `token` of `app_id` in table `spec` (created if missing) with a
        commit that adds no rows: from then on a commit carrying a smaller token of it
        raises Fenced. Fenced itself if a larger one is there; the new version."""
        spec = _spec(spec)
        self.ensure(spec)
        empty = spec.schema.empty_table()
        for _ in range(50):
            guard = Guard((), 0, {spec.name: self.version(spec.name)}, {app_id: token})
            try:
                return self.append(spec, empty, guard=guard)
            except WriteConflict:  # another commit of app_id came first: look again
                continue
        raise WriteConflict(f"{spec.name}: could not record {app_id}'s token {token}")

    def append(
        self,
        spec: TableSpec | str,
        data: pa.Table,
        *,
        metadata: Mapping[str, Any] | None = None,
        transaction: tuple[str, int] | None = None,
        guard: Guard | None = None,
    ) -> int:
        """Append rows in one commit, conformed to the schema; return the new table version.

        `transaction` = (app_id, version) is recorded in the same commit, so a writer can ask
        `transaction_version` after a crash whether the batch already landed. With `guard`,
        the append lands only if no commit of the guard's writer reached the table since it
        read it (else WriteConflict).
        """
        spec = _spec(spec)
        if spec.sort_by:  # polars sorts list columns far faster than pyarrow's take
            frame = pl.from_arrow(data)
            assert isinstance(frame, pl.DataFrame)
            if not _is_sorted(frame, spec.sort_by):  # (a sort copies every column)
                data = frame.sort(spec.sort_by).to_arrow()
        rows = conform(data, spec.schema)
        properties = _writer(spec)
        if spec.shard_row_group_bytes and rows.num_rows:
            rows = with_shard_order(rows)
            per_row = max(1, rows.nbytes // rows.num_rows)
            properties = _writer(spec, max(1, spec.shard_row_group_bytes // per_row))
        txns = [Transaction(app_id=transaction[0], version=transaction[1])] if transaction else None
        commit = _commit(metadata, guard.transactions() if guard else txns)

        def write(table: DeltaTable) -> None:
            write_deltalake(
                table,
                rows,
                mode="append",
                partition_by=table.metadata().partition_columns or None,
                writer_properties=properties,
                commit_properties=commit,
            )

        if guard is not None:
            return self._guarded(spec, guard, write, commit)
        table = self._writers.get(spec.name)
        if table is None:
            self.ensure(spec)  # a handle of its own (the kept reading one is renewed apart)
            table = self._writers[spec.name] = self._kept(self.open(spec.name))
        base = table.version()
        write(table)
        self._wrote(spec.name)
        version = table.version()
        self._writers[spec.name] = self._renewed(spec.name, table)
        self._remember(spec.name, version, commit)
        if version > base + 1:  # another writer committed the version this one tried first
            self.commit_conflicts[spec.name] = self.commit_conflicts.get(spec.name, 0) + 1
        return version  # the handle stands at its own commit: the next append starts there

    def replace_partition(
        self,
        spec: TableSpec,
        data: pa.Table,
        column: str,
        value: int,
        *,
        metadata: Mapping[str, Any] | None = None,
        guard: Guard | None = None,
    ) -> int:
        """Replace exactly the rows where `column = value` (a predicate overwrite: other
        partitions are untouched, older versions stay readable); return the new version."""
        where = f"{column} = {int(value)}"
        return self.overwrite(spec, data, metadata=metadata, where=where, guard=guard)

    def overwrite(
        self,
        spec: TableSpec | str,
        data: pa.Table,
        *,
        metadata: Mapping[str, Any] | None = None,
        where: str | None = None,
        guard: Guard | None = None,
    ) -> int:
        """Replace the table's rows (only those matching the `where` predicate, when given)
        in one commit; older versions stay readable. Returns the new version.

        A whole-table overwrite lands only on the state it was based on (delta-rs would keep
        files that a concurrent commit added or compacted); unguarded, it is then based on the
        new state and written again, guarded it raises WriteConflict."""
        spec = _spec(spec)
        rows = conform(data, spec.schema)
        commit = _commit(
            metadata,
            guard.transactions() if guard else None,
            retries=0 if where is None else None,
        )

        def write(table: DeltaTable) -> None:
            write_deltalake(
                table,
                rows,
                mode="overwrite",
                predicate=where,
                partition_by=table.metadata().partition_columns or None,
                writer_properties=_writer(spec),
                commit_properties=commit,
            )

        return self._replacing(spec, guard, write, commit, rebase=where is not None)

    def _replacing(
        self,
        spec: TableSpec,
        guard: Guard | None,
        write: Callable[[DeltaTable], None],
        commit: CommitProperties,
        rebase: bool = True,
    ) -> int:
        """Commit a write that replaces rows: guarded, or unguarded based on the newest
        state and written again when a concurrent commit came first; the new version.
        (`rebase`: see `_guarded`.)"""
        if guard is not None:
            return self._guarded(spec, guard, write, commit, rebase)
        table = self.ensure(spec)
        written = _retry_conflicts(table, lambda: write(table))
        self._wrote(spec.name)
        self._remember(spec.name, written, commit)
        return written

    def upsert(
        self,
        spec: TableSpec | str,
        data: pa.Table,
        *,
        key: tuple[str, ...],
        within: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        guard: Guard | None = None,
    ) -> int:
        """Write rows in one commit (a merge), each replacing the stored row with its `key`,
        if any; stored rows no row replaces stay. `within`: a predicate every replaced row
        satisfies, naming stored columns as `stored.<column>` (it lets the merge pass over
        other files). Cheaper than a predicate overwrite listing the keys (delta-rs spends
        about 0.5 ms per listed key). Returns the new version."""
        spec = _spec(spec)
        rows = conform(data, spec.schema)
        commit = _commit(metadata, guard.transactions() if guard else None)
        on = " AND ".join(f"stored.{k} = given.{k}" for k in key)
        if within:
            on = f"{on} AND ({within})"

        def write(table: DeltaTable) -> None:
            table.merge(
                rows,
                predicate=on,
                source_alias="given",
                target_alias="stored",
                writer_properties=_writer(spec),
                commit_properties=commit,
            ).when_matched_update_all().when_not_matched_insert_all().execute()

        return self._replacing(spec, guard, write, commit)

    def maintain(self, name: str, retention_hours: int = 168) -> dict[str, Any]:
        """Compact small files, write a checkpoint, vacuum files unreferenced for longer than
        `retention_hours` and expired log entries. Safe beside appends: compaction only
        rewrites files (`dataChange = false`) and vacuum never drops a retained version's."""
        table, compacted = self._compact(name)
        table.update_incremental()
        table.create_checkpoint()
        removed = table.vacuum(retention_hours=retention_hours, dry_run=False)
        table.cleanup_metadata()
        self._wrote(name)
        return {
            "version": table.version(),
            "files_added": compacted.get("numFilesAdded", 0),
            "files_removed": compacted.get("numFilesRemoved", 0),
            "files_vacuumed": len(removed),
        }

    def compact(self, name: str, target_bytes: int | None = None) -> int:
        """Compact table `name`'s small files (what `maintain` does first, alone) into files
        of about `target_bytes` (delta-rs's default when None: files below it are rewritten,
        so a small target leaves big files alone); the number of files it replaced."""
        return int(self._compact(name, target_bytes)[1].get("numFilesRemoved", 0))

    def _compact(
        self, name: str, target_bytes: int | None = None
    ) -> tuple[DeltaTable, dict[str, Any]]:
        self.verify_store()
        table = self.open(name)
        try:
            spec = table_spec(name)  # files rewritten as the table's writes write them
            compacted = table.optimize.compact(
                target_size=target_bytes,
                writer_properties=None if spec is None else _writer(spec),
                commit_properties=_commit({"maintenance": "compact"}, retries=20),
            )
        except CommitFailedError:  # a writer replaced those files first: compact next time
            compacted = {"skipped": "a concurrent write replaced the files"}
        self._wrote(name)
        return table, compacted

    # -- reads ------------------------------------------------------------------------------
    def changes(
        self,
        name: str,
        after: int,
        until: int,
        columns: list[str] | None = None,
        where: pc.Expression | None = None,
        prune_only: bool = False,
    ) -> pa.Table | None:
        """Rows inserted by versions `after`+1 .. `until` (the change data feed), or None when
        the feed cannot answer (not enabled then, or the log was cleaned up): read it all.
        With `where`, only the rows it holds for (read from the row groups whose statistics
        allow it); with `prune_only` too, the whole row groups it may hold for when they are
        read from the files (a superset: the caller filters; no copy of the rows).

        Compaction rewrites files without changing data (`dataChange = false`): it adds nothing.
        """
        added = self.appended(name, after, until, columns, where, prune_only)
        if added is not None:
            return added
        # (a filter may name columns not asked for: the feed's rows then come whole)
        changed = self.change_feed(name, after, until, columns if where is None else None)
        if changed is None:
            return None
        kinds = changed.column("_change_type").unique().to_pylist() if changed.num_rows else []
        if set(kinds) - {"insert"}:
            return None  # rows were updated or deleted: not an append-only range
        changed = changed.drop_columns([c for c in CHANGE_COLUMNS if c in changed.column_names])
        if where is not None:  # (the feed's string views have no filter kernel)
            plain = [
                pa.field(f.name, pa.string()) if f.type == pa.string_view() else f
                for f in changed.schema
            ]
            changed = changed.cast(pa.schema(plain)).filter(where)
            if columns is not None:
                changed = changed.select([c for c in columns if c in changed.column_names])
        declared = TABLES[name].schema if name in TABLES else pa.schema([])
        for column in [c for c in columns or () if c not in changed.column_names]:
            kind = declared.field(column).type if column in declared.names else pa.string()
            changed = changed.append_column(column, pa.nulls(changed.num_rows, kind))
        return changed

    def appended(
        self,
        name: str,
        after: int,
        until: int,
        columns: list[str] | None = None,
        where: pc.Expression | None = None,
        prune_only: bool = False,
    ) -> pa.Table | None:
        """Rows versions `after`+1 .. `until` of table `name` added, read straight from the
        files they added (no change-feed machinery: a plain parquet read) when every one of
        them only appended or compacted other files; None when one removed or rewrote rows,
        compacted a file the range added, or its log entry is gone. A column declared since
        a file was written reads as nulls."""
        if until <= after:
            raise ValueError(f"empty version range ({after}, {until}]")
        added: dict[str, dict[str, Any]] = {}
        for version in range(after + 1, until + 1):
            actions = self._log_entry(name, version)
            if actions is None:
                return None
            for action in actions:
                if "cdc" in action:
                    return None
                if "remove" in action:
                    removed = action["remove"]
                    if removed.get("dataChange", True) or removed["path"] in added:
                        return None
                elif "add" in action and action["add"].get("dataChange", True):
                    if action["add"].get("deletionVector"):
                        return None
                    added[action["add"]["path"]] = action["add"]
        with self._lock:
            kept = self._latest(name)
            table = kept if kept.version() == until else self.open(name, until)
        schema = pa.schema(table.schema().to_arrow())
        wanted = [c for c in columns or schema.names if c in schema.names]
        try:
            read = _read_files(self.table_uri(name), self._options(), schema, added.values())
            if where is not None and prune_only:  # whole row groups, no row filter (a copy)
                read, where = row_groups_where(read, where), None
            found = read.to_table(columns=wanted, filter=where)
        except (OSError, DeltaError) as exc:  # a file vacuumed since: the feed says more
            log.info(
                "%s: reading versions %d..%d as files failed (%s)", name, after + 1, until, exc
            )
            return None
        for column in [c for c in columns or () if c not in wanted]:
            declared = TABLES[name].schema if name in TABLES else pa.schema([])
            kind = declared.field(column).type if column in declared.names else pa.string()
            found = found.append_column(column, pa.nulls(found.num_rows, kind))
        return found

    def versions_within(
        self, name: str, after: int, until: int, max_records: int, max_bytes: int
    ) -> int:
        """The newest version v <= `until` such that versions `after`+1 .. v of table `name`
        added at most `max_records` rows and `max_bytes` bytes of files (from their log
        entries' stats), and at least `after`+1; `until` when an entry or its stats are
        gone (the read decides then)."""
        records = size = 0
        for version in range(after + 1, until + 1):
            actions = self._log_entry(name, version)
            if actions is None:
                return until
            for action in actions:
                added = action.get("add")
                if added is None or not added.get("dataChange", True):
                    continue
                stats = json.loads(added.get("stats") or "{}")
                if "numRecords" not in stats:
                    return until
                records, size = records + stats["numRecords"], size + added.get("size", 0)
            if version > after + 1 and (records > max_records or size > max_bytes):
                return version - 1
        return until

    def changed_values(self, name: str, after: int, until: int, column: str) -> pl.Series | None:
        """The values of `column` in every row versions `after`+1 .. `until` inserted,
        updated or deleted (the change data feed; None when it cannot answer)."""
        if until <= after:
            return pl.Series(column, [], pl.String)
        changed = self.change_feed(name, after, until, [column])
        if changed is None:
            return None
        return pl.Series(column, changed.column(column)).unique()

    def change_feed(
        self, name: str, after: int, until: int, columns: list[str] | None
    ) -> pa.Table | None:
        """The change data feed of versions `after`+1 .. `until` (with `_change_type` and
        `_commit_version`), or None when it cannot answer (not enabled then, or the log was
        cleaned up)."""
        if until <= after:
            raise ValueError(f"empty version range ({after}, {until}]")
        try:
            with self._lock:  # the kept handle, at `until`, saves replaying the log
                kept = self._latest(name)
                table = kept if kept.version() == until else self.open(name, until)
                present = set(table.schema().to_arrow().names)
                wanted = None
                if columns is not None:  # a column declared since: nulls, added below
                    wanted = [*(c for c in columns if c in present), *CHANGE_COLUMNS[:2]]
                reader = table.load_cdf(
                    starting_version=after + 1, ending_version=until, columns=wanted
                )
                return pa.table(reader.read_all())
        except DeltaError as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if not _FEED_GONE.search(reason):
                raise
            log.info(
                "%s: the change feed does not cover versions %d..%d (%s): reading the table",
                name,
                after + 1,
                until,
                reason,
            )
            return None

    def scan(self, name: str, version: int | None = None) -> pl.LazyFrame:
        """A lazy polars scan of table `name` (at `version` when given)."""
        return pl.scan_delta(self.table_uri(name), version=version, storage_options=self._options())

    def batches(
        self, name: str, version: int | None, columns: list[str], rows: int = 262_144
    ) -> Iterator[pl.DataFrame]:
        """Table `name` (at `version`) a batch of about `rows` rows at a time, some columns
        (a column declared since the table was written reads as nulls): a read of a large
        table whose memory stays bounded."""
        table = self.open(name, version)
        present = set(table.schema().to_arrow().names)
        kept = [c for c in columns if c in present]
        scanner = table.to_pyarrow_dataset().scanner(
            columns=kept, batch_size=rows, batch_readahead=1, fragment_readahead=1
        )
        for batch in scanner.to_batches():
            frame = pl.from_arrow(pa.Table.from_batches([batch]))
            assert isinstance(frame, pl.DataFrame)
            missing = [pl.lit(None).alias(c) for c in columns if c not in present]
            yield frame.with_columns(missing).select(columns) if missing else frame

    def read(
        self,
        name: str,
        version: int | None = None,
        columns: list[str] | None = None,
        where: pl.Expr | None = None,
    ) -> pl.DataFrame:
        """Read table `name` into polars (optionally some columns, the rows matching `where`,
        at a version). A column declared since the table (or that version) was written reads
        as nulls."""

        def shaped(frame: pl.LazyFrame) -> pl.DataFrame:
            frame = frame if where is None else frame.filter(where)
            if columns is None:
                return frame.collect()
            have = set(frame.collect_schema().names())
            wanted = [
                pl.lit(None).alias(c) if isinstance(c, str) and c not in have else c
                for c in columns
            ]
            return frame.select(wanted).collect()

        with self._lock:  # a kept handle at that version saves replaying the log
            try:
                kept = self._latest(name)
            except TableNotFoundError:
                kept = None  # the scan below says so
            if kept is not None and version in (None, kept.version()):
                return shaped(pl.scan_delta(kept))  # read now: the handle moves on later
        return shaped(self.scan(name, version))
