"""Live delivery: which prompt groups a trainer gets next, each once per consumer, recorded.

A unit of delivery is a prompt group within a policy-version partition of a gold dataset
(the same unit incremental gold writes: `"<policy_version>:<group>"`). A consumer pulls
units through `Dataset.next_batch`: whole groups only, oldest landed first, within a
staleness bound, split between data-parallel ranks by a stable hash of the unit (disjoint,
deterministic, covering every unit). Every delivered batch is one `gold/consumption` row
(consumer, rank, batch index, dataset version, its units and steps), appended before the
batch is handed over and guarded per (consumer, rank), so two processes of the same rank
never deliver the same unit twice and a restarted trainer resumes where the record says:
later calls skip every unit recorded, and `Dataset.replay` rebuilds any recorded batch
exactly (time travel to its dataset version).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.tables import GOLD_CONSUMPTION, GOLD_CONSUMPTION_SPEC, LIVE_DELIVERY
from claw_pipelines.lake.delta import Guard, Lake
from claw_pipelines.transforms.partials import oldest_version, with_runs

NEXT = LIVE_DELIVERY  # the `kind` of consumption rows written by next_batch
# a batch next_batch refused (a blocking contract check failed): its groups are never
# offered to that consumer rank again, and the refusal is on record
REFUSED = "refused"
UNIT_COLUMNS = [
    "step_key",
    "policy_version",
    "prompt_uid",
    "trajectory_uid",
    "tree_id",
    "prompt_len",
    "response_len",
    "landed_at",
    "policy_version_runs",  # a unit's oldest token (step-level staleness)
]


def delivery_writer(dataset: str, consumer: str, rank: int) -> str:
    """The application id of one consumer rank's deliveries from one dataset."""
    return f"claw.delivery.{dataset}.{consumer}.{int(rank)}"


def unit_keys(frame: pl.DataFrame) -> pl.Series:
    """Each row's unit: "<policy_version>:<group>", the group (prompt_uid, else trajectory)
    of its tree (the smallest one when a tree's steps name several)."""
    group = pl.coalesce("prompt_uid", "trajectory_uid").min().over("policy_version", "tree_id")
    return frame.select(
        (pl.col("policy_version").cast(pl.String) + ":" + group).alias("unit")
    ).to_series()


def _digests(units: list[str]) -> np.ndarray:
    """Each unit's stable 64-bit hash (BLAKE2b)."""
    digests = [hashlib.blake2b(u.encode(), digest_size=8).digest() for u in units]
    return np.frombuffer(b"".join(digests), dtype=np.uint64) if digests else np.zeros(0, np.uint64)


@dataclass(frozen=True)
class Ledger:
    """What one consumer rank has been delivered, as of consumption version `version`."""

    version: int
    units: set[str]
    next_index: int


def ledger(lake: Lake, dataset: str, consumer: str, rank: int) -> Ledger:
    """The consumer rank's deliveries so far (the table is created if missing)."""
    lake.ensure(GOLD_CONSUMPTION_SPEC)
    version = lake.version(GOLD_CONSUMPTION)
    rows = (
        lake.scan(GOLD_CONSUMPTION, version)
        .filter(
            (pl.col("dataset") == dataset)
            & (pl.col("consumer") == consumer)
            & pl.col("kind").is_in([NEXT, REFUSED])
            & (pl.col("rank") == rank)
        )
        .select("groups", "batch_index")
        .collect()
    )
    units = set(rows["groups"].explode().drop_nulls().to_list()) if rows.height else set()
    top = rows["batch_index"].max() if rows.height else None
    return Ledger(version, units, 0 if top is None else int(top) + 1)


