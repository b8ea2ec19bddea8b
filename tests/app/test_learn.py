"""`claw demo --learn` end to end, as a user runs it: a tiny random Qwen2 served by `transformers
serve` (one checkpoint folder per policy version), word-task agents through the gateway, the
live materializer, and a GRPO trainer through the tree attention. With a fixed seed the mean
reward of a policy version rises from chance to the target within the published versions,
every step was served by its own version's checkpoint, and the lake says so."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from claw_pipelines.app.learn import SPEC_NAME, TRAINER, LearnOptions
from claw_pipelines.contracts.tables import (
    GOLD_CONSUMPTION,
    GOLD_POLICY_VERSIONS,
    SILVER_STEP_REWARDS,
    SILVER_STEPS,
)
from claw_pipelines.lake.delta import Lake
from tests.support.servers import REPO

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow
OPTIONS = LearnOptions()


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> tuple[Lake, Path, str]:
    """One `claw demo --learn --seed 0` run: its lake, its workdir, what it printed."""
    root = tmp_path_factory.mktemp("learn")
    command = [sys.executable, "-m", "claw_pipelines.app.cli", "demo", "--learn", "--seed", "0"]
    done = subprocess.run(
        [*command, "--lake", str(root / "lake"), "--workdir", str(root / "work")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return Lake(str(root / "lake")), root / "work", done.stdout


def rewarded_steps(lake: Lake) -> pl.DataFrame:
    """Every silver step with its resolved reward."""
    columns = ["step_key", "prompt_uid", "policy_version", "model", "token_source", "created_at"]
    steps = lake.read(SILVER_STEPS, columns=columns)
    rewards = lake.read(SILVER_STEP_REWARDS, columns=["step_key", "reward", "reward_status"])
    return steps.join(rewards, on="step_key", how="left")


@pytest.mark.timeout(900)
def test_reward_rises_from_chance_to_the_target_within_the_versions(learned):
    lake, _, stdout = learned
    steps = rewarded_steps(lake)
    assert (steps["reward_status"] == "final").all()  # every reply was scored and posted
    by_version = (
        steps.group_by("policy_version").agg(pl.col("reward").mean()).sort("policy_version")
    )
    means = dict(by_version.iter_rows())
    assert means[1] <= 0.2  # the random policy: about 16 target words in 128
    # groups in the order the agents made them (one at a time); the target is the mean of
    # the last `judge_groups` groups
    groups = (
        steps.group_by("prompt_uid")
        .agg(pl.col("created_at").min(), pl.col("reward").mean(), pl.col("policy_version").max())
        .sort("created_at")
    )
    window = groups["reward"].rolling_mean(OPTIONS.judge_groups)
    reached = groups.filter(window >= OPTIONS.target)
    assert reached.height, f"no {OPTIONS.judge_groups} groups in a row reached {OPTIONS.target}"
    first = int(reached["policy_version"][0])
    published = lake.read(GOLD_POLICY_VERSIONS)["policy_version"].sort().to_list()
    assert published == list(range(1, len(published) + 1))  # one per trainer step, in order
    assert first <= len(published) <= OPTIONS.max_versions
    assert f"reached mean reward >= {OPTIONS.target} at policy version {first}," in stdout
    # the summary prints the lake's figures, version by version
    for version, mean in means.items():
        assert re.search(rf"^\s+v{version}\s+{mean:.3f}\b", stdout, re.M), (version, stdout)


def test_every_version_was_served_by_its_own_checkpoint(learned):
    lake, work, stdout = learned
    steps = rewarded_steps(lake)
    folder = steps["model"].str.split("@").list.first()  # `transformers serve` adds @main
    assert (
        folder.str.extract(r"/checkpoints/v(\d+)$").cast(pl.Int64) == steps["policy_version"]
    ).all()
    assert (folder.str.starts_with(str((work / "checkpoints").absolute()))).all()
    assert steps["policy_version"].n_unique() > 2  # several versions served their own calls
    assert set(steps["token_source"]) == {"local"}  # ids computed and confirmed by the server
    own = f"served: {steps.height} of {steps.height} steps by their own version's checkpoint"
    assert own in stdout


def test_the_trainer_took_each_group_at_most_max_uses_times_through_next_batch(learned):
    lake, _, stdout = learned
    taken = lake.read(GOLD_CONSUMPTION).filter(
        (pl.col("consumer") == TRAINER) & (pl.col("dataset") == SPEC_NAME)
    )
    assert set(taken["kind"]) == {"next"} and taken.height > 0
    uses = taken.select("batch_index", "groups", "uses").explode("groups", "uses")
    per_group = uses.group_by("groups").agg(pl.col("uses").sort(), pl.col("batch_index").sort())
    for row in per_group.iter_rows(named=True):
        # each group's uses numbered 1, 2, ... at most max_uses, `cooldown` batches apart
        assert row["uses"] == list(range(1, len(row["uses"]) + 1)), row
        assert len(row["uses"]) <= OPTIONS.max_uses, row
        gaps = [b - a for a, b in zip(row["batch_index"], row["batch_index"][1:], strict=False)]
        assert all(gap > OPTIONS.cooldown for gap in gaps), row
    steps = taken["step_keys"].list.len()
    assert (steps == taken["groups"].list.len() * OPTIONS.rollouts).all()  # whole groups
    assert "behaviour/trainer mismatch: the server returns no log-probs: IS ratio 1" in stdout
