"""Everything the dashboard reads, in one place: lazy lake scans of small columns, cached by
table version (so a new commit shows at once, and repeated interactions hit the cache)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import polars as pl
import streamlit as st

from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_CONSUMPTION,
    GOLD_LINEAGE,
    SILVER_FEEDBACK,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.delivery import UNIT_COLUMNS, consumer_positions, unit_keys
from claw_pipelines.lake import Lake
from claw_pipelines.ledger import gold_datasets, waste_ledger
from claw_pipelines.live import materializer_running
from claw_pipelines.settings import ClawSettings

TABLES = (
    BRONZE_EVENTS,
    SILVER_STEPS,
    SILVER_FEEDBACK,
    SILVER_TRAJECTORIES,
    SILVER_STEP_REWARDS,
    GOLD_LINEAGE,
    GOLD_CONSUMPTION,
)
SOURCE_OF_KIND = {
    "step": "white-box",
    "chat_completion": "black-box proxy",
    "completion": "black-box proxy",
    "feedback": "services",
    "event": "services",
    "trajectory_complete": "services",
}
TTL = 30


@dataclass(frozen=True)
class Where:
    """The lake the dashboard reads (and optional live services)."""

    lake_uri: str
    storage_options: str  # JSON, so the whole thing is hashable for caches
    gateway_url: str | None
    dagster_url: str | None

    def lake(self) -> Lake:
        """The lake."""
        return Lake(self.lake_uri, json.loads(self.storage_options))


def where() -> Where:
    """From `CLAW_` settings."""
    settings = ClawSettings()
    return Where(
        Lake.from_settings(settings).uri,
        json.dumps(settings.storage_options, sort_keys=True),
        settings.gateway_url,
        settings.dagster_url,
    )


@st.cache_data(ttl=5, show_spinner=False)
def versions(at: Where) -> dict[str, int | None]:
    """Current Delta version of every fixed table (None: not created yet)."""
    lake = at.lake()
    return {table: lake.version(table) for table in TABLES}


@st.cache_data(ttl=5, show_spinner=False)
def datasets(at: Where) -> list[str]:
    """Names of the gold datasets written so far (from lineage)."""
    return gold_datasets(at.lake())


def ledger(at: Where) -> pl.DataFrame:
    """The waste ledger of every dataset (cached per version of the gold tables it reads)."""
    lake = at.lake()
    names = tuple(datasets(at))
    tables = [f(name) for name in names for f in (gold_dataset_table, gold_rejection_table)]
    return _ledger(at, names, tuple(lake.version(t) for t in tables))


@st.cache_data(ttl=TTL, show_spinner=False)
def _ledger(at: Where, names: tuple[str, ...], table_versions: tuple[int | None, ...]):
    """The ledger at those table versions (they are only the cache key)."""
    return waste_ledger(at.lake(), list(names))


@st.cache_data(ttl=TTL, show_spinner=False)
def read(at: Where, table: str, version: int | None, columns: tuple[str, ...]) -> pl.DataFrame:
    """Some columns of a table at a version (cached per version)."""
    return at.lake().read(table, version=version, columns=list(columns))


def table(at: Where, name: str, columns: tuple[str, ...]) -> pl.DataFrame | None:
    """Some columns of a fixed table at its current version, or None when it does not exist."""
    version = versions(at).get(name)
    return None if version is None else read(at, name, version, columns)


@st.cache_data(ttl=TTL, show_spinner=False)
def records_per_second(at: Where, version: int) -> pl.DataFrame:
    """Bronze records per second by source, over time."""
    return (
        at.lake()
        .scan(BRONZE_EVENTS, version)
        .select("received_at", "kind")
        .with_columns(source=pl.col("kind").replace_strict(SOURCE_OF_KIND, default="other"))
        .group_by(pl.col("received_at").dt.truncate("1s").alias("second"), "source")
        .agg(records=pl.len())
        .sort("second")
        .collect()
    )


@st.cache_data(ttl=TTL, show_spinner=False)
def steps_matching(at: Where, version: int, column: str, value: str) -> pl.DataFrame:
    """Silver steps whose `column` equals `value` (filter pushed into the scan)."""
    return (
        at.lake()
        .scan(SILVER_STEPS, version)
        .filter(pl.col(column) == value)
        .sort("trajectory_uid", "step_index")
        .collect()
    )


@st.cache_data(ttl=TTL, show_spinner=False)
def bronze_event(at: Where, version: int, event_id: str) -> pl.DataFrame:
    """The bronze envelope of one record (its lineage)."""
    return (
        at.lake()
        .scan(BRONZE_EVENTS, version)
        .filter(pl.col("event_id") == event_id)
        .select("event_id", "kind", "tenant", "received_at", "gateway_id", "batch_seq", "payload")
        .collect()
    )


@st.cache_data(ttl=TTL, show_spinner=False)
def dataset_steps(at: Where, name: str, version: int, columns: tuple[str, ...]) -> pl.DataFrame:
    """Some columns of a gold dataset at a version."""
    return at.lake().read(gold_dataset_table(name), version=version, columns=list(columns))


@st.cache_data(ttl=TTL, show_spinner=False)
def tree_segments(at: Where, name: str, policy_version: int) -> pl.DataFrame:
    """A dataset partition's stored tree segments (without their tokens)."""
    return (
        at.lake()
        .scan(gold_tree_table(name))
        .filter(pl.col("policy_version") == policy_version)
        .select(
            "tree_id",
            "segment",
            "parent",
            "start_depth",
            "end_depth",
            "step_key",
            own=pl.col("tokens").list.len(),
        )
        .collect()
    )


