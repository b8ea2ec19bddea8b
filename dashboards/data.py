"""Everything the dashboard reads, in one place: lazy lake scans of small columns, cached by
table version (so a new commit shows at once, and repeated interactions hit the cache).

Every read is the caller's (`Where.caller`, set by the login gate): a tenant's reads are
filtered to its rows in the scan (`tenant` column; step rewards by its steps' keys; gold
tables by the datasets it owns), and every cache is keyed by `Where`, caller included, so a
frame cached for one tenant never serves another."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import altair as alt
import httpx
import polars as pl
import streamlit as st

from claw_pipelines.consume.dataset import Batch, Dataset
from claw_pipelines.consume.delivery import UNIT_COLUMNS, consumer_positions, unit_keys
from claw_pipelines.consume.feedback import FeedbackReport, feedback_report
from claw_pipelines.contracts.access import Caller
from claw_pipelines.contracts.errors import Forbidden
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    EXACT_TOKEN_SOURCES,
    GOLD_CONSUMPTION,
    GOLD_LINEAGE,
    GOLD_POLICY_VERSIONS,
    GOLD_TRAINER_FEEDBACK,
    SILVER_FEEDBACK,
    SILVER_STEP_CONFLICTS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
    STEP_KINDS,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.lake.catalog import gold_datasets, tenant_filter
from claw_pipelines.lake.decoding import resolver
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import with_prompts
from claw_pipelines.materialize import failing
from claw_pipelines.materialize.failing import FailingBuild
from claw_pipelines.materialize.gold import classified, source_versions
from claw_pipelines.materialize.live import materializer_running
from claw_pipelines.ops.ledger import LEDGER_SCHEMA, waste_ledger
from claw_pipelines.ops.shards import shard_statuses
from claw_pipelines.settings import ClawSettings
from claw_pipelines.tokenization import ChatTokenizer
from claw_pipelines.transforms.curation import (
    CANDIDATE_STEP_COLUMNS,
    GROUP,
    candidates,
    kept_steps,
)
from claw_pipelines.transforms.feedback import reward_by_policy_version
from dashboards.login import current_caller

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
    "traced_call": "traced (OpenTelemetry)",
    "span": "traced (OpenTelemetry)",
    "feedback": "services",
    "event": "services",
    "trajectory_complete": "services",
}
TTL = 30
# tables whose rows name their tenant, and gold tables whose rows name their dataset
TENANT_TABLES = (BRONZE_EVENTS, SILVER_STEPS, SILVER_STEP_CONFLICTS, SILVER_FEEDBACK)
TENANT_TABLES += (SILVER_TRAJECTORIES,)
DATASET_TABLES = (GOLD_LINEAGE, GOLD_CONSUMPTION, GOLD_TRAINER_FEEDBACK)
# silver's columns the step browser and the curation preview read: one cached read each
SILVER_COLUMNS = {
    SILVER_STEPS: (*CANDIDATE_STEP_COLUMNS, "created_at"),
    SILVER_STEP_REWARDS: ("step_key", "reward", "reward_status", "rating", "labels"),
    SILVER_TRAJECTORIES: (
        "trajectory_uid",
        "status",
        "resolved_return",
        "first_seen_at",
        "last_seen_at",
    ),
}


def frame_cache(ttl: int = TTL, max_entries: int = 16):
    """Cache a function that returns polars frames, shared between reruns and sessions (polars
    frames are immutable): unlike `st.cache_data`, no pickled copy is kept and unpickled per
    call, which on a large lake doubles memory."""
    return st.cache_resource(ttl=ttl, max_entries=max_entries, show_spinner=False)


@dataclass(frozen=True)
class Where:
    """The lake the dashboard reads (and optional live services)."""

    lake_uri: str
    storage_options: str  # JSON, so the whole thing is hashable for caches
    gateway_url: str | None
    dagster_url: str | None
    gateway_key: str | None = field(default=None, repr=False)  # a secret: never shown
    # whose data: part of every cache key, so one tenant's frames never serve another
    caller: Caller = field(default_factory=Caller.local)

    def lake(self) -> Lake:
        """The lake: one object per process, so its table handles are kept between reruns
        (a handle reads only the commits it has not seen; opening replays the log)."""
        return _lake(self.lake_uri, self.storage_options)


@st.cache_resource(show_spinner=False)
def _lake(uri: str, storage_options: str) -> Lake:
    return Lake(uri, json.loads(storage_options))


def where() -> Where:
    """From `CLAW_` settings, for the caller this session signed in as."""
    settings = ClawSettings()
    return Where(
        Lake.from_settings(settings).uri,
        json.dumps(settings.storage_options, sort_keys=True),
        settings.gateway_url,
        settings.dagster_url,
        settings.gateway_key,
        current_caller(),
    )


@st.cache_data(ttl=5, show_spinner=False)
def versions(at: Where) -> dict[str, int | None]:
    """Current Delta version of every fixed table (None: not created yet)."""
    lake = at.lake()
    return {table: lake.version(table) for table in TABLES}


@st.cache_data(ttl=5, show_spinner=False)
def datasets(at: Where) -> list[str]:
    """Names of the gold datasets written so far (from lineage) that the caller may read:
    a tenant's own; the shared ones (no tenant) are an admin's."""
    return gold_datasets(at.lake(), at.caller)


def require_dataset(at: Where, name: str) -> None:
    """Refuse (`Forbidden`) a dataset the caller may not read."""
    if not at.caller.sees_every_tenant and name not in datasets(at):
        raise Forbidden(f"dataset {name!r} is not tenant {at.caller.tenant!r}'s")


def rows_filter(at: Where, table: str) -> pl.Expr | None:
    """The rows of a fixed table the caller may read, as a filter for its scan (None: every
    row). A tenant reads its own rows (`tenant`), the rewards of its own steps, and the gold
    rows of its own datasets; every other table is an admin's."""
    caller = at.caller
    if caller.sees_every_tenant:
        return None
    if table in TENANT_TABLES:
        return tenant_filter(caller)
    if table == SILVER_STEP_REWARDS:
        return pl.col("step_key").is_in(tenant_step_keys(at).implode())
    if table in DATASET_TABLES:
        return pl.col("dataset").is_in(pl.Series(datasets(at), dtype=pl.String).implode())
    raise Forbidden(f"{table} holds every tenant's data: an admin's to read")


