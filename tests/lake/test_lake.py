"""The lake module on a local path and on S3 (a local moto server), with time travel."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import BRONZE_EVENTS, BRONZE_EVENTS_SPEC
from claw_pipelines.lake import delta
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import publish_policy_version
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.live import LiveMaterializer
from tests.support.lakes import group_of, land
from tests.support.s3 import moto_server, s3_options
from tests.support.servers import GatewayProcess, wait_until


def events(ids: list[str]) -> pa.Table:
    now = dt.datetime.now(dt.UTC)
    n = len(ids)
    return pa.table(
        {
            "event_id": ids,
            "kind": ["event"] * n,
            "tenant": ["t"] * n,
            "received_at": pa.array([now] * n, pa.timestamp("us", tz="UTC")),
            "ingest_date": [now.date()] * n,
            "gateway_id": ["g"] * n,
            "batch_seq": [1] * n,
            "schema_version": [1] * n,
            "payload": ["{}"] * n,
            # large types (as polars produces them) are conformed to the declared schema
            "prompt_ids": pa.array([[1, 2]] * n, pa.large_list(pa.int64())),
        }
    )


def exercise(lake: Lake) -> None:
    assert lake.version(BRONZE_EVENTS) is None and not lake.exists(BRONZE_EVENTS)
    lake.ensure(BRONZE_EVENTS_SPEC)
    assert lake.version(BRONZE_EVENTS) == 0
    assert lake.open(BRONZE_EVENTS).metadata().partition_columns == ["ingest_date"]
    v1 = lake.append(
        BRONZE_EVENTS, events(["a", "b"]), metadata={"batch": 1}, transaction=("gw-x", 1)
    )
    v2 = lake.append(BRONZE_EVENTS, events(["c"]), metadata={"batch": 2}, transaction=("gw-x", 2))
    assert (v1, v2) == (1, 2)
    assert lake.transaction_version(BRONZE_EVENTS, "gw-x") == 2
    assert lake.transaction_version(BRONZE_EVENTS, "someone-else") is None
    assert lake.commit_metadata(BRONZE_EVENTS, 1) == {"batch": 1}
    assert lake.commit_metadata(BRONZE_EVENTS) == {"batch": 2}
    assert sorted(lake.read(BRONZE_EVENTS)["event_id"]) == ["a", "b", "c"]
    assert sorted(lake.read(BRONZE_EVENTS, version=1)["event_id"]) == ["a", "b"]
    assert lake.read(BRONZE_EVENTS, columns=["prompt_ids"])["prompt_ids"].to_list()[0] == [1, 2]
    assert lake.open(BRONZE_EVENTS).schema().to_arrow() is not None


def test_local_lake_round_trip_and_time_travel(tmp_path):
    exercise(Lake(str(tmp_path / "lake")))


def test_table_names_cannot_escape_the_lake(tmp_path):
    lake = Lake(str(tmp_path))
    for bad in ("../etc", "/abs", ""):
        with pytest.raises(ValueError):
            lake.table_uri(bad)


@pytest.fixture(scope="module")
def s3_server():
    """A local S3-compatible server (moto) with one bucket."""
    with moto_server() as url:
        yield url


@pytest.mark.s3
def test_s3_lake_round_trip_and_time_travel(s3_server):
    exercise(Lake("s3://claw-lake/unit", s3_options(s3_server)))


@pytest.mark.s3
def test_gateway_lands_in_an_s3_lake(s3_server, tmp_path):
    uri = "s3://claw-lake/gateway"
    env = {
        "CLAW_STORAGE_OPTIONS": json.dumps(s3_options(s3_server)),
        "CLAW_WAL_DIR": str(tmp_path / "wal"),
        "CLAW_FLUSH_INTERVAL_MS": "50",
    }
    server = GatewayProcess(tmp_path / "unused", **env)
    server.env["CLAW_LAKE_URI"] = uri
    server.log_path = tmp_path / "gateway.log"
    with server:
        ids = httpx.post(server.url + "/v1/events", json={"type": "s3"}).json()["event_ids"]
        lake = Lake(uri, s3_options(s3_server))

        def landed():
            if not lake.version(BRONZE_EVENTS):
                return None
            return lake.read(BRONZE_EVENTS)["event_id"].to_list()

        assert wait_until(landed, what="s3 bronze") == ids


def test_maintenance_beside_concurrent_appends_never_fails_a_commit(tmp_path):
    """Compaction, checkpoints and vacuum run while another process-like writer appends:
    no commit fails, no row is lost or doubled, the change feed still answers."""
    lake = Lake(str(tmp_path / "lake"))
    lake.ensure(BRONZE_EVENTS_SPEC)
    writer_errors: list[BaseException] = []
    stop = threading.Event()

    def append_forever() -> None:
        own = Lake(lake.uri)  # a writer of its own, as the gateway's flusher is
        batch = 0
        try:
            while not stop.is_set() and batch < 60:
                own.append(BRONZE_EVENTS, events([f"e{batch}-{i}" for i in range(5)]))
                batch += 1
        except BaseException as exc:  # reported below: the test fails on any failed commit
            writer_errors.append(exc)

    writer = threading.Thread(target=append_forever)
    writer.start()
    results = []
    try:
        while writer.is_alive() or len(results) < 3:
            time.sleep(0.05)
            results.append(lake.maintain(BRONZE_EVENTS))
    finally:
        stop.set()
        writer.join()
    assert not writer_errors, writer_errors
    ids = lake.read(BRONZE_EVENTS)["event_id"]
    assert ids.n_unique() == ids.len() and ids.len() % 5 == 0 and ids.len() > 0
    assert any(r["files_removed"] > 0 for r in results)
    changes = lake.changes(BRONZE_EVENTS, 0, lake.version(BRONZE_EVENTS), columns=["event_id"])
    assert changes is not None and sorted(changes.column("event_id").to_pylist()) == sorted(ids)


@pytest.mark.s3
def test_the_online_loop_runs_on_an_s3_lake(s3_server):
    lake = Lake("s3://claw-lake/online", s3_options(s3_server))
    save_spec(lake, CurationSpec(name="live", complete_groups_only=True, merge="prompt_group"))
    publish_policy_version(lake, 2)
    land(lake, [*group_of("a", [1, 2], [1.0, 0.0], version=2), *group_of("b", [3], [0.5], 2)])
    live = LiveMaterializer(lake)
    assert live.step().changed  # silver, then the dataset: in increments, on S3
    dataset = Dataset(lake, "live")
    first = dataset.next_batch(consumer="s3-trainer", timeout=5)
    second = dataset.next_batch(consumer="s3-trainer", timeout=5)
    assert sorted([*first.groups, *second.groups]) == ["2:a", "2:b"]
    assert dataset.next_batch(consumer="s3-trainer", timeout=0.2) is None
    assert [b.groups for b in dataset.replay("s3-trainer")] == [first.groups, second.groups]


def test_the_change_feed_falls_back_only_when_its_versions_are_gone(tmp_path, caplog):
    """A range whose log was cleaned up reads the table instead (logged, with the reason);
    any other failure (here a data file that is not Parquet) is raised, not hidden."""
    lake = Lake(str(tmp_path / "lake"))
    lake.ensure(BRONZE_EVENTS_SPEC)
    for batch in range(3):
        lake.append(BRONZE_EVENTS, events([f"e{batch}"]))
    newest = lake.version(BRONZE_EVENTS)
    log_dir = tmp_path / "lake" / BRONZE_EVENTS / "_delta_log"
    lake.open(BRONZE_EVENTS).create_checkpoint()
    (log_dir / f"{1:020d}.json").unlink()
    with caplog.at_level("INFO", logger="claw_pipelines.lake.delta"):
        assert Lake(lake.uri).changes(BRONZE_EVENTS, 0, newest) is None
    assert "the change feed does not cover versions 1.." in caplog.text
    assert "Invalid table version" in caplog.text

    newest_file = max((tmp_path / "lake" / BRONZE_EVENTS).rglob("*.parquet"), key=_mtime)
    newest_file.write_bytes(b"not parquet")
    with pytest.raises(Exception, match=r"(?i)parquet|magic|invalid"):
        Lake(lake.uri).changes(BRONZE_EVENTS, newest - 1, newest)


def test_appended_rows_are_read_from_the_files_their_commits_added(tmp_path):
    """An append-only range is read from the files it added (partition column included),
    the same rows the change feed gives; a range that deleted rows, or compacted a file it
    added, is left to the feed (None)."""
    lake = Lake(str(tmp_path / "lake"))
    lake.ensure(BRONZE_EVENTS_SPEC)
    for batch in range(3):
        lake.append(BRONZE_EVENTS, events([f"e{batch}-a", f"e{batch}-b"]))
    columns = ["event_id", "ingest_date", "prompt_ids"]
    read = lake.appended(BRONZE_EVENTS, 1, 3, columns)
    fed = lake.change_feed(BRONZE_EVENTS, 1, 3, columns)
    assert read is not None and fed is not None
    assert read.column_names == columns
    assert sorted(read.to_pylist(), key=str) == sorted(fed.select(columns).to_pylist(), key=str)
    assert sorted(read.column("event_id").to_pylist()) == ["e1-a", "e1-b", "e2-a", "e2-b"]
    assert lake.changes(BRONZE_EVENTS, 1, 3, columns).num_rows == 4

    lake.compact(BRONZE_EVENTS)  # rewrites files 2 and 3 added: the feed answers instead
    assert lake.appended(BRONZE_EVENTS, 1, lake.version(BRONZE_EVENTS)) is None
    compacted = lake.version(BRONZE_EVENTS)
    lake.append(BRONZE_EVENTS, events(["e3"]))
    assert lake.appended(BRONZE_EVENTS, compacted, compacted + 1).column(
        "event_id"
    ).to_pylist() == ["e3"]
    lake.open(BRONZE_EVENTS).delete("event_id = 'e3'")
    assert lake.appended(BRONZE_EVENTS, compacted, compacted + 2) is None


def test_a_filtered_range_reads_the_same_rows_from_its_files_and_from_the_feed(tmp_path):
    """`changes(..., where=)` (a shard's range of `shard_order`, facts included) gives the
    rows the whole range holds that the filter keeps, read from the files a range added and,
    once they are compacted, from the change feed, with a column the filter names but the
    read does not ask for."""
    lake = Lake(str(tmp_path / "lake"))
    for batch in range(3):
        land(lake, [*group_of(f"a{batch}", [batch], [1.0]), *group_of(f"b{batch}", [5], [0.0])])
    newest = lake.version(BRONZE_EVENTS)
    low, high = Slot(0, 2).order_range()
    order = pc.field("shard_order")
    where = order.is_null() | ((order >= low) & (order < high))
    columns = ["event_id", "kind"]
    whole = lake.changes(BRONZE_EVENTS, 1, newest, ["event_id", "kind", "shard_order"])
    expected = sorted(whole.filter(where).column("event_id").to_pylist())
    assert 0 < len(expected) < whole.num_rows
    read = lake.changes(BRONZE_EVENTS, 1, newest, columns, where)
    assert read.column_names == columns
    assert sorted(read.column("event_id").to_pylist()) == expected
    lake.compact(BRONZE_EVENTS)  # the range's files rewritten: the change feed answers
    compacted = lake.version(BRONZE_EVENTS)
    assert lake.appended(BRONZE_EVENTS, 1, compacted) is None
    fed = lake.changes(BRONZE_EVENTS, 1, compacted, columns, where)
    assert fed.column_names == columns
    assert sorted(fed.column("event_id").to_pylist()) == expected


def _mtime(path: Path) -> float:
    return path.stat().st_mtime


def test_an_append_whose_version_another_writer_took_is_retried_and_counted(tmp_path):
    first, second = Lake(str(tmp_path / "lake")), Lake(str(tmp_path / "lake"))
    assert first.append(BRONZE_EVENTS, events(["a"])) == 1  # version 0 creates the table
    assert second.append(BRONZE_EVENTS, events(["b"])) == 2
    assert first.append(BRONZE_EVENTS, events(["c"])) == 3  # tried 2 first: taken
    assert first.commit_conflicts == {BRONZE_EVENTS: 1} and second.commit_conflicts == {}
    assert sorted(first.read(BRONZE_EVENTS)["event_id"]) == ["a", "b", "c"]


def test_kept_handles_are_opened_again_every_reopen_commits(tmp_path):
    """A long-running writer's handles do not carry every commit since they were opened
    (delta-rs makes each write through such a handle pay for them): every REOPEN_COMMITS
    commits the writer and the reader handle are opened afresh, and nothing changes."""
    lake = Lake(str(tmp_path / "lake"))
    lake.append(BRONZE_EVENTS, events(["e0"]))
    writer, reader = lake._writers[BRONZE_EVENTS], lake._latest(BRONZE_EVENTS)
    writers, readers = {id(writer)}, {id(reader)}
    for i in range(1, 2 * delta.REOPEN_COMMITS + 5):
        version = lake.append(BRONZE_EVENTS, events([f"e{i}"]), transaction=("gw", i))
        assert lake.version(BRONZE_EVENTS) == version  # reads see every commit at once
        writers.add(id(lake._writers[BRONZE_EVENTS]))
        readers.add(id(lake._latest(BRONZE_EVENTS)))
    assert len(writers) >= 3 and len(readers) >= 3  # opened again, twice at least
    newest = lake._writers[BRONZE_EVENTS]
    assert newest.version() - lake._opened_at[id(newest)] < delta.REOPEN_COMMITS
    assert lake.read(BRONZE_EVENTS)["event_id"].n_unique() == 2 * delta.REOPEN_COMMITS + 5
    assert lake.transaction_version(BRONZE_EVENTS, "gw") == 2 * delta.REOPEN_COMMITS + 4


def _published(versions: list[int], note: str) -> pa.Table:
    """gold/policy_versions rows (a small table with a key to merge on)."""
    from claw_pipelines.contracts.tables import GOLD_POLICY_VERSIONS_SPEC

    at = dt.datetime(2026, 12, 7, tzinfo=dt.UTC)
    return pa.Table.from_pydict(
        {
            "policy_version": versions,
            "published_at": [at] * len(versions),
            "published_by": ["test"] * len(versions),
            "note": [note] * len(versions),
        },
        schema=GOLD_POLICY_VERSIONS_SPEC.schema,
    )


def test_guarded_writes_of_other_writers_shares_are_rebased_and_their_own_conflict(tmp_path):
    """Delta refuses a merge after any concurrent commit to an unpartitioned table; a guarded
    write refused only for other writers' commits (another shard's keys) lands on the new
    state, one whose own writer committed since is computed again (WriteConflict), and a
    whole-table overwrite is never rebased."""
    from claw_pipelines.contracts.errors import WriteConflict
    from claw_pipelines.contracts.tables import GOLD_POLICY_VERSIONS

    lake = Lake(str(tmp_path / "lake"))
    lake.append(GOLD_POLICY_VERSIONS, _published([0], "first"))
    read = lake.version(GOLD_POLICY_VERSIONS)

    def guard(app: str) -> delta.Guard:
        return delta.Guard((app,), 1, {GOLD_POLICY_VERSIONS: read})

    def upsert(versions: list[int], app: str) -> int:
        key = ("policy_version",)
        rows = _published(versions, app)
        return lake.upsert(GOLD_POLICY_VERSIONS, rows, key=key, guard=guard(app))

    upsert([1], "share.a")
    upsert([2], "share.b")  # computed from `read` too: refused by Delta, rebased, lands
    with pytest.raises(WriteConflict):
        upsert([3], "share.a")  # its own writer committed since `read`
    with pytest.raises(WriteConflict):
        lake.overwrite(GOLD_POLICY_VERSIONS, _published([9], "all"), guard=guard("share.c"))
    with pytest.raises(WriteConflict):  # a predicate overwrite of share.b's, stale too
        lake.overwrite(
            GOLD_POLICY_VERSIONS,
            _published([2], "again"),
            where="policy_version = 2",
            guard=guard("share.b"),
        )
    rows = lake.read(GOLD_POLICY_VERSIONS).sort("policy_version")
    assert rows.select("policy_version", "note").rows() == [
        (0, "first"),
        (1, "share.a"),
        (2, "share.b"),
    ]


def test_threads_of_one_lake_ensuring_a_new_table_at_once_all_find_it(tmp_path):
    """Trainer ranks in threads of one process share a Lake: while one creates a table the
    others ask for, none is told it does not exist."""
    errors: list[BaseException] = []
    for attempt in range(5):
        lake = Lake(str(tmp_path / f"lake{attempt}"))
        start = threading.Barrier(4)

        def ensure(lake: Lake = lake, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                lake.ensure(BRONZE_EVENTS_SPEC)
                assert lake.version(BRONZE_EVENTS) is not None
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=ensure) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert not errors, errors
