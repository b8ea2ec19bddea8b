"""Full rebuilds as one Dagster run of parallel shares (`gold_rebuild_job`, docs/DESIGN.md
§19): the shares run in processes of their own, each partition is reported as the gold
assets' partition with its checks, and the dataset equals one writer's build."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import polars as pl
import pydantic
import pytest
import yaml

from claw_pipelines.app.materialize import materialize
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import gold_dataset_table, gold_tree_table
from claw_pipelines.defs.rebuild import split_versions
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.settings import ClawSettings
from tests.support.lakes import group_of, land

SPEC = CurationSpec(
    name="rebuilt", reward_status=["final", "missing"], merge="prompt_group", advantage="grpo"
)
VERSIONS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def lakes(tmp_path_factory) -> tuple[Lake, Lake]:
    """Sixteen groups over policy versions 1-4 in silver, the spec saved, no gold: the lake
    to rebuild, and a copy built by one writer partition by partition."""
    root = tmp_path_factory.mktemp("rebuild")
    lake = Lake(str(root / "lake"))
    for i in range(16):
        land(lake, group_of(f"g{i:02d}", [i, 3], [1.0, 0.0, 0.5], version=VERSIONS[i % 4]))
    build_silver(lake)
    save_spec(lake, SPEC)
    shutil.copytree(lake.uri, root / "one")
    one = Lake(str(root / "one"))
    for version in VERSIONS:
        build_partition(one, SPEC, version)
    return lake, one


def rows(lake: Lake) -> tuple[pl.DataFrame, pl.DataFrame]:
    dataset = lake.read(gold_dataset_table(SPEC.name)).drop("landed_at").sort("step_key")
    trees = lake.read(gold_tree_table(SPEC.name)).sort("policy_version", "tree_id", "segment")
    return dataset, trees


def test_versions_split_into_balanced_shares_each_version_once():
    shares = split_versions({1: 100, 2: 60, 3: 50, 4: 10, 5: 0}, 2)
    assert sorted(v for share in shares for v in share) == [1, 2, 3, 4, 5]
    assert [sum({1: 100, 2: 60, 3: 50, 4: 10, 5: 0}[v] for v in s) for s in shares] == [110, 110]
    assert split_versions({7: 3}, 4) == [[7]]  # no empty share
    assert split_versions({}, 2) == []


def test_a_rebuild_in_two_processes_equals_one_writer_and_reports_every_partition(
    lakes, tmp_path, monkeypatch
):
    lake, one = lakes
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    (tmp_path / "dagster").mkdir()
    report = materialize(ClawSettings(lake_uri=lake.uri), ["group:gold"], [SPEC.name], parallel=2)
    assert report.success, report.errors
    for version in VERSIONS:
        partition = f"{SPEC.name}|{version}"
        assert report.assets[f"gold/datasets[{partition}]"]["steps"] > 0
        assert f"gold/trees[{partition}]" in report.assets
        assert report.checks[f"gold/trees[{partition}]:steps_rebuild_from_trees"]
    assert all(report.checks.values()) and len(report.checks) == 5 * len(VERSIONS)
    built, expected = rows(lake), rows(one)
    assert built[0].equals(expected[0]) and built[1].equals(expected[1])

    with dg.DagsterInstance.get() as instance:  # the run's shares ran in two processes
        (run,) = instance.get_runs(dg.RunsFilter(job_name="gold_rebuild_job"))
        assert run.status == dg.DagsterRunStatus.SUCCESS
        started = [
            entry.dagster_event.pid
            for entry in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_START)
            if entry.step_key.startswith("rebuild_share")
        ]
        assert len(started) == 2 and len(set(started)) == 2
        materialized = instance.fetch_materializations(
            dg.AssetKey(["gold", "datasets"]), limit=10
        ).records
        assert sorted(r.partition_key for r in materialized) == [
            f"{SPEC.name}|{v}" for v in VERSIONS
        ]


def test_a_policy_version_silver_does_not_hold_fails_with_one_line(lakes):
    lake, _ = lakes
    report = materialize(
        ClawSettings(lake_uri=lake.uri), ["group:gold"], [SPEC.name], [9], parallel=2
    )
    assert not report.success
    assert "policy version 9 does not exist" in report.errors[0]


EXECUTOR_OF_LOCATION = """
import json, dagster as dg
from claw_pipelines.definitions import defs
job = defs.resolve_job_def("gold_rebuild_job")
execution = {"max_concurrent": 2}
if job.executor_def.name == "k8s":
    execution["job_namespace"] = "claw"
config = {"ops": {"plan_rebuild": {"config": {"dataset": "rebuilt"}}},
          "execution": {"config": execution}}
valid = dg.validate_run_config(job, config)
print(json.dumps({"executor": job.executor_def.name, "validated": bool(valid)}))
"""


@pytest.mark.parametrize("setting", [None, "k8s"])
def test_the_chart_values_run_each_share_as_a_kubernetes_job(setting):
    """The code location as the chart's values start it (CLAW_REBUILD_EXECUTOR=k8s) gives the
    rebuild dagster-k8s's k8s_job_executor (a Job a share), whose config takes the CLI's
    max_concurrent with a namespace; unset, the multiprocess executor."""
    repo = Path(__file__).resolve().parents[2]
    values = yaml.safe_load((repo / "deploy" / "helm" / "values.yaml").read_text())
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert deployment["env"]["CLAW_REBUILD_EXECUTOR"] == "k8s"
    env = {k: v for k, v in os.environ.items() if k != "CLAW_REBUILD_EXECUTOR"}
    if setting:
        env["CLAW_REBUILD_EXECUTOR"] = setting
    done = subprocess.run(
        [sys.executable, "-c", EXECUTOR_OF_LOCATION],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"executor": setting or "multiprocess", "validated": True}


def test_an_unknown_rebuild_executor_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("CLAW_REBUILD_EXECUTOR", "threads")
    with pytest.raises(pydantic.ValidationError, match="rebuild_executor"):
        ClawSettings()
