"""Policy versions, as the trainer publishes them (`gold/policy_versions`).

An asynchronous RL loop moves on in versions: the trainer trains on fresh groups, publishes
policy v+1, and agents continue with it. The newest published version is what the gateway
stamps on steps that name none (`X-Claw-Policy-Version` or a step's own `policy_version`
still wins) and what a spec's `max_policy_staleness` counts from. Versions only go up;
publishing is a guarded append, so two trainers cannot both publish the same one.
"""

from __future__ import annotations

from datetime import UTC, datetime

import polars as pl
import pyarrow as pa

from claw_pipelines.contracts.tables import GOLD_POLICY_VERSIONS
from claw_pipelines.lake.delta import Guard, Lake, until_landed

POLICY_WRITER = "claw.policy"


def published_version(lake: Lake) -> int | None:
    """The newest policy version published, or None before the first."""
    if not lake.exists(GOLD_POLICY_VERSIONS):
        return None
    newest = lake.read(GOLD_POLICY_VERSIONS, columns=["policy_version"])["policy_version"].max()
    return None if newest is None else int(newest)


def published_versions(lake: Lake) -> pl.DataFrame:
    """Every published version, oldest first."""
    if not lake.exists(GOLD_POLICY_VERSIONS):
        return pl.DataFrame(schema={"policy_version": pl.Int64, "published_at": pl.Datetime})
    return lake.read(GOLD_POLICY_VERSIONS).sort("policy_version")


def publish_policy_version(
    lake: Lake, version: int, by: str | None = None, note: str | None = None
) -> int:
    """Record that policy `version` is now current; it must be newer than every published
    one (ValueError otherwise). Returns the table version written."""
    if int(version) < 0:
        raise ValueError(f"policy_version: {version} is negative")

    def attempt() -> int:
        lake.ensure(GOLD_POLICY_VERSIONS)
        pins = {GOLD_POLICY_VERSIONS: lake.version(GOLD_POLICY_VERSIONS)}
        current = published_version(lake)
        if current is not None and int(version) <= current:
            raise ValueError(f"policy_version: {version} is not newer than the published {current}")
        row = {
            "policy_version": int(version),
            "published_at": datetime.now(UTC),
            "published_by": by,
            "note": note,
        }
        guard = Guard((POLICY_WRITER,), int(version), pins)
        return lake.append(GOLD_POLICY_VERSIONS, pa.Table.from_pylist([row]), guard=guard)

    written, _ = until_landed(attempt, "policy versions")
    return written
