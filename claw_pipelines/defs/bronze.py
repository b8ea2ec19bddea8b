"""`bronze/events`: landed by the gateway, observed here (Delta version = data version)."""

import warnings

import dagster as dg
from dagster_shared.utils.warnings import BetaWarning

from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.defs.keys import BRONZE
from claw_pipelines.defs.resources import ClawLake


def _observe_bronze(claw: ClawLake) -> dg.DataVersion:
    """Bronze's Delta version as its data version ("-1" before the first write)."""
    version = claw.lake().version(BRONZE_EVENTS)
    return dg.DataVersion(str(-1 if version is None else version))


with warnings.catch_warnings():
    warnings.simplefilter("ignore", BetaWarning)  # observable source assets are marked beta
    bronze_events = dg.observable_source_asset(
        key=BRONZE,
        group_name="bronze",
        description="One accepted request record per row, landed by the gateway through its "
        "WAL (steps, proxied completions, feedback, events, trajectory completions).",
    )(_observe_bronze)
