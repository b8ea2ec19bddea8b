"""How each materializer shard stands (docs/DESIGN.md §19): who owns it, how old its lease
is, how far its silver is behind bronze, its last error; and what is wrong with it (a lease
that lapsed without a release, a shard fallen behind, a shard of the plan nobody holds).
`claw shards`, `claw check` and the dashboard's collection page show it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

import polars as pl

from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.leases import ShardLeases, ShardPlan
from claw_pipelines.materialize.live import heartbeat_of
from claw_pipelines.materialize.silver import silver_state

BEHIND_VERSIONS = 64  # a shard more bronze versions behind than this is flagged (a round's)


@dataclass(frozen=True)
class ShardStatus:
    """One shard as the lake shows it."""

    slot: Slot
    owner: str | None
    token: int | None
    lease_age_s: float | None  # since it was taken
    renewed_s_ago: float | None
    state: str  # held | lapsed | released | free
    bronze_version: int | None  # its silver's marker
    lag_versions: int | None  # bronze versions it has not read
    last_error: str | None  # of its heartbeat's failing datasets, one
    planned: bool  # of the lake's current split

    @property
    def problem(self) -> str | None:
        """What is wrong with the shard, in a line (None: nothing)."""
        if not self.planned:
            return None  # a retired split's: its leases only say who held it
        if self.state == "lapsed":
            return f"shard {self.slot}: lease of {self.owner} lapsed (not renewed, not released)"
        if self.state in ("released", "free"):
            return f"shard {self.slot}: no follower holds it"
        if self.lag_versions is not None and self.lag_versions > BEHIND_VERSIONS:
            return f"shard {self.slot}: {self.lag_versions} bronze versions behind"
        if self.last_error:
            return f"shard {self.slot}: {self.last_error}"
        return None

    def to_row(self) -> dict[str, object]:
        """As a table row (the CLI's and the dashboard's)."""
        return {
            "shard": str(self.slot),
            "state": self.state,
            "owner": self.owner,
            "token": self.token,
            "lease age (s)": _round(self.lease_age_s),
            "renewed (s ago)": _round(self.renewed_s_ago),
            "silver at bronze": self.bronze_version,
            "behind (versions)": self.lag_versions,
            "last error": self.last_error,
            "problem": self.problem,
        }


def shard_statuses(lake: Lake) -> list[ShardStatus]:
    """Every shard the lake's leases or plan name, in (count, index) order."""
    plan = ShardPlan.read(lake)
    leases = ShardLeases(lake, "status").holders()
    slots = {Slot(int(i), int(n)) for n, i in leases.select("shard_count", "shard_index").rows()}
    if plan is not None and plan.count > 1:
        slots |= {Slot(i, plan.count) for i in range(plan.count)}
    bronze = lake.version(BRONZE_EVENTS)
    now = datetime.now(UTC)
    found = []
    for slot in sorted(slots, key=lambda s: (s.count, s.index)):
        row = _lease(leases, slot)
        marker = silver_state(lake, slot=slot).bronze_version
        lag = None if bronze is None else bronze - (-1 if marker is None else marker)
        found.append(
            ShardStatus(
                slot=slot,
                owner=None if row is None else row["owner"],
                token=None if row is None else row["token"],
                lease_age_s=None if row is None else _seconds(now - row["acquired_at"]),
                renewed_s_ago=None if row is None else _seconds(now - row["renewed_at"]),
                state=_state(row, now),
                bronze_version=marker,
                lag_versions=lag,
                last_error=_last_error(lake, slot),
                planned=plan is None or plan.count == slot.count,
            )
        )
    return found


def shard_problems(lake: Lake) -> list[str]:
    """A line for every shard of the current split that is not well (see `problem`)."""
    return [s.problem for s in shard_statuses(lake) if s.problem is not None]


def _lease(leases: pl.DataFrame, slot: Slot) -> dict | None:
    rows = leases.filter(
        (pl.col("shard_count") == slot.count) & (pl.col("shard_index") == slot.index)
    )
    return rows.row(0, named=True) if rows.height else None


def _state(row: dict | None, now: datetime) -> str:
    if row is None:
        return "free"
    if row["released_at"] is not None:
        return "released"
    return "held" if row["expires_at"] > now else "lapsed"


def _last_error(lake: Lake, slot: Slot) -> str | None:
    """One of the errors the shard's heartbeat lists (a dataset whose increments fail)."""
    try:
        beat = json.loads(lake.read_text(heartbeat_of(slot)) or "{}")
    except (OSError, ValueError):
        return None
    failing = beat.get("failing") or {}
    return next((str(f.get("error")) for f in failing.values()), None)


def _seconds(delta) -> float:
    return delta.total_seconds()


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