def gateway_health(url: str | None) -> dict[str, float] | None:
    """A few gauges from the gateway's /metrics, or None when it does not answer."""
    if not url:
        return None
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", timeout=1.0).text
    except httpx.HTTPError:
        return None
    wanted = (
        "claw_gateway_records_total",
        "claw_gateway_requests_total",
        "claw_gateway_wal_backlog_bytes",
        "claw_gateway_wal_sealed_segments",
        "claw_gateway_rejected_requests_total",
        "claw_flusher_",
    )
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(wanted) and " " in line:
            series, _, value = line.rpartition(" ")
            name = series.split("{", 1)[0]
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return values


def open_page(title: str, needs: str) -> tuple[Where, dict[str, int | None]]:
    """Title a page and read every table's version; stop with help while `needs` is missing."""
    st.title(title)
    at = where()
    found = versions(at)
    if found[needs] is None:
        st.info(empty_lake_help())
        st.stop()
    return at, found


def open_dataset_page(title: str) -> tuple[Where, list[str]]:
    """Title a page about gold datasets; their names, or a stop with help while there are none."""
    st.title(title)
    at = where()
    names = datasets(at)
    if not names:
        st.info("No gold dataset yet. " + empty_lake_help())
        st.stop()
    return at, names


def empty_lake_help() -> str:
    """What to do on an empty lake."""
    return (
        "The lake is empty. Run `make demo` (or `claw demo`) to fill it with simulated "
        "agents, or point agents at `claw gateway`, then `claw materialize`."
    )


@st.cache_data(ttl=TTL, show_spinner=False)
def freshness(at: Where, name: str, version: int) -> pl.DataFrame:
    """Per prompt group of a gold dataset version, newest landed first: when its last step was
    acknowledged, when it became available to trainers, and the lag between (seconds)."""
    steps = at.lake().read(
        gold_dataset_table(name), version=version, columns=[*UNIT_COLUMNS, "created_at"]
    )
    return (
        steps.with_columns(unit=unit_keys(steps))
        .group_by("unit")
        .agg(last_ack=pl.col("created_at").max(), available_at=pl.col("landed_at").min())
        .drop_nulls("available_at")
        .with_columns(
            lag_s=(pl.col("available_at") - pl.col("last_ack")).dt.total_milliseconds() / 1000
        )
        .sort("available_at", descending=True)
    )


@st.cache_data(ttl=5, show_spinner=False)
def consumers(at: Where, name: str, version: int) -> pl.DataFrame:
    """Each consumer rank's position in a dataset: batches and groups taken, the newest policy
    version taken, when, and (live consumers) how many groups it has not been given yet."""
    lake = at.lake()
    positions = consumer_positions(lake, name)
    if positions.is_empty():
        return positions
    units = freshness(at, name, version).height
    taken = pl.col("groups").fill_null(0)
    world = (
        lake.read(GOLD_CONSUMPTION, columns=["dataset", "consumer", "world_size"])
        .filter(pl.col("dataset") == name)
        .group_by("consumer")
        .agg(world_size=pl.col("world_size").max().fill_null(1))
    )
    return (
        positions.join(world, on="consumer", how="left")
        .with_columns(
            not_yet_given=pl.when(taken > 0)
            .then((units / pl.col("world_size") - taken).round(0).clip(lower_bound=0))
            .otherwise(None)
        )
        .sort("consumer", "rank")
    )


def materializer_status(at: Where) -> bool:
    """Whether a live materializer is running on this lake (its heartbeat is fresh)."""
    return materializer_running(at.lake())
