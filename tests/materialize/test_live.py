"""The online loop: incremental gold equals a full rebuild and rewrites only what changed,
deadlines release or skip stragglers, trainers block for fresh whole groups delivered once
per consumer rank (disjoint shards, staleness), and both the live materializer and a trainer
survive SIGKILL without a group lost or delivered twice."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import dagster as dg
import polars as pl
import pytest

from claw_pipelines.app.materialize import follow
from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.contracts.specs import CurationSpec, Readmission
from claw_pipelines.contracts.tables import (
    GOLD_LINEAGE,
    gold_dataset_table,
    gold_rejection_table,
    gold_tree_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.policy import publish_policy_version
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.increments import update_dataset
from claw_pipelines.materialize.live import HEARTBEAT, LiveMaterializer, materializer_running
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.settings import ClawSettings
from tests.support.lakes import LIVE, completion, feedback, group_of, grown_lake, land, step
from tests.support.servers import REPO, wait_until


def gold_rows(lake: Lake, name: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    rows = lake.read(gold_dataset_table(name)).drop("landed_at").sort("step_key")
    return rows, lake.read(gold_tree_table(name)).sort("policy_version", "tree_id", "segment")


def fresh_copy(lake: Lake, path) -> Lake:
    """A lake with the same bronze and silver, and no gold."""
    for layer in ("bronze", "silver"):
        shutil.copytree(f"{lake.uri}/{layer}", path / layer)
    return Lake(str(path))


def test_increments_equal_a_full_rebuild_and_a_late_reward_rewrites_only_its_group(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    for i in range(5):
        land(lake, group_of(f"g{i}", [i, 7, 7], [1.0, 0.0, 0.5], version=1 + i % 2, turns=2))
        build_silver(lake)
        assert update_dataset(lake, LIVE).added == [f"{1 + i % 2}:g{i}"]  # each group once
    assert not update_dataset(lake, LIVE).changed  # nothing new: nothing written
    before = lake.read(gold_dataset_table("live")).select("step_key", "landed_at")

    land(lake, [feedback({"trajectory_uid": "g2-r1"}, "reward", 0.25)])
    build_silver(lake)
    late = update_dataset(lake, LIVE)
    assert late.rewritten == ["1:g2"] and not late.added and not late.removed
    reason = lake.read(GOLD_LINEAGE).sort("written_at")["reason"][-1]
    assert reason == (
        "increment: rewrote (inputs changed: a late reward, feedback or trajectory) 1 group(s): g2"
    )
    after = lake.read(gold_dataset_table("live")).select("step_key", "landed_at")
    moved = before.join(after, on="step_key", suffix="_after").filter(
        pl.col("landed_at") != pl.col("landed_at_after")
    )
    assert set(moved["step_key"].str.split(":").list.first()) == {"g2-r0", "g2-r1", "g2-r2"}

    full = fresh_copy(lake, tmp_path / "full")
    for version in (1, 2):
        build_partition(full, LIVE, version)
    for mine, theirs in zip(gold_rows(lake, "live"), gold_rows(full, "live"), strict=True):
        assert mine.equals(theirs, null_equal=True)
    dataset = Dataset(lake, "live")
    assert all(dataset.stored_trees(v, dataset.steps(v)) is not None for v in (1, 2))


def test_a_straggler_group_is_released_or_skipped_at_its_deadline(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    rows = group_of("done", [1], [1.0, 0.0])
    rows += [step("slow-r0", 0, [2], [3], group="slow"), completion("slow-r0", 1.0)]
    rows += [step("slow-r1", 0, [2], [4], group="slow")]  # never completes
    land(lake, rows)
    build_silver(lake)
    release = LIVE.model_copy(update={"name": "release", "group_deadline_s": 0.5})
    skip = release.model_copy(update={"name": "skip", "on_deadline": "skip"})
    for spec in (release, skip):
        assert update_dataset(lake, spec).added == ["1:done"]  # the straggler waits
    land(lake, [step(f"later-{i}", 0, [9], [9]) for i in range(600)])  # 600 ms of data time
    build_silver(lake)
    released = update_dataset(lake, release)
    assert released.added == ["1:slow"]
    rows = lake.read(gold_dataset_table("release")).filter(pl.col("prompt_uid") == "slow")
    assert rows["admission"].to_list() == ["deadline"]  # its complete trajectory only
    assert rows["step_key"].to_list() == ["slow-r0:0"]
    skipped = update_dataset(lake, skip)
    assert not skipped.added and not skipped.rewritten  # skipped: never delivered
    kept = lake.read(gold_dataset_table("skip"))["prompt_uid"].unique().to_list()
    assert kept == ["done"]
    assert skipped.rejected == [1]  # but kept as a rejection, with its reason
    left_out = lake.read(gold_rejection_table("skip")).filter(pl.col("group_key") == "slow")
    reasons = dict(zip(left_out["step_key"], left_out["reasons"].to_list(), strict=True))
    # slow-r1 also waits for its reward, in a trajectory still open
    assert reasons == {"slow-r0:0": ["deadline"], "slow-r1:0": ["reward", "incomplete", "deadline"]}


@pytest.fixture
def grown(tmp_path) -> Lake:
    return grown_lake(tmp_path / "lake")


def test_ranks_get_disjoint_shards_that_cover_every_group_once(grown):
    dataset = Dataset(grown, "live")
    delivered: dict[int, list[str]] = {}
    for rank in range(3):
        pulled = []
        for size in (2, 1):  # pairs while there are, then the one left over
            while batch := dataset.next_batch(
                size, consumer="ddp", rank=rank, world_size=3, timeout=0
            ):
                assert len(batch.groups) == size
                assert all(batch.step_policy_versions >= 1)
                pulled += batch.groups
        delivered[rank] = pulled
    everything = [unit for units in delivered.values() for unit in units]
    assert len(everything) == len(set(everything)) == 12
    assert all(delivered.values())  # each rank got some
    again = [
        u for b in dataset.replay("ddp", rank=1) for u in b.groups
    ]  # replay rebuilds what rank 1 got, in order
    assert again == delivered[1]


def test_next_batch_blocks_for_fresh_groups_within_the_staleness_bound(grown):
    stale = LIVE.model_copy(update={"name": "recent", "max_policy_staleness": 1})
    update_dataset(grown, stale)
    dataset = Dataset(grown, "recent")
    publish_policy_version(grown, 3)
    assert dataset.staleness_floor() == 2
    first = dataset.next_batch(20, consumer="t", timeout=0) or dataset.next_batch(
        consumer="t", max_tokens=10**6, timeout=0
    )
    assert set(first.step_policy_versions.tolist()) <= {2, 3}  # version 1 is too stale
    assert dataset.next_batch(consumer="t", timeout=0.3) is None  # nothing left

    def land_later():
        time.sleep(0.5)
        land(grown, group_of("late", [9], [1.0, 0.0], version=3))
        build_silver(grown)
        update_dataset(grown, stale)

    threading.Thread(target=land_later).start()
    started = time.monotonic()
    fresh = dataset.next_batch(consumer="t", timeout=20, poll_s=0.05)
    assert fresh is not None and fresh.groups == ["3:late"]
    assert time.monotonic() - started >= 0.5
    with pytest.raises(ValueError, match="rank must be in"):
        dataset.next_batch(consumer="t", rank=2, world_size=2)


def test_the_budget_counts_tokens_and_never_splits_a_group(grown):
    dataset = Dataset(grown, "live")
    sizes = (
        dataset.steps()
        .group_by("prompt_uid")
        .agg(tokens=(pl.col("prompt_len") + pl.col("response_len")).sum())
    )
    one = int(sizes["tokens"].max())
    batch = dataset.next_batch(consumer="budget", max_tokens=2 * one, timeout=0)
    assert 1 <= len(batch.groups) <= 2
    alone = dataset.next_batch(consumer="tiny", max_tokens=1, timeout=0)
    assert len(alone.groups) == 1  # a group over budget goes alone, whole


TRAINER = """
import sys, time
from claw_pipelines.consume.dataset import Dataset
from claw_pipelines.lake.delta import Lake
dataset = Dataset(Lake(sys.argv[1]), "live")
while True:
    batch = dataset.next_batch(1, consumer="killed", timeout=30, poll_s=0.05)
    print(batch.batch_index, *batch.groups, flush=True)
    time.sleep(0.2)  # training
