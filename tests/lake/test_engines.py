"""Other engines read the lake: DuckDB (its Delta extension from the package index) and
pyarrow datasets read bronze, silver and gold, partitions and time travel included, and
every table declares the Delta protocol the README promises readers."""

from __future__ import annotations

import duckdb
import polars as pl
import pyarrow.dataset as ds
import pytest
from deltalake import DeltaTable
from duckdb_extensions import import_extension

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEPS, gold_dataset_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import DUCKDB_MACRO, arrow_with_prompt_ids, read_steps
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from tests.support.lakes import group_of, land

DATASET = gold_dataset_table("engines")
# table -> (partition columns, min reader version, min writer version): see the README
PROTOCOL = {
    BRONZE_EVENTS: (["ingest_date"], 1, 4),  # writer 4: the change data feed
    SILVER_STEPS: (["policy_version"], 1, 4),  # its change feed: what re-scoring reads
    "silver/feedback": ([], 1, 2),
    "silver/trajectories": ([], 1, 4),  # its change feed: the trajectories a run touched
    "silver/step_rewards": ([], 1, 2),
    "gold/lineage": ([], 1, 4),  # its change feed: what a trainer reads since it looked
    DATASET: (["policy_version"], 1, 4),  # its change feed: what live delivery applies
    "gold/trees/engines": (["policy_version"], 1, 2),
}


@pytest.fixture(scope="module")
def lake(tmp_path_factory) -> Lake:
    """Two policy versions through bronze, two silver runs (silver version 1 holds the
    first) and one gold partition per version."""
    lake = Lake(str(tmp_path_factory.mktemp("engines") / "lake"))
    land(lake, group_of("g1", [5, 6, 7], [1.0, 0.0], version=1, turns=2))
    build_silver(lake)
    land(lake, group_of("g2", [8, 9], [0.5, 1.0], version=2, turns=2))
    build_silver(lake)
    spec = CurationSpec(name="engines", reward_status=["pending", "missing", "final"])
    for version in (1, 2):
        build_partition(lake, spec, version)
    return lake


@pytest.fixture(scope="module")
def duck() -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    import_extension("delta", con=con)  # installs the packaged extension file: no network
    con.sql("LOAD delta")
    con.sql(DUCKDB_MACRO)  # claw_steps(uri): the documented reconstruction of whole prompts
    return con


def scan(lake: Lake, table: str, extra: str = "") -> str:
    return f"delta_scan('{lake.table_uri(table)}'{extra})"


def test_duckdb_reads_bronze_silver_and_gold_with_partitions_and_time_travel(lake, duck):
    for table in (BRONZE_EVENTS, SILVER_STEPS, DATASET):
        (count,) = duck.sql(f"SELECT count(*) FROM {scan(lake, table)}").fetchone()
        assert count == lake.read(table).height > 0
    gold = duck.sql(
        f"SELECT step_key, prompt_ids, response_ids FROM claw_steps('{lake.table_uri(DATASET)}') "
        "WHERE policy_version = 2 ORDER BY step_key"
    ).pl()
    ours = read_steps(lake, DATASET).filter(pl.col("policy_version") == 2).sort("step_key")
    assert gold["step_key"].to_list() == ours["step_key"].to_list()
    assert gold["prompt_ids"].to_list() == ours["prompt_ids"].to_list()
    assert gold["response_ids"].to_list() == ours["response_ids"].to_list()
    first = duck.sql(f"SELECT count(*) FROM {scan(lake, SILVER_STEPS, ', version => 1')}")
    assert first.fetchone()[0] == lake.read(SILVER_STEPS, version=1).height == 4
    assert lake.read(SILVER_STEPS).height == 8


def test_duckdb_and_pyarrow_rebuild_whole_prompts_from_stored_references(lake, duck):
    """Silver and gold keep a prompt relative to an earlier step (docs/DESIGN.md §18): the
    documented DuckDB macro and pyarrow call give every step's whole prompt, as ours do."""
    for table in (SILVER_STEPS, DATASET):
        stored = lake.read(table)
        assert stored["prefix_step_key"].drop_nulls().len() > 0  # later turns refer back
        assert stored["prompt_ids"].null_count() == stored.height
        ours = read_steps(lake, table).sort("step_key")
        theirs = duck.sql(
            f"SELECT * FROM claw_steps('{lake.table_uri(table)}') ORDER BY step_key"
        ).pl()
        assert theirs["step_key"].to_list() == ours["step_key"].to_list()
        assert theirs["prompt_ids"].to_list() == ours["prompt_ids"].to_list()
        assert theirs["response_ids"].to_list() == ours["response_ids"].to_list()
        assert "prompt_suffix_ids" not in theirs.columns
        arrow = arrow_with_prompt_ids(DeltaTable(lake.table_uri(table)).to_pyarrow_table())
        keys, prompts = arrow["step_key"].to_pylist(), arrow["prompt_ids"].to_pylist()
        by_key = dict(zip(keys, prompts, strict=True))
        assert [by_key[k] for k in ours["step_key"]] == ours["prompt_ids"].to_list()
    built = lake.read(BRONZE_EVENTS).filter(pl.col("kind") == "step")
    sent = {
        f"{t}:{i}": p
        for t, i, p in built.select("trajectory_uid", "step_index", "prompt_ids").rows()
    }
    silver = read_steps(lake, SILVER_STEPS)
    assert dict(zip(silver["step_key"], silver["prompt_ids"].to_list(), strict=True)) == sent


