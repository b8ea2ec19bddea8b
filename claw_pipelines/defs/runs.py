"""Run coalescing: what is already queued or running, so sensors ask for nothing twice."""

import dagster as dg

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]
PARTITION_TAG = "dagster/partition"
PRIORITY_TAG = "dagster/priority"  # the queue starts higher numbers first


def runs_in_flight(
    instance: dg.DagsterInstance, job_name: str | None = None
) -> list[dg.DagsterRun]:
    """Runs queued, starting or running (of one job, when given)."""
    return list(instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT, job_name=job_name)))


def partitions_in_flight(instance: dg.DagsterInstance) -> set[str]:
    """The gold partition keys ("dataset|policy_version") that a queued or running run builds
    (launched by the sensor, the dashboard or the UI: all carry the partition tag)."""
    return {
        run.tags[PARTITION_TAG]
        for run in runs_in_flight(instance)
        if "|" in run.tags.get(PARTITION_TAG, "")
    }
