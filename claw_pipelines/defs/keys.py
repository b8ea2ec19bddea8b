"""Asset keys: the layer first, then the table (`["silver", "steps"]`), from the table names."""

from __future__ import annotations

import dagster as dg

from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    SILVER_FEEDBACK,
    SILVER_STEP_CONFLICTS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    SILVER_TRAJECTORIES,
)


def table_key(table: str) -> dg.AssetKey:
    """The asset key of a lake table: its path segments."""
    return dg.AssetKey(table.split("/"))


BRONZE = table_key(BRONZE_EVENTS)
STEPS = table_key(SILVER_STEPS)
FEEDBACK = table_key(SILVER_FEEDBACK)
TRAJECTORIES = table_key(SILVER_TRAJECTORIES)
STEP_REWARDS = table_key(SILVER_STEP_REWARDS)
STEP_CONFLICTS = table_key(SILVER_STEP_CONFLICTS)