def test_pyarrow_datasets_read_every_layer_by_partition_and_version(lake):
    for table in (BRONZE_EVENTS, SILVER_STEPS, DATASET):
        dataset = DeltaTable(lake.table_uri(table)).to_pyarrow_dataset()
        assert dataset.count_rows() == lake.read(table).height
    gold = DeltaTable(lake.table_uri(DATASET)).to_pyarrow_dataset()
    one = gold.to_table(filter=ds.field("policy_version") == 1)
    expected = lake.read(DATASET).filter(pl.col("policy_version") == 1)
    assert sorted(one.column("step_key").to_pylist()) == sorted(expected["step_key"].to_list())
    then = DeltaTable(lake.table_uri(SILVER_STEPS), version=1).to_pyarrow_dataset()
    assert then.count_rows() == 4
    # protocol level: a plain Parquet dataset over exactly the files the log lists
    table = DeltaTable(lake.table_uri(SILVER_STEPS))
    files = ds.dataset(
        table.file_uris(), format="parquet", partitioning="hive", partition_base_dir=table.table_uri
    )
    assert files.count_rows() == 8


def test_tables_declare_the_protocol_and_partitions_readers_need(lake):
    for table, (partitions, reader, writer) in PROTOCOL.items():
        delta = DeltaTable(lake.table_uri(table))
        protocol = delta.protocol()
        assert delta.metadata().partition_columns == partitions, table
        assert (protocol.min_reader_version, protocol.min_writer_version) == (reader, writer)
        assert not protocol.reader_features and not protocol.writer_features, table


def test_pyarrow_filters_on_bronze_columns_find_their_rows(lake):
    """Bronze's micro-batches keep statistics on their scalar columns (not on token ids):
    delta-rs's pyarrow dataset takes a file without them for all nulls and a filter on the
    column would skip every file. The payload's are cut short."""
    import pyarrow as pa

    table = DeltaTable(lake.table_uri(BRONZE_EVENTS))
    dataset = table.to_pyarrow_dataset()
    rows = lake.read(BRONZE_EVENTS)
    for field, value in (("kind", "step"), ("tenant", rows["tenant"][0])):
        found = dataset.to_table(filter=ds.field(field) == value)
        expected = rows.filter(pl.col(field) == value)
        assert found.num_rows == expected.height > 0, field
    stats = pa.table(table.get_add_actions(flatten=True)).to_pylist()
    assert all(len(s["min.payload"]) <= 64 and len(s["max.payload"]) <= 65 for s in stats)
    assert all(s["null_count.kind"] == 0 for s in stats)


def test_list_columns_are_written_without_dictionaries_or_statistics_unless_compact(lake):
    """Token ids, log-probs and masks: no dictionary pages or statistics in silver and a
    dataset (delta-rs cannot name a list's leaf, so lists take the default); flat columns keep
    their dictionaries and statistics; gold's trees keep a dictionary of ids."""
    import pyarrow.parquet as pq

    def chunks(table: str) -> dict[str, list]:
        found: dict[str, list] = {}
        for path in DeltaTable(lake.table_uri(table)).file_uris():
            group = pq.ParquetFile(path).metadata.row_group(0)
            for i in range(group.num_columns):
                found.setdefault(group.column(i).path_in_schema, []).append(group.column(i))
        return found

    for table in (SILVER_STEPS, DATASET):
        columns = chunks(table)
        for leaf in ("prompt_suffix_ids.list.element", "response_ids.list.element"):
            assert columns[leaf], leaf
            for chunk in columns[leaf]:
                assert "RLE_DICTIONARY" not in chunk.encodings, (table, leaf)
                assert chunk.statistics is None or not chunk.statistics.has_min_max
        for chunk in columns["step_key"]:
            assert chunk.statistics.has_min_max and "RLE_DICTIONARY" in chunk.encodings
    trees = chunks("gold/trees/engines")["tokens.list.element"]
    assert trees and all("RLE_DICTIONARY" in chunk.encodings for chunk in trees)
