"""Live delivery: which prompt groups a trainer gets next, each once per consumer (or up to
`max_uses` times), recorded.

A unit of delivery is a prompt group within a policy-version partition of a gold dataset
(the same unit incremental gold writes: `"<policy_version>:<group>"`). A consumer pulls
units through `Dataset.next_batch`: whole groups only, within a staleness bound, split
between data-parallel ranks by a stable hash of the unit (disjoint, deterministic, covering
every unit). Which units a rank is offered, and in which order, is a `Selection`: at most
`max_uses` deliveries of a unit to the rank (1: exactly once), `cooldown` of the rank's
batches between two of them, units used fewer times first, then by `order` (oldest landed,
newest landed, or highest reward variance). Every batch is one `gold/consumption` row
(consumer, rank, batch index, dataset version, its units with the use number of each, and
steps), appended before the batch is handed over and guarded per (consumer, rank), so two
processes of the same rank never deliver a unit more than `max_uses` times and a restarted
trainer resumes where the record says (the `Ledger`, read back from it), and
`Dataset.replay` rebuilds any recorded batch exactly (time travel to its dataset version).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, get_args

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
    "reward",
    "policy_version_runs",  # a unit's oldest token (step-level staleness)
]
# the orders a rank's units may be offered in (among units used equally often)
Order = Literal["oldest", "newest", "reward_variance"]
ORDERS: tuple[str, ...] = get_args(Order)


def _first(column: str, nulls_first: bool, descending: bool) -> list[tuple[pl.Expr, bool]]:
    """Sort keys for `column`, its nulls placed explicitly (first or last)."""
    missing = pl.col(column).is_null()
    return [(~missing if nulls_first else missing, False), (pl.col(column), descending)]


# per order, its sort keys (expression, descending) after the units' use counts; the unit
# key breaks the remaining ties, so an order is a total order (deterministic). Nulls are
# placed by keys of their own, so a partial selection (bottom_k) and a sort agree.
ORDER_KEYS: dict[str, list[tuple[pl.Expr, bool]]] = {
    "oldest": _first("landed_at", nulls_first=True, descending=False),
    "newest": _first("landed_at", nulls_first=False, descending=True),
    "reward_variance": [
        *_first("reward_variance", nulls_first=False, descending=True),
        *_first("landed_at", nulls_first=True, descending=False),
    ],
}


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
class Selection:
    """Which units a consumer rank is offered, and in which order: a unit at most `max_uses`
    times (1: exactly once), with at least `cooldown` of the rank's batches between two
    deliveries of it (batch indexes: a unit of batch b comes again at b + cooldown + 1 at the
    earliest); the units used fewer times first (a fresh unit before any reuse), then by
    `order`: "oldest" (landed first), "newest" (landed last first) or "reward_variance"
    (highest variance of `reward` over the group's steps first, groups without rewards last,
    then oldest landed); the unit key breaks ties."""

    max_uses: int = 1
    cooldown: int = 0
    order: Order = "oldest"

    def __post_init__(self) -> None:
        if self.max_uses < 1:
            raise ValueError(f"max_uses must be at least 1, not {self.max_uses}")
        if self.cooldown < 0:
            raise ValueError(f"cooldown must be at least 0, not {self.cooldown}")
        if self.order not in ORDERS:
            known = ", ".join(map(repr, ORDERS))
            raise ValueError(f"order must be one of {known}, not {self.order!r}")


EXACTLY_ONCE = Selection()
# a ledger's units: each unit delivered (or refused) to the rank, how often it was delivered,
# the batch index of its last delivery, and whether a batch holding it was refused
LEDGER_SCHEMA = {"unit": pl.String, "used": pl.Int64, "last_batch": pl.Int64, "refused": pl.Boolean}


@dataclass(frozen=True)
class Ledger:
    """What one consumer rank has been delivered, as of consumption version `version`:
    `units` (LEDGER_SCHEMA) and the rank's next batch index."""

    version: int
    units: pl.DataFrame
    next_index: int

    def after(self, version: int, units: list[str], uses: list[int], refused: bool) -> Ledger:
        """This ledger once batch `next_index` (`units`, their use numbers `uses`) is recorded
        at consumption version `version`: delivered, or refused (never offered again)."""
        used = [use - 1 for use in uses] if refused else uses
        batch = pl.DataFrame(
            {
                "unit": units,
                "used": used,
                "last_batch": [self.next_index] * len(units),
                "refused": [refused] * len(units),
            },
            schema=LEDGER_SCHEMA,
        )
        kept = self.units.filter(~pl.col("unit").is_in(pl.Series(units, dtype=pl.String).implode()))
        return Ledger(version, pl.concat([kept, batch]), self.next_index + 1)


def ledger(lake: Lake, dataset: str, consumer: str, rank: int) -> Ledger:
    """The consumer rank's deliveries so far (the table is created if missing): a unit's
    uses are the delivered batches naming it (refused ones aside)."""
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
        .select("groups", "batch_index", "kind")
        .collect()
    )
    units = (
        rows.explode("groups")
        .drop_nulls("groups")
        .group_by(unit=pl.col("groups"))
        .agg(
            used=(pl.col("kind") == NEXT).sum(),
            last_batch=pl.col("batch_index").max(),
            refused=(pl.col("kind") == REFUSED).any(),
        )
        .cast(LEDGER_SCHEMA)  # type: ignore[arg-type]
    )
    top = rows["batch_index"].max() if rows.height else None
    return Ledger(version, units, 0 if top is None else int(top) + 1)


