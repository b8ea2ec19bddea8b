"""Table maintenance: compact, checkpoint and vacuum every table, one run at a time.

What it keeps bounded: the number of files a table's reads open (increments append a small
file per round and table; compaction bins them), the log a reader replays (delta-rs also
checkpoints every 100 commits on its own) and the storage of replaced files (vacuumed after
CLAW_RETENTION_HOURS, the time-travel window).
"""

import dagster as dg

from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_CONSUMPTION,
    GOLD_LINEAGE,
    GOLD_TRAINER_FEEDBACK,
    SHARD_LEASES,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.lake.catalog import gold_datasets
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.silver import SILVER_TABLES

MAINTENANCE_POOL = "claw_maintenance"
MAINTAINED_TABLES = (
    BRONZE_EVENTS,
    *SILVER_TABLES,
    GOLD_LINEAGE,
    GOLD_CONSUMPTION,
    GOLD_TRAINER_FEEDBACK,
    SHARD_LEASES,  # a commit at every renewal of a shard's lease
)


def maintained_tables(lake: Lake) -> list[str]:
    """Every table maintenance keeps (that exists): bronze, silver, lineage, consumption,
    trainer feedback and each gold dataset's rows, trees and rejections."""
    per_dataset = [
        table(name)
        for name in gold_datasets(lake)
        for table in (gold_dataset_table, gold_tree_table, gold_rejection_table)
    ]
    return [t for t in (*MAINTAINED_TABLES, *per_dataset) if lake.exists(t)]


@dg.op(
    pool=MAINTENANCE_POOL,
    description="Compact small files, checkpoint the log and vacuum files older than the "
    "retention (CLAW_RETENTION_HOURS, at least 7 days). Compaction only rewrites files "
    "(dataChange = false), so it commits beside the gateway's appends without conflict.",
)
def maintain_tables(context: dg.OpExecutionContext, claw: ClawLake) -> None:
    """Maintain every table that exists."""
    lake, retention = claw.lake(), claw.settings().retention_hours
    for table in maintained_tables(lake):
        result = lake.maintain(table, retention_hours=retention)
        context.log.info(f"{table}: {result}")


@dg.job(
    description="Compact, checkpoint and vacuum every table (one at a time).",
    tags={"claw/maintenance": "true"},
)
def maintenance_job() -> None:
    """Maintain the tables."""
    maintain_tables()


maintenance_schedule = dg.ScheduleDefinition(
    job=maintenance_job,
    cron_schedule="*/10 * * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Table maintenance every 10 minutes: a live materializer adds a small file per "
    "round and table, and appends slow down as files pile up (31 ms at 270 files, 13 ms "
    "compacted).",
)