def unit_table(rows: pl.DataFrame) -> pl.DataFrame:
    """Per unit of `rows` (with `unit`): policy_version, the version of its oldest token,
    steps, tokens, landed_at and the 64-bit digest its rank is drawn from (the digest modulo
    the world size)."""
    units = (
        with_runs(rows)
        .group_by("unit")
        .agg(
            pl.col("policy_version").first(),
            oldest_policy_version=oldest_version().min(),
            steps=pl.len(),
            tokens=(pl.col("prompt_len") + pl.col("response_len")).sum(),
            landed_at=pl.col("landed_at").min(),
        )
    )
    return units.with_columns(digest=pl.Series(_digests(units["unit"].to_list()), dtype=pl.UInt64))


@dataclass
class LiveRows:
    """A dataset's rows (with their `unit`), per policy-version partition, and its units at
    dataset version `version`, brought to a newer version by the table's change feed: what
    changed is read and applied to the partitions it touched, never the whole table."""

    version: int
    parts: dict[int, pl.DataFrame]
    units: pl.DataFrame

    @classmethod
    def read(cls, lake: Lake, table: str, version: int, columns: list[str]) -> LiveRows:
        """Every row of the table at `version`."""
        rows = lake.read(table, version, columns=columns)
        rows = rows.with_columns(unit=unit_keys(rows))
        return cls(version, _partitions(rows), unit_table(rows))

    @property
    def rows(self) -> pl.DataFrame:
        """Every row (all partitions)."""
        return pl.concat(list(self.parts.values())) if self.parts else pl.DataFrame()

    def rows_of(self, units: list[str]) -> pl.DataFrame:
        """The rows of `units` ("<policy_version>:<group>" keys), read from their partitions."""
        versions = {int(u.split(":", 1)[0]) for u in units}
        found = [
            self.parts[v].filter(pl.col("unit").is_in(units)) for v in versions if v in self.parts
        ]
        return pl.concat(found) if found else pl.DataFrame()

    def at(self, lake: Lake, table: str, version: int, columns: list[str]) -> LiveRows:
        """The rows at `version` (this object when it stands there): the changes of the
        versions in between applied in order, or a full read when the feed cannot say."""
        if version == self.version:
            return self
        changed = None
        if version > self.version:
            changed = lake.change_feed(table, self.version, version, columns)
        if changed is None:
            return LiveRows.read(lake, table, version, columns)
        feed = pl.from_arrow(changed)
        assert isinstance(feed, pl.DataFrame)
        parts, touched = dict(self.parts), []
        commits = feed.sort("_commit_version").group_by("_commit_version", maintain_order=True)
        for _, commit in commits:
            gone = commit.filter(pl.col("_change_type").is_in(["delete", "update_preimage"]))
            for (pv,), rows in gone.group_by("policy_version"):
                part = parts.get(int(pv))
                if part is not None:
                    hit = pl.col("step_key").is_in(rows["step_key"].implode())
                    touched.append(part.filter(hit).select("policy_version", "unit"))
                    parts[int(pv)] = part.filter(~hit)
            added = commit.filter(pl.col("_change_type").is_in(["insert", "update_postimage"]))
            if added.height:
                missing = [pl.lit(None).alias(c) for c in columns if c not in added.columns]
                added = added.with_columns(missing).select(columns)  # declared since: nulls
                added = added.with_columns(unit=unit_keys(added))  # whole trees land at once
                touched.append(added.select("policy_version", "unit"))
                for pv, rows in _partitions(added).items():
                    kept = parts.get(pv)
                    parts[pv] = (
                        rows if kept is None else pl.concat([kept, rows], how="vertical_relaxed")
                    )
        if not touched:
            return LiveRows(version, parts, self.units)
        units = pl.concat(touched).unique()
        fresh = [
            unit_table(parts[int(pv)].filter(pl.col("unit").is_in(group["unit"].implode())))
            for (pv,), group in units.group_by("policy_version")
            if int(pv) in parts
        ]
        kept = self.units.filter(~pl.col("unit").is_in(units["unit"].implode()))
        return LiveRows(version, parts, pl.concat([kept, *(f.select(kept.columns) for f in fresh)]))


