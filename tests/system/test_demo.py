"""`claw demo` end to end in a temp directory: real processes, then the lake is checked, the
summary's numbers against the lake read here, and the closing hints run as printed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from claw_pipelines.app.demo import demo_summary
from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.materialize.silver import SILVER_TABLES
from tests.support.lakes import rebuilt_sequences
from tests.support.servers import REPO


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, str]:
    """One `claw demo` run: its lake directory and what it printed on stdout."""
    lake_dir = tmp_path_factory.mktemp("demo") / "lake"
    done = subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", "demo", "--lake", str(lake_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return lake_dir, done.stdout


def number(pattern: str, text: str) -> int:
    """The first group of `pattern` in `text`, as an int."""
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text}"
    return int(found[1])


@pytest.mark.slow
def test_claw_demo_fills_bronze_and_silver(demo):
    lake_dir, stdout = demo
    lake = Lake(str(lake_dir))
    for table in ("bronze/events", *SILVER_TABLES):
        assert lake.exists(table), table
    steps = lake.read(SILVER_STEPS)
    assert steps.height == number(r"silver steps\s+(\d+) in silver/steps", stdout) > 0
    assert steps["step_key"].n_unique() == steps.height
    stitched = steps.filter(pl.col("origin_step_key").is_not_null())
    assert stitched.height > stitched["trajectory_uid"].n_unique() > 0  # turns were joined
    assert re.search(r"checks\s+(\d+)/\1 Dagster asset checks passed", stdout)  # gold checks
    # included: every step rebuilds from its tree, trees hold exactly U tokens
    lineage = lake.read("gold/lineage")
    assert set(lineage["dataset"]) == {"default", "live-grpo"}
    newest = lineage.filter(pl.col("dataset") == "default").sort("written_at")
    newest = newest.unique("policy_version", keep="last")
    dataset = read_steps(lake, "gold/datasets/default")  # whole prompts (docs/DESIGN.md §18)
    assert dataset.height == newest["steps"].sum() > 0
    trees = lake.read("gold/trees/default")
    assert trees.height == dataset.height  # a segment per step
    consumers = lake.read("gold/consumption")["consumer"].unique().sort().to_list()
    assert consumers == ["claw-demo", "claw-demo-trainer"]
    # the online loop: three rounds, each on fresh groups of the policy it published last
    rounds = re.findall(
        r"online round (\d)\s+policy v(\d+): (\d+) groups.*published v(\d+)", stdout
    )
    assert [r[0] for r in rounds] == ["1", "2", "3"]
    assert all(int(r[3]) == int(r[1]) + 1 and int(r[2]) == 4 for r in rounds)
    assert [int(r[1]) for r in rounds] == [4, 5, 6]
    published = lake.read("gold/policy_versions")["policy_version"].sort().to_list()
    assert published == [4, 5, 6, 7]
    stamped = steps.filter(pl.col("metadata").str.contains("policy_version_via"))
    assert set(stamped["policy_version"]) == {4, 5, 6}  # the gateway stamped the published one
    # every step rebuilds from the stored tree rows alone
    sequences = {
        k: p + r for k, p, r in dataset.select("step_key", "prompt_ids", "response_ids").iter_rows()
    }
    for version in trees["policy_version"].unique().to_list():
        rows = trees.filter(pl.col("policy_version") == version)
        stored = rows.to_dicts()
        for row, rebuilt in zip(stored, rebuilt_sequences(stored), strict=True):
            assert rebuilt == sequences[row["step_key"]]


@pytest.mark.slow
def test_demo_summary_adds_up_and_agrees_with_the_lake(demo):
    lake_dir, stdout = demo
    summary = demo_summary(Lake(str(lake_dir)))
    bronze = pl.read_delta(str(lake_dir / "bronze/events"))
    silver = pl.read_delta(str(lake_dir / "silver/steps"))
    trajectories = pl.read_delta(str(lake_dir / "silver/trajectories"))
    # bronze: records by kind add up, and the gateway acknowledged each exactly once
    assert summary.records == bronze.height == number(r"(\d+) records landed", stdout)
    assert summary.records_by_kind == dict(bronze.group_by("kind").len().iter_rows())
    acked = re.search(
        r"acknowledged (\d+) records by event id .* \+ (\d+) proxied .* = (\d+)", stdout
    )
    assert int(acked[1]) + int(acked[2]) == int(acked[3]) == bronze.height
    assert int(acked[2]) == summary.records_by_kind["chat_completion"]
    # silver steps: step records less duplicates and conflicts
    step_records = bronze.filter(pl.col("kind").is_in(["step", "chat_completion", "completion"]))
    assert summary.step_records == step_records.height
    assert summary.silver_steps == silver.height
    assert summary.silver_steps + summary.duplicates + summary.conflicts == step_records.height
    assert summary.duplicates >= 0 and summary.conflicts >= 0
    assert sum(summary.reward_status.values()) == silver.height
    # trajectories: the statuses add up to the total, and stitching explains bronze's ids
    assert sum(summary.trajectories_by_status.values()) == trajectories.height
    assert summary.trajectories_by_status == {
        "complete": trajectories.filter(pl.col("status") == "complete").height,
        "open": trajectories.filter(pl.col("status") == "open").height,
        "abandoned": trajectories.filter(pl.col("status") == "abandoned").height,
    }
    line = re.search(r"(\d+) in silver/trajectories = complete (\d+) \+ open (\d+) \+ "
                     r"abandoned (\d+)", stdout)  # fmt: skip
    assert int(line[1]) == sum(map(int, line.groups()[1:])) == trajectories.height
    assert summary.bronze_trajectory_ids == step_records["trajectory_uid"].n_unique()
    assert (
        summary.bronze_trajectory_ids - summary.stitched_calls + summary.stitched_trajectories
        == trajectories.height
    )
    # curation: kept + rejected is every silver step, per dataset; tree vs flat tokens
    lineage = pl.read_delta(str(lake_dir / "gold/lineage")).sort("written_at")
    newest = lineage.unique(["dataset", "policy_version"], keep="last")
    assert set(summary.datasets) == set(newest["dataset"]) == {"default", "live-grpo"}
    for name, counts in summary.datasets.items():
        kept = pl.read_delta(str(lake_dir / "gold/datasets" / name))
        rejected = pl.read_delta(str(lake_dir / "gold/rejections" / name))
        assert counts.kept == kept.height and counts.rejected == rejected.height
        assert counts.kept + counts.rejected == silver.height, name
        assert re.search(rf"{name}: kept {kept.height} .*\+ rejected {rejected.height}", stdout)
        mine = newest.filter(pl.col("dataset") == name)
        assert counts.flat_tokens == mine["raw_tokens"].sum()
        assert counts.tree_tokens == mine["tree_tokens"].sum() < counts.flat_tokens
        assert f"{name}: {counts.flat_tokens} flat tokens" in stdout
        assert f"-> {counts.tree_tokens} in prefix trees" in stdout


@pytest.mark.slow
def test_demo_next_steps_run_as_printed_without_the_venv_on_path(demo):
    _, stdout = demo
    hints = stdout.split("next (from this directory):", 1)[1].strip().splitlines()
    commands = dict(line.strip().split(": ", 1) for line in hints)
    assert set(commands) == {"read it", "dashboard", "Dagster UI", "everything"}
    venv = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"} | {"PATH": path}
    for label, command in commands.items():
        assert not command.startswith(("claw ", "dagster ", "python ")), command
        line = command if label == "read it" else f"{command} --help"  # servers: just --help
        done = subprocess.run(
            ["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, (line, done.stderr[-2000:])
        assert done.stdout.strip(), line
