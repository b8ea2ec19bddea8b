"""Recovery: `claw check` finds what the old races left (keys twice in silver and gold, trees
that do not match, a watermark ahead of bronze), `claw repair` fixes it without losing an
acknowledged record, and the repaired lake's tree batches equal a fresh rebuild's. And a bad
spec file stops only its own dataset."""

from __future__ import annotations

import shutil
import subprocess
import sys
from datetime import timedelta

import dagster as dg
import numpy as np
import polars as pl

from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import DEFAULT_SPEC, CurationSpec, Readmission
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_LINEAGE,
    SILVER_FEEDBACK,
    SILVER_STEP_CONFLICTS,
    SILVER_STEPS,
    gold_dataset_spec,
)
from claw_pipelines.defs.gold import gold_partitions_sensor
from claw_pipelines.defs.resources import ClawLake
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import save_spec
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver, watermark
from claw_pipelines.ops.integrity import check_lake, repair_lake
from tests.support.dagster_runs import materialize_gold_partition
from tests.support.lakes import assert_each_once, fill_bronze, land, step
from tests.support.servers import REPO

BATCH_FIELDS = ("input_ids", "parent", "position_ids", "loss_mask", "advantages", "token_rewards")


def claw(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "claw_pipelines.app.cli", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)


def break_like_racing_runs(lake: Lake) -> None:
    """What overlapping runs used to leave: silver steps and facts appended twice, a later
    step under a taken key with other tokens, and gold built from that (keys twice)."""
    steps = lake.read(SILVER_STEPS)
    lake.append(SILVER_STEPS, steps.head(6).to_arrow())
    impostor = steps.head(1).with_columns(
        event_id=pl.lit("e-impostor"),
        response_ids=pl.lit([77, 78]).cast(pl.List(pl.Int32)),
        rollout_log_probs=pl.lit([-1.0, -1.0]).cast(pl.List(pl.Float32)),
        response_id=pl.lit("other-tokens"),
        created_at=pl.col("created_at") + timedelta(seconds=5),
    )
    lake.append(SILVER_STEPS, impostor.to_arrow())
    lake.append(SILVER_FEEDBACK, lake.read(SILVER_FEEDBACK).head(3).to_arrow())
    build_partition(lake, DEFAULT_SPEC, 1)
    rows = lake.read(gold_dataset_spec("default").name).head(2)
    lake.append(gold_dataset_spec("default"), rows.to_arrow())  # a step twice in gold


def batches(lake: Lake) -> list:
    return list(open_dataset("default", lake.uri).batches(1, 8, layout="tree", seed=3))


