"""Exactly-once under the stack's own concurrency: silver builds and gold builds racing from
the same state (threads and separate processes, released together at their first commit),
and a silver run killed between its tables' commits. Each ends with every record once,
equal to what one uninterrupted writer makes."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading

import polars as pl
import pytest

from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import DEFAULT_SPEC
from claw_pipelines.contracts.tables import (
    GOLD_LINEAGE,
    SILVER_FEEDBACK,
    SILVER_STEP_CONFLICTS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
    gold_dataset_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver, silver_state, watermark
from claw_pipelines.ops.integrity import SILVER_KEYS as KEYS
from tests.support.lakes import (
    assert_each_once,
    fill_bronze,
)
from tests.support.racing import (
    KILL_SCRIPT,
    BarrierLake,
    race_gold_in_process,
    race_in_processes,
    race_silver_in_process,
    race_silver_in_threads,
)
from tests.support.servers import REPO, wait_until


def silver_frames(lake: Lake) -> dict[str, pl.DataFrame]:
    return {table: lake.read(table).sort(key) for table, key in KEYS.items()}


def assert_same_silver(got: Lake, want: Lake) -> None:
    assert watermark(got) == watermark(want)
    mine, theirs = silver_frames(got), silver_frames(want)
    for table in KEYS:
        assert mine[table].equals(theirs[table], null_equal=True), table


@pytest.fixture
def source(tmp_path) -> Lake:
    lake = Lake(str(tmp_path / "source"))
    fill_bronze(lake)
    return lake


def copy_of(lake: Lake, path) -> Lake:
    shutil.copytree(lake.uri, path)
    return Lake(str(path))


def test_silver_builds_in_threads_from_one_watermark_land_each_step_once(source, tmp_path):
    build_silver(source)  # racers start from a watermark, not from nothing
    fill_bronze(source, 2, tag="more")
    clean = copy_of(source, tmp_path / "clean")
    assert watermark(source) < source.version("bronze/events")

    summaries = race_silver_in_threads(source.uri, racers=3)
    assert sum(s["write_conflicts"] for s in summaries) >= 2  # all read it, one landed first
    build_silver(clean)
    assert_each_once(source)
    assert_same_silver(source, clean)


def test_silver_builds_in_separate_processes_from_one_watermark_land_each_step_once(
    source, tmp_path
):
    clean = copy_of(source, tmp_path / "clean")
    summaries = race_in_processes(race_silver_in_process, source.uri)
    build_silver(clean)
    assert any(s["write_conflicts"] for s in summaries)
    assert_each_once(source)
    assert_same_silver(source, clean)


@pytest.mark.parametrize(
    "victim", [SILVER_STEP_CONFLICTS, SILVER_FEEDBACK, SILVER_STEPS, SILVER_STEP_REWARDS]
)
def test_a_run_killed_between_its_tables_commits_counts_nothing_twice(source, tmp_path, victim):
    build_silver(source)
    fill_bronze(source, 2, tag="more")
    clean = copy_of(source, tmp_path / "clean")
    build_silver(clean)
    before = silver_state(source)
    killed = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, source.uri, victim], cwd=REPO, capture_output=True
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    after = silver_state(source)
    assert after == before  # readers still see the last completed run...
    assert source.version(victim) > before.versions[victim]  # ...not the killed one's commit
    build_silver(source)
    assert_each_once(source)
    assert_same_silver(source, clean)


def test_gold_builds_of_one_partition_racing_land_the_newest_whole(source, tmp_path):
    build_silver(source)
    barrier = threading.Barrier(2)
    built: list = []
    errors: list[BaseException] = []

    def racer(lake: Lake) -> None:
        try:
            built.append(build_partition(lake, DEFAULT_SPEC, 1))
        except BaseException as exc:  # reported below
            errors.append(exc)

    stale = threading.Thread(target=racer, args=(BarrierLake(source.uri, barrier),))
    stale.start()  # computes from this silver, then waits at its first commit...
    wait_until(lambda: barrier.n_waiting == 1, 60, what="the first build at its commit")
    fill_bronze(source, 1, tag="late")  # ...while silver moves on
    build_silver(source)
    fresh = threading.Thread(target=racer, args=(BarrierLake(source.uri, barrier),))
    fresh.start()
    stale.join(120)
    fresh.join(120)
    assert not errors, errors
    assert sum(part.write_conflicts for part in built) >= 1

    rebuilt = copy_of(source, tmp_path / "rebuilt")
    want = build_partition(rebuilt, DEFAULT_SPEC, 1).steps
    got = open_dataset("default", source.uri).steps(1)
    assert got["step_key"].n_unique() == got.height
    assert sorted(got["step_key"]) == sorted(want["step_key"])
    assert any(k.startswith("late") for k in got["step_key"])  # the newest silver won
    lineage = source.read(GOLD_LINEAGE).sort("dataset_version")
    newest = lineage.row(-1, named=True)
    assert newest["dataset_version"] == source.version(gold_dataset_table("default"))
    dataset = open_dataset("default", source.uri)
    tree = [b for b in dataset.batches(1, 1000, layout="tree")]
    flat = [b for b in dataset.batches(1, 1000, layout="flat")]
    assert sorted(tree[0].step_keys) == sorted(flat[0].step_keys) == sorted(got["step_key"])
    assert dataset.stored_trees(1, dataset.steps(1)) is not None  # the stored trees were used


def test_gold_builds_of_one_partition_in_separate_processes_land_one_whole_result(source):
    build_silver(source)
    lost = race_in_processes(race_gold_in_process, source.uri)
    assert sum(lost) >= 1  # both computed from the same state; one was redone
    dataset = open_dataset("default", source.uri)
    steps = dataset.steps(1)
    assert steps["step_key"].n_unique() == steps.height > 0
    assert dataset.stored_trees(1, steps) is not None  # the trees of the same build
    lineage = source.read(GOLD_LINEAGE).sort("dataset_version")
    assert lineage.height == 2 and lineage["dataset_version"].is_unique().all()
    assert lineage["dataset_version"][-1] == dataset.version