def _scope(at: Where, table: str) -> tuple:
    """What a tenant's rows of `table` depend on besides its version (a cache key part)."""
    if at.caller.sees_every_tenant:
        return ()
    if table == SILVER_STEP_REWARDS:
        return (versions(at)[SILVER_STEPS],)
    if table in DATASET_TABLES:
        return tuple(datasets(at))
    return ()


def tenant_step_keys(at: Where) -> pl.Series:
    """The step keys of the caller's silver steps (empty before silver exists)."""
    steps = table(at, SILVER_STEPS, ("step_key",))
    return pl.Series("step_key", [], pl.String) if steps is None else steps["step_key"]


def scan(at: Where, name: str, version: int | None = None) -> pl.LazyFrame:
    """A lazy scan of a fixed table holding only the caller's rows (the filter pushed into
    the scan)."""
    rows = at.lake().scan(name, version)
    where = rows_filter(at, name)
    return rows if where is None else rows.filter(where)


def ledger(at: Where, dataset: str | None = None) -> pl.DataFrame:
    """The waste ledger of one dataset, or of every one the caller may read (cached per
    version of the gold tables it reads: every such dataset's rows, for re-admissions)."""
    lake = at.lake()
    every = tuple(datasets(at))
    tables = [f(name) for name in every for f in (gold_dataset_table, gold_rejection_table)]
    tables.append(GOLD_POLICY_VERSIONS)  # what token-level staleness masks counts from
    names = every if dataset is None else tuple(n for n in every if n == dataset)
    return _ledger(at, names, tuple(lake.version(t) for t in tables))


@frame_cache()
def _ledger(at: Where, names: tuple[str, ...], table_versions: tuple[int | None, ...]):
    """The ledger at those table versions (they are only the cache key); a tenant's names
    only its own datasets among those that re-admitted its rejections."""
    if not names:
        return pl.DataFrame(schema=LEDGER_SCHEMA)
    found = waste_ledger(at.lake(), list(names))
    if at.caller.sees_every_tenant:
        return found
    mine = pl.Series(datasets(at), dtype=pl.String)
    return found.with_columns(
        pl.col("readmitted_by").list.filter(pl.element().is_in(mine.implode()))
    )


def read(at: Where, table: str, version: int | None, columns: tuple[str, ...]) -> pl.DataFrame:
    """Some columns of a fixed table's rows the caller may read, at a version (cached per
    version)."""
    return _read(at, table, version, columns, _scope(at, table))


@frame_cache()
def _read(
    at: Where, table: str, version: int | None, columns: tuple[str, ...], scope: tuple
) -> pl.DataFrame:
    """The read at that version and scope (the scope is only the cache key)."""
    where = rows_filter(at, table)
    return at.lake().read(table, version=version, columns=list(columns), where=where)


def table(at: Where, name: str, columns: tuple[str, ...]) -> pl.DataFrame | None:
    """Some columns of a fixed table at its current version, or None when it does not exist."""
    version = versions(at).get(name)
    return None if version is None else read(at, name, version, columns)


