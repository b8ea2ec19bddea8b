"""Table maintenance: compact, checkpoint and vacuum bronze and silver, one run at a time."""

import dagster as dg

from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.silver import SILVER_TABLES

MAINTENANCE_POOL = "claw_maintenance"
MAINTAINED_TABLES = (BRONZE_EVENTS, *SILVER_TABLES)


@dg.op(
    pool=MAINTENANCE_POOL,
    description="Compact small files, checkpoint the log and vacuum files older than the "
    "retention (CLAW_RETENTION_HOURS, at least 7 days). Compaction only rewrites files "
    "(dataChange = false), so it commits beside the gateway's appends without conflict.",
)
def maintain_tables(context: dg.OpExecutionContext, claw: ClawLake) -> None:
    """Maintain every bronze and silver table that exists."""
    lake, retention = claw.lake(), claw.settings().retention_hours
    for table in MAINTAINED_TABLES:
        if lake.exists(table):
            result = lake.maintain(table, retention_hours=retention)
            context.log.info(f"{table}: {result}")


@dg.job(
    description="Compact, checkpoint and vacuum bronze and silver (one at a time).",
    tags={"claw/maintenance": "true"},
)
def maintenance_job() -> None:
    """Maintain the tables."""
    maintain_tables()


maintenance_schedule = dg.ScheduleDefinition(
    job=maintenance_job,
    cron_schedule="17 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Hourly table maintenance.",
)
