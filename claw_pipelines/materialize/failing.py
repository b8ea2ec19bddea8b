"""Builds that keep failing, as their builders report them (for the dashboard and `claw
status`): the live materializer lists its failing datasets in its heartbeat; the Dagster
sensors write, each tick that changes it, the runs they are retrying or gave up on
(`SENSOR_FAILING`, one file per sensor). A dataset that fails is never silently stale: it is
listed here until a build of it succeeds."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.live import HEARTBEAT, materializer_running

SENSOR_FAILING = "_live/failing/{sensor}.json"
SENSORS = ("bronze_version_sensor", "gold_partitions_sensor")  # the Dagster sensors that build


@dataclass(frozen=True)
class FailingBuild:
    """One dataset, gold partition or silver that fails to build: the last error (one line,
    naming the spec file where a spec is at fault), the failures in a row, since when, who
    builds it, and whether it is tried again (False: given up until its inputs change)."""

    what: str  # a dataset, a "dataset|policy_version" partition, or "silver"
    error: str
    attempts: int
    since: str  # ISO time of the first failure in the row
    by: str  # "live materializer" or the Dagster sensor's name
    retrying: bool = True
    next_try: str | None = None  # ISO time of the next try, when retrying

    def line(self) -> str:
        """The build as one line for people."""
        state = f"next try {self.next_try}" if self.retrying and self.next_try else "retrying"
        state = state if self.retrying else "given up until its inputs change"
        return (
            f"{self.what}: {self.error} ({self.attempts} failures in a row since "
            f"{self.since}, {self.by}; {state})"
        )


def report_sensor_failures(lake: Lake, sensor: str, builds: list[FailingBuild]) -> None:
    """Record what `sensor` retries or gave up on now (written only when it changed)."""
    path = SENSOR_FAILING.format(sensor=sensor)
    text = json.dumps(sorted((asdict(b) for b in builds), key=lambda b: b["what"]))
    try:
        if (lake.read_text(path) or "[]") == text:
            return
    except OSError:
        pass
    lake.write_text(path, text)


def failing_builds(lake: Lake) -> list[FailingBuild]:
    """Every failing build the lake's builders report: the running live materializer's
    datasets and what the Dagster sensors retry or gave up on."""
    found = []
    if materializer_running(lake):
        beat = _json(lake, HEARTBEAT) or {}
        for name, failing in (beat.get("failing") or {}).items():
            found.append(
                FailingBuild(
                    name,
                    failing["error"],
                    failing["attempts"],
                    failing["since"],
                    "live materializer",
                    next_try=failing.get("next_try"),
                )
            )
    for sensor in SENSORS:
        found += [
            FailingBuild(**b) for b in _json(lake, SENSOR_FAILING.format(sensor=sensor)) or []
        ]
    return found


def _json(lake: Lake, path: str):
    try:
        text = lake.read_text(path)
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None
