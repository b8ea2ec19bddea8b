"""Data flows without clicking: a sensor requests a silver run for each new bronze version."""

import dagster as dg

from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.defs.keys import BRONZE
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.defs.silver import SILVER_SPECS
from claw_pipelines.silver import watermark

silver_job = dg.define_asset_job(
    "silver_job",
    selection=dg.AssetSelection.assets(*(spec.key for spec in SILVER_SPECS)),
    description="Bring silver up to date with bronze.",
)


@dg.sensor(
    job=silver_job,
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=10,
    description="Requests a silver run when bronze/events has a new Delta version "
    "(run_key = that version) and records the version as bronze's observed data version.",
)
def bronze_version_sensor(context: dg.SensorEvaluationContext, claw: ClawLake):
    """One run per new bronze version that silver has not read yet."""
    lake = claw.lake()
    version = lake.version(BRONZE_EVENTS)
    if version is None:
        return dg.SkipReason("bronze/events does not exist yet")
    if context.cursor == str(version):
        return dg.SkipReason(f"bronze/events still at version {version}")
    context.update_cursor(str(version))
    observed = dg.AssetObservation(asset_key=BRONZE, tags={"dagster/data_version": str(version)})
    done = watermark(lake)
    if done is not None and done >= version:
        return dg.SensorResult(asset_events=[observed], skip_reason=f"silver has read v{version}")
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(
                run_key=f"bronze-v{version}",
                run_config={"ops": {"silver": {"config": {"bronze_version": version}}}},
                tags={"claw/bronze_version": str(version)},
            )
        ],
        asset_events=[observed],
    )