def unit_table(rows: pl.DataFrame) -> pl.DataFrame:
    """Per unit of `rows` (with `unit`): policy_version, the version of its oldest token,
    steps, tokens, landed_at, the (population) variance of its steps' `reward` (null when
    none has one) and the 64-bit digest its rank is drawn from (the digest modulo the world
    size)."""
    units = (
        with_runs(rows)
        .group_by("unit")
        .agg(
            pl.col("policy_version").first(),
            oldest_policy_version=oldest_version().min(),
            steps=pl.len(),
            tokens=(pl.col("prompt_len") + pl.col("response_len")).sum(),
            landed_at=pl.col("landed_at").min(),
            reward_variance=pl.col("reward").cast(pl.Float64).var(ddof=0),
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
    book: Ledger,
    min_policy_version: int | None,
    rank: int,
    world: int,
    selection: Selection = EXACTLY_ONCE,
    staleness: str = "step",
) -> pl.DataFrame:
    """Units (`unit_table`'s) this rank may be given now under `selection`, in no order:
    (unit, policy_version, steps, tokens, landed_at, reward_variance, used: its deliveries
    to this rank so far). `min_policy_version` bounds every token of a unit (`staleness`
    step) or the versions that finished its steps (token: older tokens are masked out of
    the loss instead)."""
    if min_policy_version is not None:
        judged = "policy_version" if staleness == "token" else "oldest_policy_version"
        units = units.filter(pl.col(judged) >= min_policy_version)
    mine = units.filter((pl.col("digest") % world) == rank).drop("digest", "oldest_policy_version")
    used = pl.col("used")
    again = (
        ~pl.col("refused")
        & (used < selection.max_uses)
        & (pl.col("last_batch") + selection.cooldown < book.next_index)
    )
    return (
        mine.join(book.units, on="unit", how="left")
        .filter(used.is_null() | again)
        .with_columns(used.fill_null(0))
        .drop("last_batch", "refused")
    )


def in_order(units: pl.DataFrame, order: str, count: int) -> pl.DataFrame:
    """The first `count` of `units` (`available_units`') in the order they are offered:
    fewer uses first, then `order`, then the unit key; only those are sorted (a partial
    selection first: the rest of a large offer is never sorted)."""
    keys = [(pl.col("used"), False), *ORDER_KEYS[order], (pl.col("unit"), False)]
    by, descending = [k for k, _ in keys], [d for _, d in keys]
    first = units if count >= units.height else units.bottom_k(count, by=by, reverse=descending)
    return first.sort(by, descending=descending)


def choose(
    units: pl.DataFrame, groups: int | None, max_tokens: int | None, order: str = "oldest"
) -> pl.DataFrame | None:
    """The units of the next batch (rows of `available_units`), in order: the first `groups`
    of them (all that fit within `max_tokens` when given, at least one); None when fewer
    than `groups` are available."""
    wanted = groups if groups is not None else 1
    if units.height < wanted:
        return None
    if max_tokens is None:
        return in_order(units, order, wanted)
    # no prefix of any order holds more units than the smallest ones that fit the budget
    fit = int((units["tokens"].sort().cum_sum() <= max_tokens).sum())
    limit = min(groups if groups is not None else units.height, max(fit, 1))
    first = in_order(units, order, limit)
    within = first.filter(pl.col("tokens").cum_sum() <= max_tokens)
    return within if within.height else first.head(1)  # a unit over budget goes alone


def record_delivery(
    lake: Lake,
    dataset: str,
    dataset_version: int,
    consumer: str,
    rank: int,
    world_size: int,
    book: Ledger,
    units: list[str],
    uses: list[int],
    step_keys: list[str],
    policy_version: int,
    kind: str = NEXT,
    token_floor: int | None = None,
) -> int:
    """Append the batch's consumption row (`kind`: delivered, or REFUSED; `uses`: each
    unit's use number, 1 = first; `token_floor`: the floor its stale tokens were masked
    below), guarded by the ledger it was chosen from (another process of this rank that
    delivered first makes this raise WriteConflict)."""
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
        "uses": uses,
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
    """Per consumer and rank of a dataset: batches, steps, distinct groups delivered and
    deliveries of groups (more than the groups when groups were delivered again, `max_uses`),
    the newest policy version delivered, and when it last pulled."""
    if not lake.exists(GOLD_CONSUMPTION):
        return pl.DataFrame(schema={"consumer": pl.String, "rank": pl.Int64})
    return (
        lake.scan(GOLD_CONSUMPTION)
        .filter((pl.col("dataset") == dataset) & (pl.col("kind").ne_missing(REFUSED)))
        .group_by("consumer", pl.col("rank").fill_null(0))
        .agg(
            batches=pl.len(),
            steps=pl.col("step_keys").list.len().sum(),
            groups=pl.col("groups").explode().drop_nulls().n_unique(),
            deliveries=pl.col("groups").list.len().sum(),
            newest_policy_version=pl.col("policy_version").max(),
            last_pulled_at=pl.col("consumed_at").max(),
        )
        .sort("consumer", "rank")
        .collect()
    )