def rows_of_step(
    at: Where, name: str, step_key: str, trajectory_uid: str, columns: tuple[str, ...]
) -> pl.DataFrame | None:
    """Some columns of a fixed table's rows about one step: its `step_key`, its trajectory
    (where the table has one) and judge scores (feedback), filtered in the scan; None when
    the table does not exist."""
    version = versions(at).get(name)
    return (
        None
        if version is None
        else _rows_of_step(at, name, version, step_key, trajectory_uid, columns, _scope(at, name))
    )


@frame_cache()
def _rows_of_step(
    at: Where,
    name: str,
    version: int,
    step_key: str,
    trajectory_uid: str,
    columns: tuple,
    scope: tuple,
) -> pl.DataFrame:
    """The step's rows at a table version (of the caller's rows)."""
    where = pl.col("step_key") == step_key
    if "trajectory_uid" in columns:
        where = where | (pl.col("trajectory_uid") == trajectory_uid)
    if "judge" in columns:
        where = where | pl.col("judge").is_not_null()
    return scan(at, name, version).filter(where).select(columns).collect()


@frame_cache()
def records_per_second(at: Where, version: int, buckets: int = 240) -> pl.DataFrame:
    """Bronze records per second by source, over time, in at most `buckets` time buckets
    (every bucket present, zero when nothing arrived, so lines do not bridge gaps)."""
    frame = (
        scan(at, BRONZE_EVENTS, version)
        .select(
            "received_at", source=pl.col("kind").replace_strict(SOURCE_OF_KIND, default="other")
        )
        .collect()
    )
    if frame.is_empty():  # a gateway created the table, nothing flushed yet
        schema = {"time": frame["received_at"].dtype, "source": pl.String}
        return pl.DataFrame(schema=schema | {"records": pl.UInt32, "per_second": pl.Float64})
    first, last = frame["received_at"].min(), frame["received_at"].max()
    width_s = max(1, int(-(-(last - first).total_seconds() // buckets)))
    bucket = pl.col("received_at").dt.truncate(f"{width_s}s").alias("time")
    counts = frame.group_by(bucket, "source").agg(records=pl.len())
    grid = pl.DataFrame(
        {
            "time": pl.datetime_range(
                counts["time"].min(), counts["time"].max(), f"{width_s}s", eager=True
            )
        }
    ).join(counts.select("source").unique(), how="cross")
    return (
        grid.join(counts, on=["time", "source"], how="left")
        .with_columns(
            records=pl.col("records").fill_null(0),
            per_second=pl.col("records").fill_null(0) / width_s,
        )
        .sort("time", "source")
    )


@st.cache_resource(show_spinner=False)
def step_tokenizer(at: Where, fingerprint: str | None) -> ChatTokenizer | None:
    """The tokenizer a step names, as the lake keeps it (None: it names none, or one the
    lake does not hold)."""
    return resolver(at.lake(), None)(fingerprint)


@frame_cache()
def token_fidelity(at: Where, version: int) -> pl.DataFrame:
    """Per gateway (`gateway_id`; white-box steps too), the steps landed by token source
    and the share whose ids are exact (not `local_unverified`), from bronze's small
    columns."""
    counts = (
        scan(at, BRONZE_EVENTS, version)
        .filter(pl.col("kind").is_in(STEP_KINDS))
        .group_by("gateway_id", pl.col("token_source").fill_null("unknown"))
        .agg(steps=pl.len())
        .collect()
    )
    if counts.is_empty():
        return pl.DataFrame(schema={"gateway": pl.String, "steps": pl.UInt32})
    wide = counts.pivot("token_source", index="gateway_id", values="steps").fill_null(0)
    sources = [c for c in wide.columns if c != "gateway_id"]
    exact = [c for c in sources if c in EXACT_TOKEN_SOURCES]
    return (
        wide.with_columns(steps=pl.sum_horizontal(sources))
        .with_columns(
            exact_share=(pl.sum_horizontal(exact) if exact else pl.lit(0)) / pl.col("steps")
        )
        .rename({"gateway_id": "gateway"})
        .select("gateway", "steps", "exact_share", *sorted(sources))
        .sort("gateway")
    )


@frame_cache(ttl=5)
def bronze_lag(at: Where, version: int, commits: int = 50) -> pl.DataFrame:
    """Per gateway, over its newest bronze commits: records, and seconds from acknowledgement
    (received_at) to the commit that landed them (oldest record's and newest record's)."""
    lake = at.lake()
    landed = [
        {"gateway_id": c["metadata"]["gateway_id"], "batch_seq": c["metadata"]["batch_seq"]}
        | {"committed_ms": c["timestamp_ms"]}
        for c in lake.recent_commits(BRONZE_EVENTS, commits)
        if "batch_seq" in c["metadata"] and c["timestamp_ms"] is not None
    ]
    if not landed:
        return pl.DataFrame()
    batches = pl.DataFrame(landed)
    received = (
        scan(at, BRONZE_EVENTS, version)
        .select("gateway_id", "batch_seq", "received_at")
        .join(batches.lazy().select("gateway_id", "batch_seq"), on=["gateway_id", "batch_seq"])
        .group_by("gateway_id", "batch_seq")
        .agg(
            records=pl.len(),
            oldest=pl.col("received_at").min().dt.epoch("ms"),
            newest=pl.col("received_at").max().dt.epoch("ms"),
        )
        .collect()
    )
    waits = received.join(batches, on=["gateway_id", "batch_seq"]).with_columns(
        oldest_wait_s=(pl.col("committed_ms") - pl.col("oldest")) / 1000,
        newest_wait_s=(pl.col("committed_ms") - pl.col("newest")) / 1000,
    )
    return (
        waits.group_by("gateway_id")
        .agg(
            commits=pl.len(),
            records=pl.col("records").sum(),
            lag_p50_s=pl.col("oldest_wait_s").median().round(2),
            lag_max_s=pl.col("oldest_wait_s").max().round(2),
            last_commit=pl.from_epoch(pl.col("committed_ms").max(), time_unit="ms"),
        )
        .sort("gateway_id")
    )


@frame_cache(ttl=5)
def latest_records(at: Where, version: int, count: int = 50) -> pl.DataFrame:
    """The newest bronze records (their envelope and source), newest first."""
    return (
        scan(at, BRONZE_EVENTS, version)
        .select("received_at", "kind", "tenant", "gateway_id", "trajectory_uid", "event_id")
        .top_k(count, by="received_at")
        .sort("received_at", descending=True)
        .collect()
        .with_columns(source=pl.col("kind").replace_strict(SOURCE_OF_KIND, default="other"))
    )


@frame_cache()
def steps_matching(at: Where, version: int, column: str, value: str) -> pl.DataFrame:
    """Silver steps whose `column` equals `value` (filter pushed into the scan), with their
    whole prompts (silver keeps a prompt relative to an earlier step: docs/DESIGN.md §18)."""
    rows = (
        scan(at, SILVER_STEPS, version)
        .filter(pl.col(column) == value)
        .sort("trajectory_uid", "step_index")
        .collect()
    )
    return with_prompts(at.lake(), SILVER_STEPS, version, rows)


@frame_cache()
def bronze_event(at: Where, version: int, event_id: str) -> pl.DataFrame:
    """The bronze envelope of one record (its lineage)."""
    return (
        scan(at, BRONZE_EVENTS, version)
        .filter(pl.col("event_id") == event_id)
        .select("event_id", "kind", "tenant", "received_at", "gateway_id", "batch_seq", "payload")
        .collect()
    )


@frame_cache()
def dataset_steps(at: Where, name: str, version: int, columns: tuple[str, ...]) -> pl.DataFrame:
    """Some columns of a gold dataset at a version."""
    require_dataset(at, name)
    return at.lake().read(gold_dataset_table(name), version=version, columns=list(columns))


DIFF_COLUMNS = ("step_key", "policy_version", "reward", "advantage")


@frame_cache()
def version_diff(at: Where, name: str, old: int, new: int) -> pl.DataFrame:
    """The steps whose rows differ between two versions of a dataset (step_key,
    policy_version, reward and advantage `_before` and now; null: absent), cached. From the
    dataset's change feed when it covers old..new (each step's first change tells its row
    before, its last its row after), else by comparing the two versions whole."""
    require_dataset(at, name)
    lake, table = at.lake(), gold_dataset_table(name)
    feed = lake.change_feed(table, old, new, list(DIFF_COLUMNS)) if old < new else None
    if feed is not None:
        events = pl.from_arrow(feed).with_columns(
            gone=pl.col("_change_type").is_in(["delete", "update_preimage"])
        )
        events = events.sort("_commit_version", pl.col("gone").not_(), maintain_order=True)
        first = events.group_by("step_key", maintain_order=True).first().filter("gone")
        last = events.group_by("step_key", maintain_order=True).last().filter(~pl.col("gone"))
        before, after = first.select(DIFF_COLUMNS), last.select(DIFF_COLUMNS)
    else:
        before = dataset_steps(at, name, old, DIFF_COLUMNS)
        after = dataset_steps(at, name, new, DIFF_COLUMNS)
    both = after.join(before, on="step_key", how="full", coalesce=True, suffix="_before")
    same = (
        pl.col("policy_version").eq_missing(pl.col("policy_version_before"))
        & pl.col("reward").eq_missing(pl.col("reward_before"))
        & pl.col("advantage").eq_missing(pl.col("advantage_before"))
    )
    return both.filter(~same)


@frame_cache()
def dataset_partitions(at: Where, name: str, version: int) -> list[int]:
    """The policy versions a dataset version holds (cached per version)."""
    return Dataset(at.lake(), name, version, caller=at.caller).policy_versions()


@frame_cache()
def first_batch(
    at: Where, name: str, version: int, policy_version: int, size: int, layout: str
) -> Batch | None:
    """The first batch `Dataset.batches` yields for these arguments (cached: a dataset
    version never changes)."""
    dataset = Dataset(at.lake(), name, version, caller=at.caller)
    batches = dataset.batches(policy_version, size, layout=layout)
    return next(batches, None)


@frame_cache()
def tree_segments(at: Where, name: str, policy_version: int) -> pl.DataFrame:
    """A dataset partition's stored tree segments (without their tokens)."""
    require_dataset(at, name)
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
            own=pl.col("end_depth") - pl.col("start_depth"),  # no token column read
        )
        .collect()
    )


def curation_candidates(at: Where) -> pl.DataFrame | None:
    """Every silver step with its reward and trajectory facts (no tokens), or None."""
    keys = silver_versions(at)
    return None if keys[0] is None else _candidates(at, keys)


def silver_versions(at: Where) -> tuple[int | None, ...]:
    """The versions of the silver tables the step browser and the preview read (their
    caches' key), in SILVER_COLUMNS order."""
    found = versions(at)
    return tuple(found[t] for t in SILVER_COLUMNS)


@frame_cache(ttl=TTL, max_entries=4)
def _candidates(at: Where, table_versions: tuple[int | None, ...]) -> pl.DataFrame:
    """The candidates at those table versions (they are only the cache key)."""
    steps, rewards, trajectories = (table(at, t, c) for t, c in SILVER_COLUMNS.items())
    return candidates(steps, rewards, trajectories)


def reward_by_version(at: Where) -> pl.DataFrame | None:
    """Reward by policy version over every silver step (`reward_by_policy_version`: steps,
    rewarded steps, their mean, lowest and highest reward), cached per silver version; None
    before silver exists. Read from two narrow columns of steps and step rewards (the
    Overview opens on it: the curation candidates cost seconds at millions of steps)."""
    keys = silver_versions(at)
    return None if keys[0] is None else _reward_by_version(at, keys)


@frame_cache(ttl=TTL, max_entries=4)
def _reward_by_version(at: Where, table_versions: tuple[int | None, ...]) -> pl.DataFrame:
    steps = table(at, SILVER_STEPS, ("step_key", "policy_version"))
    rewards = table(at, SILVER_STEP_REWARDS, ("step_key", "reward", "reward_status"))
    assert steps is not None
    if rewards is None:
        rewards = pl.DataFrame(schema={"step_key": pl.String, "reward": pl.Float64})
        rewards = rewards.with_columns(reward_status=pl.lit(None, pl.String))
    # joined on the keys' 64-bit hashes (half the time of the strings at 2 M steps), exact
    # when no two keys of a side share one: every reward's step is a silver step, so a
    # reward hashing like another step would make two steps share a hash
    hashed = [frame.with_columns(step_key=pl.col("step_key").hash()) for frame in (steps, rewards)]
    if any(frame["step_key"].n_unique() < frame.height for frame in hashed):
        hashed = [steps, rewards]
    return reward_by_policy_version(hashed[0].join(hashed[1], on="step_key", how="left"))


def candidate_choices(at: Where) -> dict[str, list]:
    """The values the Curation form offers (finish reasons, tenants, policy versions,
    labels), sorted, cached with the candidates."""
    keys = silver_versions(at)
    return _choices(at, keys)


@frame_cache(ttl=TTL, max_entries=4)
def _choices(at: Where, table_versions: tuple[int | None, ...]) -> dict[str, list]:
    frame = curation_candidates(at)
    columns = ("finish_reason", "tenant", "policy_version")
    found = {c: frame[c].drop_nulls().unique().sort().to_list() for c in columns}
    return found | {"labels": frame["labels"].explode().drop_nulls().unique().sort().to_list()}


def curation_preview(at: Where, spec: CurationSpec) -> pl.DataFrame:
    """Every candidate classified by `spec` (`gold.classified`), cached per spec and the
    versions it reads (a spec that re-admits from another dataset is classified afresh)."""
    lake = at.lake()
    sources = source_versions(lake)
    if spec.readmit is not None:
        return classified(lake, spec, sources, curation_candidates(at))
    return _preview(at, spec.model_dump_json(), json.dumps(sources, sort_keys=True))


@frame_cache(max_entries=4)
def _preview(at: Where, spec_json: str, sources_json: str) -> pl.DataFrame:
    """The preview of that spec at those versions (they are the cache key)."""
    spec = CurationSpec.model_validate_json(spec_json)
    return classified(at.lake(), spec, json.loads(sources_json), curation_candidates(at))


@dataclass(frozen=True)
class PreviewSummary:
    """What the Curation page shows of a spec's preview: counts and chart frames only."""

    steps: int
    kept: int
    trajectories: int
    groups: int
    in_complete_groups: int
    left_out: pl.DataFrame  # per reason: steps, tokens
    bins: dict[str, pl.DataFrame]  # per column: histogram_bins of the kept steps
    staleness: pl.DataFrame  # kept steps per policy versions behind the newest

    HISTOGRAMS = (("reward", "reward"), ("response_len", "response tokens"))


def preview_summary(at: Where, spec: CurationSpec) -> PreviewSummary:
    """The summary of `curation_preview` (cached with it)."""
    if spec.readmit is not None:
        return _summary(curation_preview(at, spec), spec)
    sources = json.dumps(source_versions(at.lake()), sort_keys=True)
    return _cached_summary(at, spec.model_dump_json(), sources)


@frame_cache(max_entries=4)
def _cached_summary(at: Where, spec_json: str, sources_json: str) -> PreviewSummary:
    spec = CurationSpec.model_validate_json(spec_json)
    return _summary(_preview(at, spec_json, sources_json), spec)


def _summary(rows: pl.DataFrame, spec: CurationSpec) -> PreviewSummary:
    kept = kept_steps(rows, spec)
    newest = rows["policy_version"].max() if rows.height else 0
    left_out = (
        rows.filter(pl.col("reason").is_not_null())
        .group_by("reason")
        .agg(steps=pl.len(), tokens=(pl.col("prompt_len") + pl.col("response_len")).sum())
    )
    return PreviewSummary(
        steps=rows.height,
        kept=kept.height,
        trajectories=kept["trajectory_uid"].n_unique(),
        groups=kept[GROUP].n_unique(),
        in_complete_groups=kept.filter(pl.col("group_complete")).height if kept.height else 0,
        left_out=left_out,
        bins={c: histogram_bins(kept, c) for c, _ in PreviewSummary.HISTOGRAMS},
        staleness=kept.group_by(staleness=newest - pl.col("policy_version")).agg(steps=pl.len()),
    )


def step_table(at: Where) -> pl.DataFrame:
    """One row per silver step for browsing (ids, group, reward, statuses, version, time)."""
    keys = silver_versions(at)
    return _step_table(at, keys)


@frame_cache(ttl=TTL, max_entries=4)
def _step_table(at: Where, table_versions: tuple[int | None, ...]) -> pl.DataFrame:
    """The step table at those table versions (they are only the cache key): silver's
    columns joined, none of curation's derived ones (no retry detection over all steps)."""
    steps, rewards, trajectories = (table(at, t, c) for t, c in SILVER_COLUMNS.items())
    rewards = rewards.select("step_key", "reward", "reward_status")
    trajectories = trajectories.select("trajectory_uid", "status")
    return (
        steps.join(rewards, on="step_key", how="left")
        .join(trajectories.rename({"status": "trajectory_status"}), on="trajectory_uid", how="left")
        .with_columns(
            pl.col("policy_version").fill_null(0),
            pl.col("reward_status").fill_null("pending"),
            pl.coalesce("prompt_uid", "trajectory_uid").alias(GROUP),
        )
        .select(
            "step_key",
            "trajectory_uid",
            "group_key",
            "step_index",
            "policy_version",
            "reward",
            "reward_status",
            "trajectory_status",
            "tenant",
            "prompt_len",
            "response_len",
            "created_at",
            pl.col("fragment").fill_null(0),
            "fragment_reason",
        )
    )


def trajectory_fragments(turns: pl.DataFrame) -> pl.DataFrame:
    """One row per fragment of a trajectory (its steps from `step_table`): where it starts,
    why (null for the first), and its steps and tokens."""
    return (
        turns.sort("step_index")
        .group_by("fragment", maintain_order=True)
        .agg(
            reason=pl.col("fragment_reason").first(),
            first_step=pl.col("step_index").min(),
            last_step=pl.col("step_index").max(),
            steps=pl.len(),
            prompt_tokens_at_start=pl.col("prompt_len").first(),
            response_tokens=pl.col("response_len").sum(),
        )
        .sort("fragment")
    )


def fragments_per_trajectory(steps: pl.DataFrame) -> pl.DataFrame:
    """How many trajectories have 1, 2, ... fragments, and the reasons their fragments
    started for (from `step_table`)."""
    counts = steps.group_by("trajectory_uid").agg(fragments=pl.col("fragment").max() + 1)
    reasons = (
        steps.filter(pl.col("fragment_reason").is_not_null())
        .join(counts, on="trajectory_uid")
        .group_by("fragments")
        .agg(reasons=pl.col("fragment_reason").unique().sort())
    )
    return (
        counts.group_by("fragments")
        .agg(trajectories=pl.len())
        .join(reasons, on="fragments", how="left")
        .sort("fragments")
    )


def lineage_table(lineage: pl.DataFrame) -> pl.DataFrame:
    """Lineage rows with each source table's version in its own column (not JSON)."""
    sources = lineage["source_versions"].str.json_decode().struct.unnest()
    sources = sources.rename({c: f"source {c}" for c in sources.columns})
    return pl.concat([lineage.drop("source_versions"), sources], how="horizontal")


def distinct(frame: pl.DataFrame, column: str) -> list:
    """The sorted non-null values of a column."""
    return frame[column].drop_nulls().unique().sort().to_list()


def records_chart(per_second: pl.DataFrame, bars: bool = False) -> alt.Chart:
    """Records per second by source over time (from `records_per_second`), lines or bars."""
    base = alt.Chart(per_second.to_pandas())
    return (base.mark_bar() if bars else base.mark_line()).encode(
        alt.X("time:T", title="received at"),
        alt.Y("per_second:Q", title="records / s"),
        alt.Color("source:N", title="source"),
        tooltip=["time", "source", "records"],
    )


def reward_chart(by_version: pl.DataFrame) -> alt.Chart:
    """Mean reward per policy version (a line), between its lowest and highest (a band)."""
    frame = by_version.filter(pl.col("rewarded") > 0).to_pandas()
    x = alt.X("policy_version:Q", title="policy version", axis=alt.Axis(tickMinStep=1))
    band = (
        alt.Chart(frame)
        .mark_area(opacity=0.2)
        .encode(x, alt.Y("min_reward:Q", title="reward"), alt.Y2("max_reward:Q"))
    )
    line = (
        alt.Chart(frame)
        .mark_line(point=True)
        .encode(
            x,
            alt.Y("mean_reward:Q", title="reward"),
            tooltip=["policy_version", "mean_reward", "rewarded", "steps"],
        )
    )
    return band + line


def histogram_bins(frame: pl.DataFrame, column: str) -> pl.DataFrame:
    """30 bins of `column` (start, end, count), binned in polars: the browser gets the bins,
    not the rows."""
    values = frame[column].drop_nulls()
    if values.is_empty():
        values = pl.Series(column, [0.0])
    low, high = float(values.min()), float(values.max())
    width = (high - low) / 30 or 1.0
    return (
        values.to_frame()
        .group_by(start=((pl.col(column) - low) / width).floor().clip(upper_bound=29) * width + low)
        .agg(count=pl.len())
        .with_columns(end=pl.col("start") + width)
    )


def histogram_chart(bins: pl.DataFrame, title: str, unit: str) -> alt.Chart:
    """A histogram of `histogram_bins`."""
    return (
        alt.Chart(bins.to_pandas())
        .mark_bar()
        .encode(
            alt.X("start:Q", title=title, bin="binned"),
            alt.X2("end:Q"),
            alt.Y("count:Q", title=unit),
            tooltip=["start", "end", "count"],
        )
    )


@dataclass(frozen=True)
class GatewayScrape:
    """One gateway's /metrics, parsed: samples by series name, each (labels, value)."""

    url: str
    samples: dict[str, list[tuple[dict[str, str], float]]]

    def total(self, name: str) -> float:
        """The sum of a series over its labels (0 when absent)."""
        return sum(value for _, value in self.samples.get(name, []))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """A series summed per value of one label."""
        out: dict[str, float] = {}
        for labels, value in self.samples.get(name, []):
            out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + value
        return out

    def identity(self) -> tuple[str, str] | None:
        """(gateway_id, lake uri) from `claw_gateway_info`, or None for an older gateway."""
        for labels, _ in self.samples.get("claw_gateway_info", []):
            return labels.get("gateway_id", ""), labels.get("lake", "")
        return None


def _labels(text: str) -> dict[str, str]:
    """`a="x",b="y"` as a dict (our label values hold no quotes or commas)."""
    pairs = (part.split("=", 1) for part in text.split(",") if "=" in part)
    return {key.strip(): value.strip().strip('"') for key, value in pairs}


def scrape_gateway(url: str, key: str | None = None) -> GatewayScrape | None:
    """A gateway's /metrics (sending `key` when given), or None when it does not answer 200."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=1.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in response.text.splitlines():
        if not line.startswith("claw_") or " " not in line:
            continue
        series, _, value = line.rpartition(" ")
        name, _, rest = series.partition("{")
        try:
            samples.setdefault(name, []).append((_labels(rest.rstrip("}")), float(value)))
        except ValueError:
            continue
    return GatewayScrape(url, samples)


def open_page(title: str, needs: str) -> tuple[Where, dict[str, int | None]]:
    """Title a page and read every table's version; stop with help while `needs` is missing."""
    st.title(title)
    at = where()
    found = versions(at)
    if found[needs] is None:
        st.info(empty_lake_help(at))
        st.stop()
    return at, found


def open_dataset_page(title: str) -> tuple[Where, list[str]]:
    """Title a page about gold datasets; their names, or a stop with help while there are none."""
    st.title(title)
    at = where()
    names = datasets(at)
    if not names and not is_admin(at):
        st.info(
            f"No dataset of tenant `{at.caller.tenant}` yet: save a spec on the Curation page "
            "(it curates your steps only), then build it."
        )
        st.stop()
    if not names:
        st.info("No gold dataset yet. " + empty_lake_help(at))
        st.stop()
    return at, names


def empty_lake_help(at: Where | None = None) -> str:
    """What to do on an empty lake (or, for a tenant, one that holds nothing of its own)."""
    if at is not None and not at.caller.sees_every_tenant:
        return (
            f"No data of tenant `{at.caller.tenant}` here yet: point agents at `claw gateway` "
            "with one of its keys, then `claw materialize` (its datasets come from specs of "
            "this tenant, saved on the Curation page)."
        )
    return (
        "The lake is empty. Run `make demo` (or `claw demo`) to fill it with simulated "
        "agents, or point agents at `claw gateway`, then `claw materialize`."
    )


def is_admin(at: Where) -> bool:
    """Whether the caller reads every tenant (an admin, or local mode): what is not per
    tenant (gateway /metrics, Dagster runs, table versions) is shown to it only."""
    return at.caller.sees_every_tenant


@frame_cache()
def freshness(at: Where, name: str, version: int) -> pl.DataFrame:
    """Per prompt group of a gold dataset version, newest landed first: when its last step was
    acknowledged, when it became available to trainers, and the lag between (seconds)."""
    require_dataset(at, name)
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


@frame_cache(ttl=5)
def consumers(at: Where, name: str, version: int) -> pl.DataFrame:
    """Each consumer rank's position in a dataset: batches, distinct groups taken and their
    deliveries (reuses included), the newest policy version taken, when, and (live
    consumers) how many groups it has not been given yet."""
    require_dataset(at, name)
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


def trainer_feedback(at: Where, name: str) -> FeedbackReport | None:
    """The behaviour-vs-trainer mismatch of what trainers fed back on a dataset (None before
    any feedback), cached per version of gold/trainer_feedback; it reads the steps' figures,
    not their log-prob lists."""
    require_dataset(at, name)
    version = at.lake().version(GOLD_TRAINER_FEEDBACK)
    return None if version is None else _trainer_feedback(at, name, version)


@frame_cache()
def _trainer_feedback(at: Where, name: str, version: int) -> FeedbackReport | None:
    """The report at that table version (it is only the cache key)."""
    report = feedback_report(at.lake(), name)
    return report if report.by_batch.height else None


def failing_builds(at: Where, mine: set[str] | None = None) -> list[FailingBuild]:
    """The builds that keep failing, as the live materializer and the Dagster sensors say: a
    tenant's of its own datasets (`mine`: the names of its specs) only."""
    found = failing.failing_builds(at.lake())
    if at.caller.sees_every_tenant:
        return found
    return [b for b in found if b.what.split("|", 1)[0] in (mine or set())]


def shard_status(at: Where) -> pl.DataFrame | None:
    """Each materializer shard (owner, lease age, lag behind bronze, last error, problem),
    for a caller who sees every tenant; None when the lake has no shards or for others."""
    if not at.caller.sees_every_tenant:
        return None
    rows = [status.to_row() for status in shard_statuses(at.lake())]
    return pl.DataFrame(rows) if rows else None


def materializer_status(at: Where) -> bool:
    """Whether a live materializer is running on this lake (its heartbeat is fresh)."""
    return materializer_running(at.lake())


def refused_by_the_store(exc: BaseException) -> bool:
    """Whether a write failed because the object store refused this process's identity."""
    text = str(exc)
    return any(mark in text for mark in ("403", "AccessDenied", "Forbidden"))