def _partitions(rows: pl.DataFrame) -> dict[int, pl.DataFrame]:
    """Rows split by policy version."""
    return {int(pv): part for (pv,), part in rows.group_by("policy_version")}


def available_units(
    units: pl.DataFrame,
    taken: set[str],
    min_policy_version: int | None,
    rank: int,
    world: int,
    staleness: str = "step",
) -> pl.DataFrame:
    """Units (`unit_table`'s) this rank may be given now, oldest landed first: (unit,
    policy_version, steps, tokens, landed_at). `min_policy_version` bounds every token of a
    unit (`staleness` step) or the versions that finished its steps (token: older tokens
    are masked out of the loss instead)."""
    if min_policy_version is not None:
        judged = "policy_version" if staleness == "token" else "oldest_policy_version"
        units = units.filter(pl.col(judged) >= min_policy_version)
    mine = (pl.col("digest") % world) == rank
    return (
        units.filter(
            mine & ~pl.col("unit").is_in(pl.Series(list(taken), dtype=pl.String).implode())
        )
        .sort("landed_at", "unit", nulls_last=False)
        .drop("digest", "oldest_policy_version")
    )


def choose(units: pl.DataFrame, groups: int | None, max_tokens: int | None) -> list[str] | None:
    """The units of the next batch, in order: `groups` of them (all that fit within
    `max_tokens` when given, at least one); None when fewer than `groups` are available."""
    wanted = groups if groups is not None else 1
    if units.height < wanted:
        return None
    if max_tokens is None:
        return units["unit"].head(wanted).to_list()
    within = units.with_columns(total=pl.col("tokens").cum_sum()).filter(
        pl.col("total") <= max_tokens
    )
    limit = groups if groups is not None else units.height
    chosen = within["unit"].head(limit).to_list()
    return chosen or units["unit"].head(1).to_list()  # a unit over budget goes alone


def record_delivery(
    lake: Lake,
    dataset: str,
    dataset_version: int,
    consumer: str,
    rank: int,
    world_size: int,
    book: Ledger,
    units: list[str],
    step_keys: list[str],
    policy_version: int,
    kind: str = NEXT,
    token_floor: int | None = None,
) -> int:
    """Append the batch's consumption row (`kind`: delivered, or REFUSED; `token_floor`:
    the floor its stale tokens were masked below), guarded by the ledger it was chosen from
    (another process of this rank that delivered first makes this raise WriteConflict)."""
    row = {
        "consumer": consumer,
        "dataset": dataset,
        "dataset_version": dataset_version,
        "policy_version": policy_version,
        "batch_index": book.next_index,
        "step_keys": step_keys,
        "consumed_at": datetime.now(UTC),
        "rank": rank,
        "world_size": world_size,
        "groups": units,
        "kind": kind,
        "token_floor": token_floor,
    }
    guard = Guard(
        (delivery_writer(dataset, consumer, rank),),
        book.next_index,
        {GOLD_CONSUMPTION: book.version},
    )
    return lake.append(GOLD_CONSUMPTION_SPEC, pa.Table.from_pylist([row]), guard=guard)


def consumer_positions(lake: Lake, dataset: str) -> pl.DataFrame:
    """Per consumer and rank of a dataset: batches and groups delivered, the newest policy
    version delivered, and when it last pulled."""
    if not lake.exists(GOLD_CONSUMPTION):
        return pl.DataFrame(schema={"consumer": pl.String, "rank": pl.Int64})
    return (
        lake.scan(GOLD_CONSUMPTION)
        .filter((pl.col("dataset") == dataset) & (pl.col("kind").ne_missing(REFUSED)))
        .group_by("consumer", pl.col("rank").fill_null(0))
        .agg(
            batches=pl.len(),
            steps=pl.col("step_keys").list.len().sum(),
            groups=pl.col("groups").list.len().sum(),
            newest_policy_version=pl.col("policy_version").max(),
            last_pulled_at=pl.col("consumed_at").max(),
        )
        .sort("consumer", "rank")
        .collect()
    )
