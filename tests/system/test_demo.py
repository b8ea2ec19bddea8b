"""`claw demo` end to end in a temp directory: real processes, then the lake is checked."""

from __future__ import annotations

import re
import subprocess
import sys

import polars as pl
import pytest

from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.lake import Lake
from claw_pipelines.silver import SILVER_TABLES
from tests.lakes import rebuilt_sequences
from tests.servers import REPO


@pytest.mark.slow
def test_claw_demo_fills_bronze_and_silver(tmp_path):
    lake_dir = tmp_path / "lake"
    done = subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", "demo", "--lake", str(lake_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lake = Lake(str(lake_dir))
    for table in ("bronze/events", *SILVER_TABLES):
        assert lake.exists(table), table
    acknowledged = int(re.search(r"steps acknowledged\s+(\d+)", done.stdout)[1])
    steps = lake.read(SILVER_STEPS)
    assert steps.height == acknowledged > 0
    assert steps["step_key"].n_unique() == steps.height
    stitched = steps.filter(pl.col("origin_step_key").is_not_null())
    assert stitched.height > stitched["trajectory_uid"].n_unique() > 0  # turns were joined
    assert re.search(r"checks\s+(\d+)/\1 passed", done.stdout)  # gold checks included:
    # every step rebuilds from its tree, trees hold exactly U tokens
    lineage = lake.read("gold/lineage")
    assert set(lineage["dataset"]) == {"default", "live-grpo"}
    newest = lineage.filter(pl.col("dataset") == "default").sort("written_at")
    newest = newest.unique("policy_version", keep="last")
    dataset = lake.read("gold/datasets/default")
    assert dataset.height == newest["steps"].sum() > 0
    trees = lake.read("gold/trees/default")
    assert trees.height == dataset.height  # a segment per step
    consumers = lake.read("gold/consumption")["consumer"].unique().sort().to_list()
    assert consumers == ["claw-demo", "claw-demo-trainer"]
    # the online loop: three rounds, each on fresh groups of the policy it published last
    rounds = re.findall(
        r"online round (\d)\s+policy v(\d+): (\d+) groups.*published v(\d+)", done.stdout
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