"""


def test_a_trainer_killed_mid_run_resumes_without_repeats_or_gaps(grown):
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, grown.uri], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    trained = [proc.stdout.readline().split() for _ in range(4)]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    last_trained = int(trained[-1][0])
    dataset = Dataset(grown, "live")
    resumed = [u for b in dataset.replay("killed", after_batch=last_trained) for u in b.groups]
    while (batch := dataset.next_batch(1, consumer="killed", timeout=0)) is not None:
        resumed += batch.groups
    seen = [unit for _, unit in trained] + resumed
    assert len(seen) == len(set(seen)) == 12  # every group once: none twice, none skipped


def test_a_dataset_trainers_pull_from_goes_first_and_the_others_follow(tmp_path, monkeypatch):
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    save_spec(lake, LIVE.model_copy(update={"name": "other"}))
    land(lake, group_of("g0", [1, 5], [1.0, 0.0]))
    live = LiveMaterializer(lake)
    assert {g.dataset for g in live.step().gold} >= {"live", "other"}  # nobody pulls: all
    assert Dataset(lake, "live").next_batch(1, consumer="t", timeout=0).groups == ["1:g0"]
    monkeypatch.setattr("claw_pipelines.materialize.live.SPECS_EVERY_S", 0.0)
    monkeypatch.setattr("claw_pipelines.materialize.live.PULLS_EVERY_S", 0.0)
    monkeypatch.setattr("claw_pipelines.materialize.live.BACKGROUND_S", 3600.0)
    land(lake, group_of("g1", [2, 5], [1.0, 0.0]))
    done = live.step()
    assert next(g.dataset for g in done.gold) == "live"  # the pulled dataset first
    assert "other" not in {g.dataset for g in done.gold}  # the others wait their turn
    monkeypatch.setattr("claw_pipelines.materialize.live.BACKGROUND_S", 0.0)
    land(lake, group_of("g2", [3, 5], [1.0, 0.0]))
    done = live.step()  # the others catch up beside the rounds, in the worker
    assert [g.dataset for g in done.gold] == ["live"] and "other" in done.aside
    caught, deadline = [], time.monotonic() + 60
    while "other" not in caught and time.monotonic() < deadline:
        caught += live.step().beside
        time.sleep(0.05)
    live.close()
    assert "live" not in caught
    assert Dataset(lake, "live").steps()["prompt_uid"].n_unique() == 3
    assert Dataset(lake, "other").steps()["prompt_uid"].n_unique() == 3


def test_a_materializer_for_some_datasets_builds_those_only(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    save_spec(lake, LIVE.model_copy(update={"name": "other"}))
    land(lake, group_of("g0", [1, 5], [1.0, 0.0]))
    live = LiveMaterializer(lake, datasets=["live"])  # `claw materialize --follow --dataset`
    done = live.step()
    live.close()
    assert done.silver is not None and {g.dataset for g in done.gold} == {"live"}
    assert Dataset(lake, "live").steps()["prompt_uid"].to_list() == ["g0", "g0"]
    with pytest.raises(LookupError, match="other"):
        Dataset(lake, "other")


class Killed(BaseException):
    """Stands for a SIGKILL between two commits of one increment."""


def test_an_increment_killed_between_its_dataset_and_trees_commits_converges(tmp_path, monkeypatch):
    lake = Lake(str(tmp_path / "lake"))
    land(lake, group_of("first", [1, 7], [1.0, 0.0], version=1))
    build_silver(lake)
    update_dataset(lake, LIVE)
    land(lake, group_of("torn", [2, 7], [1.0, 0.0], version=1))
    build_silver(lake)
    real_append = Lake.append

    def append_then_die(self, table, rows, **kwargs):
        name = table if isinstance(table, str) else table.name
        if name == gold_tree_table("live"):
            raise Killed
        return real_append(self, table, rows, **kwargs)

    monkeypatch.setattr(Lake, "append", append_then_die)
    with pytest.raises(Killed):
        update_dataset(lake, LIVE)  # its steps are in gold/datasets, its trees are not
    monkeypatch.setattr(Lake, "append", real_append)
    assert "torn-r0:0" in lake.read(gold_dataset_table("live"))["step_key"].to_list()

    again = Lake(lake.uri)
    assert update_dataset(again, LIVE).rewritten == ["1:torn"]
    full = fresh_copy(again, tmp_path / "full")
    build_partition(full, LIVE, 1)
    for mine, theirs in zip(gold_rows(again, "live"), gold_rows(full, "live"), strict=True):
        assert mine.equals(theirs, null_equal=True)
    assert not update_dataset(again, LIVE).changed


def test_the_live_materializer_survives_sigkill_and_lands_each_group_once(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    env = {**os.environ, "CLAW_LAKE_URI": lake.uri}
    env.pop("DAGSTER_HOME", None)
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--follow"]
    command += ["--poll-s", "0.05"]
    landed = 0
    for _ in range(3):  # three lives
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
        for _group in range(4):
            land(lake, group_of(f"l{landed:02d}", [landed, 3], [1.0, 0.0], version=1))
            landed += 1
            time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)  # wherever it is: mid-silver, mid-gold, idle
        proc.wait(10)
    live = LiveMaterializer(lake)
    while live.step().changed:
        pass
    assert not live.failing, live.failing
    keys = lake.read(gold_dataset_table("live"))["step_key"]
    assert keys.n_unique() == keys.len() == landed * 2
    full = fresh_copy(lake, tmp_path / "full")
    build_partition(full, LIVE, 1)
    for mine, theirs in zip(gold_rows(lake, "live"), gold_rows(full, "live"), strict=True):
        assert mine.equals(theirs, null_equal=True)


def test_follow_reports_increments_to_dagster_and_silences_the_sensors(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    (tmp_path / "dagster").mkdir()
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    land(lake, group_of("d", [1], [1.0, 0.0], version=2))
    stop, said = threading.Event(), []
    settings = ClawSettings().with_overrides(lake_uri=lake.uri)
    worker = threading.Thread(target=follow, args=(settings, 0.05, stop, said.append))
    worker.start()
    try:
        wait_until(
            lambda: any("live: +1" in line for line in said) and materializer_running(lake),
            60,
            what="the live dataset and the materializer's heartbeat",
        )
        from claw_pipelines.defs.gold import gold_partitions_sensor
        from claw_pipelines.defs.resources import ClawLake

        with dg.build_sensor_context(
            instance=dg.DagsterInstance.get(), resources={"claw": ClawLake(lake_uri=lake.uri)}
        ) as context:
            skipped = gold_partitions_sensor(context)
        assert "live materializer" in skipped.skip_message
    finally:
        stop.set()
        worker.join(30)
    instance = dg.DagsterInstance.get()
    steps = instance.get_latest_materialization_event(dg.AssetKey(["silver", "steps"]))
    assert steps.asset_materialization.metadata["materialized_by"].value == (
        "claw materialize --follow"
    )
    partition = instance.get_latest_materialization_event(dg.AssetKey(["gold", "datasets"]))
    assert partition.asset_materialization.partition == "live|2"
    assert any(re.search(r"live: \+1 ~0 -0 groups \(\d+\.\d\d s\)", line) for line in said)


def test_a_failing_dataset_stops_alone_and_is_tried_again_with_backoff(tmp_path, monkeypatch):
    # a first wait long enough for a step of every dataset on a loaded machine (1.5 s lapsed
    # once under `make test`, and the second step retried)
    monkeypatch.setattr("claw_pipelines.materialize.live.RETRY_FIRST_S", 3.0)
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    save_spec(lake, CurationSpec(name="orphan", readmit=Readmission(dataset="nowhere")))
    save_spec(lake, CurationSpec(name="loop-a", readmit=Readmission(dataset="loop-b")))
    save_spec(lake, CurationSpec(name="loop-b", readmit=Readmission(dataset="loop-a")))
    land(lake, group_of("g0", [1, 5], [1.0, 0.0]))
    live = LiveMaterializer(lake)
    done = live.step()
    assert {"live", "default"} <= {g.dataset for g in done.gold}  # the others keep building
    assert set(done.failed) == {"orphan", "loop-a", "loop-b"}
    assert done.failed["orphan"].error.startswith("specs/orphan.yaml: SpecError: readmit:")
    assert "nowhere" in done.failed["orphan"].error
    assert "cycle" in done.failed["loop-a"].error
    beat = json.loads(lake.read_text(HEARTBEAT))
    assert beat["failing"]["orphan"]["attempts"] == 1  # shown to operators
    land(lake, group_of("g1", [2, 5], [1.0, 0.0]))
    again = live.step()  # within the backoff: not tried, the rest goes on
    assert not again.failed and "live" in {g.dataset for g in again.gold}
    time.sleep(3.1)
    land(lake, group_of("g2", [3, 5], [1.0, 0.0]))
    third = live.step()  # tried again, failing again: the wait doubles
    assert third.failed["orphan"].attempts == 2
    assert third.failed["orphan"].retry_at - time.monotonic() > 2.0
    save_spec(lake, CurationSpec(name="orphan"))  # fixed: built once its wait is over
    monkeypatch.setattr("claw_pipelines.materialize.live.SPECS_EVERY_S", 0.0)
    monkeypatch.setattr("claw_pipelines.materialize.live.PULLS_EVERY_S", 0.0)
    deadline = time.monotonic() + 30
    while "orphan" in live.failing or not lake.exists("gold/datasets/orphan"):
        assert time.monotonic() < deadline, live.failing
        live.step()
        time.sleep(0.05)
    assert Dataset(lake, "orphan").steps()["prompt_uid"].n_unique() == 3
    assert "orphan" not in json.loads(lake.read_text(HEARTBEAT))["failing"]


def test_a_first_silver_run_killed_after_its_appends_is_derived_whole_by_the_next(
    tmp_path, monkeypatch
):
    """No run marker yet, steps already appended (the first run died before its derived
    rows): the next run derives them too, so gold keeps those groups."""
    lake = Lake(str(tmp_path / "lake"))
    save_spec(lake, LIVE)
    land(lake, group_of("first", [1, 5], [1.0, 0.0]))
    real_append = Lake.append

    def append_then_die(self, table, rows, **kwargs):
        version = real_append(self, table, rows, **kwargs)
        if (table if isinstance(table, str) else table.name) == "silver/steps":
            raise Killed
        return version

    monkeypatch.setattr(Lake, "append", append_then_die)
    with pytest.raises(Killed):
        build_silver(lake)
    monkeypatch.setattr(Lake, "append", real_append)
    land(lake, group_of("second", [2, 5], [1.0, 0.0]))
    again = Lake(lake.uri)
    build_silver(again)
    trajectories = again.read("silver/trajectories")["trajectory_uid"].to_list()
    assert sorted(trajectories) == ["first-r0", "first-r1", "second-r0", "second-r1"]
    update_dataset(again, LIVE)
    groups = again.read(gold_dataset_table("live"))["prompt_uid"].unique().sort().to_list()
    assert groups == ["first", "second"]
