"""The sensors under a real `dagster-daemon` on a temporary instance: a silver run and a gold
partition run that fail (a torn commit at the head of a table they read or write, a fault
outside the code) are retried inside the run (op retries), then by their sensor with
backoff under new run keys, reported as failing meanwhile (`_live/failing/`, what the
dashboard shows), and converge once the fault clears. Beside them, a spec that cannot build
(its re-admission source does not exist) and one that does not parse fail alone, named by
file, and are not retried: only a new spec helps."""

from __future__ import annotations

import sys
from pathlib import Path

import dagster as dg
import pytest

from claw_pipelines.app.instance import DAGSTER_YAML, initialize_storage
from claw_pipelines.app.processes import ServiceProcess, wait_until
from claw_pipelines.contracts.specs import CurationSpec, Readmission
from claw_pipelines.contracts.tables import BRONZE_EVENTS, gold_dataset_table
from claw_pipelines.defs.runs import RETRY_TAG
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import read_specs, save_spec
from claw_pipelines.materialize.failing import failing_builds
from claw_pipelines.materialize.silver import watermark
from tests.support.lakes import feedback, group_of, land

pytestmark = pytest.mark.soak
TORN = b'{"commitInfo": {"timestamp": 1, "operation": "WRITE"'  # a commit cut mid-write


def tear_head(lake: Path, table: str) -> Path:
    """Leave a torn commit at the head of `table`'s log (a writer that died mid-put on a
    store without atomic puts): every later read and write of the table fails."""
    log = lake / table / "_delta_log"
    head = max(int(p.stem) for p in log.glob("*.json"))
    torn = log / f"{head + 1:020d}.json"
    torn.write_bytes(TORN)
    return torn


def runs_of(instance: dg.DagsterInstance, job: str, **tags: str) -> list[dg.DagsterRun]:
    return list(instance.get_runs(dg.RunsFilter(job_name=job, tags=tags)))


def retried(runs: list[dg.DagsterRun]) -> list[dg.DagsterRun] | None:
    """The runs that retry a failed one (None: none yet)."""
    return [run for run in runs if int(run.tags.get(RETRY_TAG, 0)) >= 1] or None


def failing(lake: Lake) -> dict[str, object]:
    return {build.what: build for build in failing_builds(lake)}


def test_failed_sensor_runs_are_retried_with_backoff_reported_and_converge(tmp_path):
    root = tmp_path / "lake"
    lake = Lake(str(root))
    land(lake, group_of("g0", [1, 5], [1.0, 0.0]) + group_of("g1", [2, 5], [0.0, 1.0]))
    save_spec(lake, CurationSpec(name="good", merge="trajectory"))
    save_spec(lake, CurationSpec(name="orphan", readmit=Readmission(dataset="nowhere")))
    lake.write_text("specs/broken.yaml", "name: broken\nmax_policy_staleness: two\n")
    home = tmp_path / "dagster"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    daemon = ServiceProcess(
        "dagster-daemon",
        tmp_path / "daemon.log",
        env={
            "DAGSTER_HOME": str(home),
            "CLAW_LAKE_URI": str(root),
            "CLAW_RUN_RETRY_FIRST_S": "2",
            "CLAW_RUN_RETRIES": "3",
        },
        command=[
            str(Path(sys.executable).with_name("dagster-daemon")),
            *("run", "-m", "claw_pipelines.definitions"),
        ],
        ready=lambda: (home / "history").exists(),
    )
    initialize_storage(home)  # as `claw up` does: one process migrates a fresh storage
    daemon.start(timeout=90)
    try:
        instance = dg.DagsterInstance.from_config(str(home))
        good = {"dagster/partition": "good|1"}
        built = wait_until(lambda: good_built(lake, instance), 180, 1.0, "a first build")

        # a spec at fault fails alone, named by its file, and is not retried
        orphan = wait_until(lambda: failing(lake).get("orphan|1"), 60, 1.0, "orphan reported")
        assert orphan.error.startswith("specs/orphan.yaml: readmit:") and "nowhere" in orphan.error
        assert not orphan.retrying
        assert retried(runs_of(instance, "gold_job", **{"dagster/partition": "orphan|1"})) is None
        assert str(read_specs(lake).errors["broken"]).startswith("specs/broken.yaml:")
        assert not runs_of(instance, "gold_job", **{"dagster/partition/dataset": "broken"})

        # torn heads: silver's runs fail (the sensor, reading only the run marker, does not),
        # and so will the runs of `good`, whose table is torn too
        torn_silver = tear_head(root, "silver/feedback")
        torn_gold = tear_head(root, gold_dataset_table("good"))
        land(lake, [feedback({"trajectory_uid": "g0-r0"}, "reward", 0.5)])
        silver_retry = wait_until(
            lambda: retried(runs_of(instance, "silver_job")), 150, 1.0, "a silver retry"
        )[0]
        tries = sorted(runs_of(instance, "silver_job"), key=lambda r: r.tags.get(RETRY_TAG, "0"))
        failed = next(
            r
            for r in tries
            if r.tags.get("claw/inputs") == silver_retry.tags["claw/inputs"]
            and RETRY_TAG not in r.tags
        )
        assert failed.status == dg.DagsterRunStatus.FAILURE
        inside = instance.all_logs(failed.run_id, of_type=dg.DagsterEventType.STEP_UP_FOR_RETRY)
        assert len(inside) == 2  # retried twice inside the run first
        reported = wait_until(lambda: failing(lake).get("silver"), 30, 0.5, "silver reported")
        assert reported.retrying and reported.attempts >= 1 and reported.error

        torn_silver.unlink()  # the fault clears: silver catches up
        wait_until(lambda: watermark(lake) == lake.version(BRONZE_EVENTS), 120, 1.0, "silver")
        wait_until(lambda: "silver" not in failing(lake) or None, 60, 1.0, "silver recovered")

        # the new reward changes good|1's inputs: its run fails on the torn table, is retried
        wait_until(lambda: retried(runs_of(instance, "gold_job", **good)), 150, 1.0, "retry")
        assert failing(lake)["good|1"].retrying
        torn_gold.unlink()
        wait_until(lambda: good_built(lake, instance, after=built), 120, 1.0, "good rebuilt")
        wait_until(lambda: "good|1" not in failing(lake) or None, 60, 1.0, "good recovered")
        assert set(failing(lake)) == {"orphan|1"}
    finally:
        daemon.stop()


def good_built(lake: Lake, instance: dg.DagsterInstance, after: int = -1) -> int | None:
    """The version of gold/datasets/good once a successful run wrote it past `after`."""
    try:
        version = Lake(lake.uri).version(gold_dataset_table("good"))
    except Exception:  # torn: not yet
        return None
    if version is None:
        return None
    done = runs_of(instance, "gold_job", **{"dagster/partition": "good|1"})
    ok = any(run.status == dg.DagsterRunStatus.SUCCESS for run in done)
    return version if ok and version > after else None
