"""Partial rollouts in silver: an aborted generation and its continuation become one step
(response, log-probs and policy-version runs joined), in one run or across runs, through
chains, unscoped calls and killed runs; what does not continue an aborted step is left
alone; and curation leaves out aborted steps nothing continued once their trajectory ended."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import polars as pl
import pytest

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import SILVER_STEPS, SILVER_TRAJECTORIES, gold_rejection_table
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.prompts import read_steps
from claw_pipelines.materialize.gold import build_partition
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.transforms.hashing import content_hashes
from tests.support.lakes import completion, land, partial_rollout, step
from tests.support.racing import KILL_SCRIPT
from tests.support.servers import REPO

PROMPT = [5, 6, 7]
PARTS = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
ALL = CurationSpec(name="all", reward_status=["final", "missing", "pending"])


def steps(lake: Lake) -> pl.DataFrame:
    return read_steps(lake, SILVER_STEPS).sort("step_key")


def hash_of(ids: list[int]) -> str:
    return content_hashes(pl.Series([ids], dtype=pl.List(pl.Int32)).to_arrow())[0].as_py()


def log_probs(parts: list[list[int]]) -> list[float]:
    """The log-probs `partial_rollout` gives parts 0.. of a generation, in order."""
    values = [-(k + 1) / 10 - n / 1000 for k, part in enumerate(parts) for n in range(len(part))]
    return np.asarray(values, dtype=np.float32).tolist()


def assert_joined(row: dict, parts: list[list[int]], runs, lengths, partials: list[str]) -> None:
    response = [t for part in parts for t in part]
    assert row["prompt_ids"] == PROMPT and row["response_ids"] == response
    assert row["prompt_len"] == len(PROMPT) and row["response_len"] == len(response)
    assert row["prompt_id"] == hash_of(PROMPT) and row["response_id"] == hash_of(response)
    assert row["rollout_log_probs"] == log_probs(parts) and row["has_log_probs"]
    assert row["policy_version_runs"] == runs and row["policy_run_lengths"] == lengths
    assert row["partial_step_keys"] == partials
    assert row["finish_reason"] == "stop"


def test_an_aborted_step_and_its_continuation_are_one_step(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    rows = partial_rollout("t", PROMPT, PARTS[:2], [1, 2])
    land(lake, [*rows, completion("t", 1.0)])
    run = build_silver(lake)
    assert run.steps_added == 1
    (row,) = steps(lake).to_dicts()
    assert row["step_key"] == "t:1" and row["policy_version"] == 2  # the version that finished
    assert row["event_id"] == rows[1]["event_id"]
    assert_joined(row, PARTS[:2], [1, 2], [3, 2], ["t:0"])
    assert row["partial_event_ids"] == [rows[0]["event_id"]]
    trajectory = lake.read(SILVER_TRAJECTORIES).row(0, named=True)
    assert trajectory["step_keys"] == ["t:1"] and trajectory["status"] == "complete"


@pytest.mark.parametrize("kept_view", [True, False])
def test_a_chain_joined_across_runs_equals_one_run_over_everything(tmp_path, kept_view):
    rows = partial_rollout("t", PROMPT, PARTS, [1, 2, 3])
    once = Lake(str(tmp_path / "once"))
    land(once, rows)
    build_silver(once)
    lake = Lake(str(tmp_path / "lake"))
    land(lake, rows[:1])
    first = build_silver(lake)
    assert steps(lake)["step_key"].to_list() == ["t:0"]  # nothing continued it yet
    land(lake, rows[1:2])
    second = build_silver(lake, view=first.view if kept_view else None)
    assert steps(lake)["step_key"].to_list() == ["t:1"]
    land(lake, rows[2:])
    build_silver(lake, view=second.view if kept_view else None)
    (row,) = steps(lake).to_dicts()
    assert_joined(row, PARTS, [1, 2, 3], [3, 2, 4], ["t:0", "t:1"])
    assert row["partial_event_ids"] == [r["event_id"] for r in rows[:2]]
    assert steps(lake).drop("created_at").equals(steps(once).drop("created_at"))
    # a repair's full read of bronze recognises every absorbed record: nothing comes back
    build_silver(lake, full=True)
    assert steps(lake)["step_key"].to_list() == ["t:2"]


def test_runs_of_one_version_merge_and_a_missing_part_clears_the_log_probs(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    same = partial_rollout("same", PROMPT, PARTS, [4, 4, 5])
    blind = partial_rollout("blind", PROMPT, PARTS[:2], [4, 4])
    blind[0]["rollout_log_probs"] = None
    land(lake, [*same, *blind])
    build_silver(lake)
    joined = {r["trajectory_uid"]: r for r in steps(lake).to_dicts()}
    assert joined["same"]["policy_version_runs"] == [4, 5]
    assert joined["same"]["policy_run_lengths"] == [5, 4]
    assert joined["blind"]["policy_version_runs"] is None  # one version: the step's own
    assert joined["blind"]["partial_step_keys"] == ["blind:0"]
    assert joined["blind"]["rollout_log_probs"] is None and not joined["blind"]["has_log_probs"]


def test_what_does_not_continue_an_aborted_step_is_left_alone(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    finished = partial_rollout("finished", PROMPT, PARTS[:2], [1, 2])
    finished[0]["finish_reason"] = "length"  # cut by max_tokens: a next call is a new turn
    finished[0]["payload"] = finished[0]["payload"].replace('"abort"', '"length"')
    other = partial_rollout("other", PROMPT, PARTS[:2], [1, 2])
    other[1]["prompt_ids"] = [*PROMPT, 10, 11, 99]  # not the partial reply
    apart = partial_rollout("apart", PROMPT, PARTS[:2], [1, 2])
    moved = step("elsewhere", 1, apart[1]["prompt_ids"], PARTS[1])  # another trajectory
    turn = partial_rollout("turn", PROMPT, PARTS[:2], [1, 2])
    turn[1]["prompt_ids"] = [*turn[1]["prompt_ids"], 77]  # a next turn after it, more prompt
    land(lake, [*finished, *other, apart[0], moved, *turn])
    build_silver(lake)
    held = steps(lake)
    assert held.height == 8 and held["partial_step_keys"].is_null().all()


def test_an_unscoped_call_resuming_an_unscoped_partial_is_stitched_and_joined(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    rows = partial_rollout("u-first", PROMPT, PARTS[:2], [1, 2])
    for n, row in enumerate(rows):  # two calls of an agent that names no trajectory
        row["trajectory_uid"] = f"u-call-{n}"
        payload = json.loads(row["payload"]) | {"trajectory_uid": f"u-call-{n}", "step_index": 0}
        payload["metadata"] = {"scoped": "false"}
        row.update(kind="chat_completion", step_index=0, payload=json.dumps(payload))
        row.update(token_source="upstream")
    land(lake, rows[:1])
    first = build_silver(lake)
    land(lake, rows[1:])
    build_silver(lake, view=first.view)
    (row,) = steps(lake).to_dicts()
    assert row["step_key"] == "u-call-0:1" and row["origin_step_key"] == "u-call-1:0"
    assert_joined(row, PARTS[:2], [1, 2], [3, 2], ["u-call-0:0"])


def test_a_run_killed_after_its_first_steps_commit_joins_once_when_redone(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    rows = partial_rollout("t", PROMPT, PARTS, [1, 2, 3])
    land(lake, rows[:1])
    build_silver(lake)
    # the next run appends new steps, then writes the continuation of the stored partial
    land(lake, [*rows[1:], *partial_rollout("fresh", PROMPT, PARTS[:2], [3, 3])])
    clean = Lake(str(tmp_path / "clean"))
    shutil.copytree(lake.uri, clean.uri)
    build_silver(clean)
    killed = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, lake.uri, SILVER_STEPS], cwd=REPO, capture_output=True
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    build_silver(lake)
    assert steps(lake)["step_key"].to_list() == ["fresh:1", "t:2"]
    assert steps(lake).drop("created_at").equals(steps(clean).drop("created_at"))


def test_curation_waits_for_an_open_partial_and_leaves_out_an_ended_one(tmp_path):
    lake = Lake(str(tmp_path / "lake"))
    land(lake, partial_rollout("open", PROMPT, PARTS[:2], [1, 2])[:1])  # not resumed yet
    ended = partial_rollout("ended", PROMPT, PARTS[:2], [1, 2])[0]
    land(lake, [ended, completion("ended", 0.0)])
    build_silver(lake)
    build_partition(lake, ALL, 1)
    reasons = dict(lake.read(gold_rejection_table("all")).select("step_key", "reason").rows())
    assert reasons == {"open:0": "incomplete", "ended:0": "aborted"}