def test_check_finds_what_races_left_and_repair_fixes_it_like_a_fresh_rebuild(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    fill_bronze(lake)
    fresh = Lake(str(tmp_path / "fresh"))  # the same bronze, built once from scratch
    shutil.copytree(tmp_path / "lake" / "bronze", tmp_path / "fresh" / "bronze")
    build_silver(lake)
    build_partition(lake, DEFAULT_SPEC, 1)
    assert check_lake(lake) == []
    break_like_racing_runs(lake)

    found = claw("check", "--lake", lake.uri)
    assert found.returncode == 1 and "Traceback" not in found.stderr
    lines = found.stdout.splitlines()
    assert any(line.startswith("silver/steps: step_key held twice (6;") for line in lines)
    assert any(line.startswith("silver/feedback: feedback_id held twice (3;") for line in lines)
    assert any(line.startswith("gold/datasets/default: step_key held twice") for line in lines)
    assert any("gold/trees/default: the stored trees of policy version 1" in x for x in lines)
    assert found.stderr.strip().endswith("`claw repair` fixes them")
    pulled = [key for batch in batches(lake) for key in batch.step_keys]
    assert len(pulled) > len(set(pulled))  # a trainer would see steps twice

    repaired = claw("repair", "--lake", lake.uri)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "silver: removed 6 step_copies, 1 steps_moved_to_conflicts, 3 fact_copies" in (
        repaired.stdout
    )
    assert check_lake(lake) == []
    assert claw("check", "--lake", lake.uri).returncode == 0
    assert_each_once(lake)
    impostor = lake.read(SILVER_STEP_CONFLICTS).filter(pl.col("event_id") == "e-impostor")
    assert impostor.height == 1  # kept, as a conflict: nothing acknowledged is lost
    newest = lake.read(GOLD_LINEAGE).sort("written_at").row(-1, named=True)
    assert newest["reason"].startswith("repair: silver/steps: step_key held twice")

    build_silver(fresh)
    build_partition(fresh, DEFAULT_SPEC, 1)
    got, want = batches(lake), batches(fresh)
    assert len(got) == len(want) > 1
    for mine, theirs in zip(got, want, strict=True):
        assert mine.step_keys == theirs.step_keys
        for name in BATCH_FIELDS:
            assert np.array_equal(getattr(mine, name), getattr(theirs, name)), name


def test_a_watermark_ahead_of_bronze_is_found_and_bronze_is_read_again(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    fill_bronze(lake, 1)
    backup = tmp_path / "bronze-backup"
    shutil.copytree(tmp_path / "lake" / "bronze", backup)
    fill_bronze(lake, 2, tag="later")
    build_silver(lake)
    assert watermark(lake) == 3
    shutil.rmtree(tmp_path / "lake" / "bronze")  # bronze restored from an older backup...
    shutil.copytree(backup, tmp_path / "lake" / "bronze")
    lake = Lake(lake.uri)  # as a process started after the restore opens it
    land(lake, [step("after-restore", 0, [1, 2], [3], is_last=True)])  # ...then written to
    assert lake.version(BRONZE_EVENTS) == 2
    build_silver(lake)
    assert "after-restore:0" not in lake.read(SILVER_STEPS)["step_key"]  # it would never land

    (problem,) = check_lake(lake)
    assert str(problem) == "bronze/events: silver has read up to bronze v3, but bronze is at v2"
    report = repair_lake(lake)
    assert report.bronze_reread and report.remaining == []
    keys = lake.read(SILVER_STEPS)["step_key"]
    assert "after-restore:0" in keys and any(k.startswith("later") for k in keys)
    assert_each_once(lake)
    assert watermark(lake) == 2


def test_a_bad_spec_fails_only_its_own_dataset_naming_the_file_and_field(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    fill_bronze(lake, 1)
    build_silver(lake)
    save_spec(lake, CurationSpec(name="good", merge="trajectory"))
    lake.write_text("specs/broken.yaml", "name: broken\nmax_policy_staleness: two\n")
    expected = "specs/broken.yaml: max_policy_staleness: Input should be a valid integer"

    done = claw("materialize", "--lake", lake.uri)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"claw: error: materialization failed: {expected}, unable to parse string as an integer"
    ]
    assert "materialized gold/datasets[good|1]" in done.stdout
    assert "materialized gold/datasets[default|1]" in done.stdout
    assert open_dataset("good", lake.uri).steps(1).height > 0

    instance = dg.DagsterInstance.ephemeral()
    resources = {"claw": ClawLake(lake_uri=lake.uri)}
    with dg.build_sensor_context(instance=instance, resources=resources) as context:
        wanted = sorted(str(r.partition_key) for r in gold_partitions_sensor(context).run_requests)
    assert wanted == ["default|1", "good|1"]

    run = materialize_gold_partition(instance, resources, "broken", 1, raise_on_error=False)
    (failure,) = [e for e in run.all_events if e.is_step_failure]
    shown = failure.step_failure_data.user_failure_data.description  # the UI's headline
    assert shown == f"{expected}, unable to parse string as an integer"


def test_a_spec_that_cannot_build_fails_only_its_own_partitions_each_named(tmp_path):
    """Specs that parse but cannot build (a re-admission source that does not exist, a
    cycle) fail their own partitions under `claw materialize`, one line each naming the
    file; the good specs are built."""
    lake = Lake(str(tmp_path / "lake"))
    fill_bronze(lake, 1)
    build_silver(lake)
    save_spec(lake, CurationSpec(name="good", merge="trajectory"))
    save_spec(lake, CurationSpec(name="orphan", readmit=Readmission(dataset="nowhere")))
    save_spec(lake, CurationSpec(name="loop-a", readmit=Readmission(dataset="loop-b")))
    save_spec(lake, CurationSpec(name="loop-b", readmit=Readmission(dataset="loop-a")))

    done = claw("materialize", "--lake", lake.uri)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("claw: error: materialization failed: specs/")
    failed = sorted(line.split("materialization failed: ")[-1].strip() for line in lines)
    assert [line.split(" ", 1)[0] for line in failed] == [
        "specs/loop-a.yaml",
        "specs/loop-b.yaml",
        "specs/orphan.yaml",
    ]
    assert "cycle" in failed[0] and "cycle" in failed[1] and "nowhere" in failed[2]
    assert "materialized gold/datasets[good|1]" in done.stdout
    assert "materialized gold/datasets[default|1]" in done.stdout


def test_check_finds_stored_prompts_that_do_not_decode(tmp_path):
    """A reference to more tokens than its step has, and new tokens that were changed (the
    decoded prompt is not its `prompt_id`): both found (docs/DESIGN.md §18)."""
    lake = Lake(str(tmp_path / "lake"))
    fill_bronze(lake)
    build_silver(lake)
    assert check_lake(lake) == []
    steps = lake.read(SILVER_STEPS)
    later = steps.filter(pl.col("prefix_step_key").is_not_null()).sort("step_key")
    first, second = later["step_key"][0], later["step_key"][1]
    for key, change in (
        (first, {"prefix_len": pl.col("prefix_len") + 1_000}),
        (second, {"prompt_suffix_ids": pl.col("prompt_suffix_ids").list.eval(pl.element() + 1)}),
    ):
        row = steps.filter(pl.col("step_key") == key).with_columns(**change)
        lake.overwrite(SILVER_STEPS, row.to_arrow(), where=f"step_key = '{key}'")
        problems = [p for p in check_lake(lake) if "do not decode" in p.what]
        assert len(problems) == 1 and problems[0].sample == [key], problems
        lake.overwrite(
            SILVER_STEPS,
            steps.filter(pl.col("step_key") == key).to_arrow(),
            where=f"step_key = '{key}'",
        )
    assert check_lake(lake) == []
