"""Soak of the whole stack: `claw up --demo-traffic` on a fresh lake for five minutes, with the
Dagster daemon's sensors launching silver and gold runs as data arrives. The run queue stays
small, a spec saved midway is built within a minute, and afterwards silver holds each step
once, every gold partition holds each step once, and every partition's tree batches load and
equal those of a lake rebuilt from scratch out of the same bronze."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import polars as pl
import pytest

from claw_pipelines.consume import open_dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import GOLD_LINEAGE, SILVER_STEPS, gold_dataset_table
from claw_pipelines.gold import build_partition, policy_versions
from claw_pipelines.integrity import check_lake, gold_datasets
from claw_pipelines.lake import Lake
from claw_pipelines.silver import build_silver
from claw_pipelines.specs import load_specs, save_spec
from tests.servers import REPO, free_port, wait_until

SOAK_S = 300
SPEC_AFTER_S = 120
MAX_QUEUE = 10
SPEC_BUILT_WITHIN_S = 60
FIELDS = ("input_ids", "parent", "position_ids", "loss_mask", "advantages", "token_rewards")
QUEUED = "{ runsOrError(filter: {statuses: [QUEUED]}) { ... on Runs { count } } }"


def queued_runs(dagster_url: str) -> int | None:
    """How many runs wait in Dagster's queue (None when the webserver does not answer)."""
    try:
        answer = httpx.post(dagster_url + "/graphql", json={"query": QUEUED}, timeout=10)
        return answer.json()["data"]["runsOrError"]["count"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None


def built_versions(lake: Lake, dataset: str) -> set[int]:
    """Policy versions of `dataset` that a gold build has written."""
    if not lake.exists(GOLD_LINEAGE):
        return set()
    lineage = lake.read(GOLD_LINEAGE, columns=["dataset", "policy_version"])
    return set(lineage.filter(pl.col("dataset") == dataset)["policy_version"].to_list())


def tree_batches(lake: Lake, name: str, version: int) -> list:
    return list(open_dataset(name, lake.uri).batches(version, 16, layout="tree", seed=1))


@pytest.mark.slow
@pytest.mark.timeout(SOAK_S + 600)
def test_five_minutes_of_claw_up_with_demo_traffic_keep_every_step_once(tmp_path):
    lake_path = tmp_path / "lake"
    port, dashboard, dagster = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "claw_pipelines.cli", "up", "--demo-traffic", "--lake",
         str(lake_path), "--port", str(port), "--dashboard-port", str(dashboard),
         "--dagster-port", str(dagster)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"},
        start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    dagster_url = f"http://127.0.0.1:{dagster}"
    lake = Lake(str(lake_path))
    queue: list[int] = []
    spec_saved_at = spec_built_after = None
    try:
        wait_until(lambda: any("Ctrl-C" in line for line in lines), 240, what="claw up ready")
        started = time.monotonic()
        while time.monotonic() - started < SOAK_S:
            assert proc.poll() is None, "claw up stopped:\n" + "".join(lines)[-3000:]
            depth = queued_runs(dagster_url)
            if depth is not None:
                queue.append(depth)
            elapsed = time.monotonic() - started
            if spec_saved_at is None and elapsed >= SPEC_AFTER_S:
                wanted = set(policy_versions(lake))
                save_spec(lake, CurationSpec(name="soak", merge="trajectory"))
                spec_saved_at = time.monotonic()
            waiting = spec_saved_at is not None and spec_built_after is None
            if waiting and built_versions(lake, "soak") >= wanted:
                spec_built_after = time.monotonic() - spec_saved_at
            time.sleep(5)
        live = {name: policy_versions(lake) for name in gold_datasets(lake)}
        for name, versions in live.items():  # what a trainer reads while the stack runs
            for version in versions:
                if version in open_dataset(name, lake.uri).policy_versions():
                    assert tree_batches(lake, name, version)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    print(f"soak: queue depths max {max(queue, default=None)}, spec built after {spec_built_after}")
    assert "Traceback" not in output, output[-3000:]
    assert queue and max(queue) <= MAX_QUEUE, f"queue depths seen: {queue}"
    assert spec_built_after is not None and spec_built_after <= SPEC_BUILT_WITHIN_S, (
        f"the spec saved after {SPEC_AFTER_S} s was built after {spec_built_after} s"
    )

    steps = lake.read(SILVER_STEPS, columns=["step_key", "event_id"])
    assert steps.height > 500  # five minutes of traffic
    assert steps["step_key"].n_unique() == steps.height
    assert steps["event_id"].n_unique() == steps.height
    for name in gold_datasets(lake):
        keys = lake.read(gold_dataset_table(name), columns=["step_key"])["step_key"]
        assert keys.n_unique() == keys.len(), name

    # bring the soaked lake up to date the way the stack does (incremental silver, guarded
    # gold), and compare it with a lake built once from the same bronze
    build_silver(lake)
    fresh = Lake(str(tmp_path / "fresh"))
    shutil.copytree(lake_path / "bronze", tmp_path / "fresh" / "bronze")
    build_silver(fresh)
    specs = load_specs(lake)
    assert set(specs) == {"default", "soak"}
    for name, spec in specs.items():
        for version in policy_versions(lake):
            build_partition(lake, spec, version)
            build_partition(fresh, spec, version)
            got, want = tree_batches(lake, name, version), tree_batches(fresh, name, version)
            assert len(got) == len(want) > 0, (name, version)
            for mine, theirs in zip(got, want, strict=True):
                assert mine.step_keys == theirs.step_keys
                for field in FIELDS:
                    assert np.array_equal(getattr(mine, field), getattr(theirs, field)), field
    assert check_lake(lake) == []
