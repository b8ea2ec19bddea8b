"""Data flows without clicking: a sensor requests a silver run when bronze has a new version,
at most one at a time (the run reads up to the newest bronze when it starts)."""

import dagster as dg

from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.defs.keys import BRONZE
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.defs.runs import (
    INPUTS_TAG,
    OP_RETRY_POLICY,
    SINCE_TAG,
    Retries,
    failed_runs,
    plan_retries,
    runs_in_flight,
)
from claw_pipelines.defs.silver import SILVER_SPECS
from claw_pipelines.materialize.failing import report_sensor_failures
from claw_pipelines.materialize.live import materializer_running
from claw_pipelines.materialize.silver import watermark

# the sensor's name: its failing builds are reported under it (`failing.SENSORS`)
SENSOR = "bronze_version_sensor"

silver_job = dg.define_asset_job(
    "silver_job",
    selection=dg.AssetSelection.assets(*(spec.key for spec in SILVER_SPECS)),
    description="Bring silver up to date with bronze.",
    op_retry_policy=OP_RETRY_POLICY,
)
SILVER = "silver"  # the key silver's runs are retried and reported under


@dg.sensor(
    name=SENSOR,
    job=silver_job,
    default_status=dg.DefaultSensorStatus.RUNNING,
    minimum_interval_seconds=10,
    description="Requests a silver run when bronze/events has a version silver has not read "
    "and no silver run is queued or running (that run reads up to the newest bronze anyway); "
    "records the version as bronze's observed data version. Idle while a live materializer "
    "(claw materialize --follow) keeps silver up to date. A failed run is asked for again "
    "with backoff (tag claw/retry), then reported as failing until bronze moves.",
)
def bronze_version_sensor(context: dg.SensorEvaluationContext, claw: ClawLake):
    """At most one silver run in flight, whatever the number of new bronze versions."""
    lake, retries = claw.lake(), Retries.from_settings(claw.settings())
    version = lake.version(BRONZE_EVENTS)
    if version is None:
        return dg.SkipReason("bronze/events does not exist yet")
    if materializer_running(lake):
        return dg.SkipReason("the live materializer (claw materialize --follow) keeps silver up")
    observed = []
    if context.cursor != str(version):
        context.update_cursor(str(version))
        observed = [
            dg.AssetObservation(asset_key=BRONZE, tags={"dagster/data_version": str(version)})
        ]
    done = watermark(lake)
    if done is not None and done >= version:
        report_sensor_failures(lake, SENSOR, [])
        return dg.SensorResult(asset_events=observed, skip_reason=f"silver has read v{version}")
    busy = next(iter(runs_in_flight(context.instance, silver_job.name)), None)
    if busy is not None:
        return dg.SensorResult(
            asset_events=observed,
            skip_reason=f"silver run {busy.run_id[:8]} is {busy.status.value.lower()}; "
            "it reads up to the newest bronze",
        )
    inputs = f"bronze-v{version}"
    failed = failed_runs(context.instance, silver_job.name, lambda run: SILVER)
    plan = plan_retries(failed, {SILVER: inputs}, retries, SENSOR)
    report_sensor_failures(lake, SENSOR, plan.failing)
    if SILVER in plan.waiting:
        return dg.SensorResult(asset_events=observed, skip_reason=plan.failing[0].line())
    tags = {"claw/bronze_version": str(version), INPUTS_TAG: inputs}
    if plan.due:
        tags |= plan.due[0].retry_tags()
    elif SILVER in failed:  # bronze moved since the failure: a first try, failing since then
        tags[SINCE_TAG] = str(failed[SILVER].since)
    return dg.SensorResult(
        run_requests=[
            dg.RunRequest(
                run_key=inputs + (f"|retry{plan.due[0].tries}" if plan.due else ""),
                run_config={"ops": {"silver": {"config": {"bronze_version": -1}}}},
                tags=tags,
            )
        ],
        asset_events=observed,
    )
