"""Run coalescing and retries: what is already queued or running, so sensors ask for nothing
twice, and which failed runs to ask for again.

A run that fails is retried twice inside itself (the jobs' op retry policy: 2 s, then 4 s, for
a blip), then by its sensor: a run key starts one run ever, so the sensor asks again under a
new key (`claw/retry` = the try) once its backoff has passed (CLAW_RUN_RETRY_FIRST_S,
doubling up to RUN_RETRY_MAX_S), CLAW_RUN_RETRIES times for the same inputs; after that it
gives up until the inputs change and reports the build as failing (`failing.FailingBuild`,
shown on the dashboard) instead of leaving it silently stale.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import dagster as dg

from claw_pipelines.materialize.failing import FailingBuild
from claw_pipelines.settings import ClawSettings

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]
PARTITION_TAG = "dagster/partition"
PRIORITY_TAG = "dagster/priority"  # the queue starts higher numbers first
RETRY_TAG = "claw/retry"  # which retry of its inputs a sensor's run is (absent: the first try)
INPUTS_TAG = "claw/inputs"  # the inputs a sensor asked the run to build
SINCE_TAG = "claw/failing_since"  # on a retry: when the first try of its inputs failed
RUN_RETRY_MAX_S = 600.0  # the longest wait between two tries
SPEC_FAULT = "claw/spec_at_fault"  # a failure's metadata key: the spec, not the run, must change
FAILED_RUNS_LOOKED_AT = 200  # a sensor looks at this many of its job's latest failed runs
OP_RETRY_POLICY = dg.RetryPolicy(max_retries=2, delay=2, backoff=dg.Backoff.EXPONENTIAL)


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


@dataclass(frozen=True)
class Retries:
    """How a sensor retries its failed runs: tries after the first, and the first wait."""

    retries: int
    first_s: float

    @classmethod
    def from_settings(cls, settings: ClawSettings) -> Retries:
        """As CLAW_RUN_RETRIES and CLAW_RUN_RETRY_FIRST_S say."""
        return cls(settings.run_retries, settings.run_retry_first_s)

    def wait_s(self, tries: int) -> float:
        """The wait after `tries` failed tries in a row."""
        return min(RUN_RETRY_MAX_S, self.first_s * 2 ** max(0, tries - 1))


@dataclass(frozen=True)
class FailedRun:
    """The latest run of a key (a partition, or silver) when it failed: how many tries its
    inputs had, the error, when it ended and when the first try failed (timestamps)."""

    key: str
    inputs: str
    tries: int
    error: str
    ended_at: float
    since: float
    spec_at_fault: bool = False  # a retry cannot help: given up until the spec changes

    def retry_tags(self) -> dict[str, str]:
        """The tags of the run that retries it."""
        return {RETRY_TAG: str(self.tries), INPUTS_TAG: self.inputs, SINCE_TAG: str(self.since)}


def failed_runs(
    instance: dg.DagsterInstance, job_name: str, key_of: Callable[[dg.DagsterRun], str | None]
) -> dict[str, FailedRun]:
    """Per key (`key_of(run)`), its latest run of `job_name` when that run failed (no run of
    the key has started since)."""
    failed = instance.get_run_records(
        dg.RunsFilter(job_name=job_name, statuses=[dg.DagsterRunStatus.FAILURE]),
        limit=FAILED_RUNS_LOOKED_AT,
    )
    found: dict[str, FailedRun] = {}
    for record in failed:  # newest first
        run, key = record.dagster_run, key_of(record.dagster_run)
        if key is None or key in found or INPUTS_TAG not in run.tags:
            continue
        tags = {PARTITION_TAG: key} if "|" in key else {}
        latest = instance.get_runs(dg.RunsFilter(job_name=job_name, tags=tags), limit=1)
        if latest and latest[0].run_id != run.run_id:
            continue  # a later run of the key exists: that one tells
        ended = record.end_time or record.update_timestamp.timestamp()
        error, spec_at_fault = _run_failure(instance, run.run_id)
        found[key] = FailedRun(
            key,
            run.tags[INPUTS_TAG],
            int(run.tags.get(RETRY_TAG, 0)) + 1,
            error,
            ended,
            float(run.tags.get(SINCE_TAG, ended)),
            spec_at_fault,
        )
    return found


@dataclass
class RetryPlan:
    """What a sensor does about its failed runs this tick: the retries due now, the keys
    waiting for their backoff or given up (not to be asked for), every build to report."""

    due: list[FailedRun]
    waiting: set[str]
    failing: list[FailingBuild]


def plan_retries(
    failed: dict[str, FailedRun], inputs: dict[str, str], retries: Retries, sensor: str
) -> RetryPlan:
    """Plan the retries of the `failed` keys (`inputs`: per key, what it would build now). A
    key whose inputs are still its failed run's is retried after its backoff, at most
    `retries.retries` times; one whose inputs changed is asked for as a first try by the
    sensor's usual path. All are reported failing until a run of theirs succeeds."""
    plan = RetryPlan([], set(), [])
    now = time.time()
    for key, run in failed.items():
        if key not in inputs:
            continue  # no longer built (its spec is gone)
        again = inputs[key] == run.inputs
        retrying = not again or (run.tries <= retries.retries and not run.spec_at_fault)
        at = run.ended_at + retries.wait_s(run.tries) if again else now
        if again and retrying and now >= at:
            plan.due.append(run)
        elif again:
            plan.waiting.add(key)
        plan.failing.append(
            FailingBuild(
                key,
                run.error,
                run.tries,
                _iso(run.since),
                sensor,
                retrying=retrying,
                next_try=_iso(max(now, at)) if retrying else None,
            )
        )
    return plan


def failure_line(events: Iterable[dg.DagsterEvent]) -> str:
    """A failed run's error as one line, from its events: a `dg.Failure`'s description, else
    the failed step's error message, else the run failure's."""
    message = "the run failed"
    for event in events:
        if event.is_step_failure:
            data = event.step_failure_data
            described = data.user_failure_data
            if described is not None and described.description:
                return _first_line(described.description)
            if data.error is not None:
                return _first_line(data.error.message)
        elif event.event_type == dg.DagsterEventType.RUN_FAILURE and event.message:
            message = _first_line(event.message)
    return message


def spec_failure(description: str) -> dg.Failure:
    """The failure of a build whose spec is at fault (it names the file and the field):
    neither the run nor its sensor retries it; a fixed spec is new inputs."""
    return dg.Failure(description=description, allow_retries=False, metadata={SPEC_FAULT: True})


def _run_failure(instance: dg.DagsterInstance, run_id: str) -> tuple[str, bool]:
    """A failed run's error line, and whether its spec is at fault (no retry helps)."""
    kinds = {dg.DagsterEventType.STEP_FAILURE, dg.DagsterEventType.RUN_FAILURE}
    events = [e.dagster_event for e in instance.all_logs(run_id, of_type=kinds)]
    events = [e for e in events if e is not None]
    spec_at_fault = any(
        e.is_step_failure
        and e.step_failure_data.user_failure_data is not None
        and SPEC_FAULT in (e.step_failure_data.user_failure_data.metadata or {})
        for e in events
    )
    return failure_line(events), spec_at_fault


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or ["the run failed"])[0]


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat(timespec="seconds")
