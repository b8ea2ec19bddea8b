"""`claw up --demo-traffic` on a fresh lake for 2.5 minutes: every service answers, the
Dagster daemon's sensors launch silver and gold runs as data arrives, the run queue stays
small, a spec saved midway is built within a minute, the dashboard's build button joins runs
in flight, and Ctrl-C leaves no child behind. Afterwards silver holds each step once, every
gold partition holds each step once, and every partition's tree batches load and equal
those of a lake rebuilt from scratch out of the same bronze.

A shorter run checks what the terminal sees: the URLs, where the logs are, then one compact
status line per interval (rewritten in place on a terminal), never a child's output."""

from __future__ import annotations

import io
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

from claw_pipelines.app.up import StatusLine, daemons_healthy
from claw_pipelines.consume.dataset import open_dataset
from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import GOLD_LINEAGE, SILVER_STEPS, gold_dataset_table
from claw_pipelines.lake.catalog import gold_datasets
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import load_specs, save_spec
from claw_pipelines.materialize.gold import build_partition, policy_versions
from claw_pipelines.materialize.silver import build_silver
from claw_pipelines.ops.integrity import check_lake
from dashboards.dagster_graphql import launch_gold, run_status
from tests.support.servers import REPO, free_port, wait_until

SOAK_S = 150
SPEC_AFTER_S = 75
MAX_QUEUE = 10
SPEC_BUILT_WITHIN_S = 60
FIELDS = ("input_ids", "parent", "position_ids", "loss_mask", "advantages", "token_rewards")
QUEUED = "{ runsOrError(filter: {statuses: [QUEUED]}) { ... on Runs { count } } }"


def start_up_with_traffic(port: int, dashboard: int, dagster: int, lake) -> subprocess.Popen:
    """`claw up --demo-traffic` on these ports, output piped, in its own process group (so a
    failed test can stop the whole group)."""
    return subprocess.Popen(
        [sys.executable, "-m", "claw_pipelines.app.cli", "up", "--demo-traffic",
         "--port", str(port), "--dashboard-port", str(dashboard),
         "--dagster-port", str(dagster), "--lake", str(lake)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"},
        start_new_session=True,
    )  # fmt: skip


def children_of(pid: int) -> set[int]:
    """Every descendant process id of `pid` (from /proc)."""
    found, frontier = set(), {pid}
    while frontier:
        parent = frontier.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as handle:
                        ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
                if ppid == parent and int(entry) not in found:
                    found.add(int(entry))
                    frontier.add(int(entry))
    return found


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


@pytest.mark.soak
@pytest.mark.timeout(SOAK_S + 600)
def test_claw_up_with_demo_traffic_keeps_every_step_once_and_ctrl_c_stops_it_all(tmp_path):
    port, dashboard, dagster = free_port(), free_port(), free_port()
    lake_path = tmp_path / "lake"
    # Started with SIGINT ignored (inherited), as a shell without job control starts a
    # background command (a CI runner may): Ctrl-C must stop it all the same.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = start_up_with_traffic(port, dashboard, dagster, lake_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    url, dagster_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{dagster}"
    lake = Lake(str(lake_path))
    queue: list[int] = []
    spec_saved_at = spec_built_after = built_run = None
    try:
        wait_until(lambda: any("Ctrl-C" in line for line in lines), 240, what="claw up ready")
        started = time.monotonic()
        assert _ok(url + "/readyz")
        assert _ok(dagster_url + "/server_info")
        assert daemons_healthy(dagster_url)
        assert _ok(f"http://127.0.0.1:{dashboard}/_stcore/health")
        assert (lake_path / "_dagster" / "dagster.yaml").exists()
        descendants = children_of(proc.pid)
        assert len(descendants) >= 7  # sim, gateway (+ syncer, flusher), webserver, daemon, ui
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200  # via the sim
        while time.monotonic() - started < SOAK_S:
            assert proc.poll() is None, "claw up stopped:\n" + "".join(lines)[-3000:]
            depth = queued_runs(dagster_url)
            if depth is not None:
                queue.append(depth)
            elapsed = time.monotonic() - started
            if built_run is None and 1 in policy_versions(lake):
                # the dashboard's "build" button: a gold run over Dagster's GraphQL API,
                # joined (not doubled) while it is in flight
                built_run = launch_gold(dagster_url, "default", [1])[1]
                again = launch_gold(dagster_url, "default", [1])[1]
                assert again == built_run or run_status(dagster_url, built_run) in (
                    "SUCCESS",
                    "FAILURE",
                )
            if spec_saved_at is None and elapsed >= SPEC_AFTER_S:
                wanted = set(policy_versions(lake))
                save_spec(lake, CurationSpec(name="soak", merge="trajectory"))
                spec_saved_at = time.monotonic()
            waiting = spec_saved_at is not None and spec_built_after is None
            if waiting and built_versions(lake, "soak") >= wanted:
                spec_built_after = time.monotonic() - spec_saved_at
            time.sleep(5)
        assert built_run is not None and run_status(dagster_url, built_run) == "SUCCESS"
        for name in gold_datasets(lake):  # what a trainer reads while the stack runs
            for version in open_dataset(name, lake.uri).policy_versions():
                assert tree_batches(lake, name, version)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("claw up did not stop within 120 s:\n" + "".join(lines)[-3000:])
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    print(f"soak: queue depths max {max(queue, default=None)}, spec built after {spec_built_after}")
    for name in ("gateway", "simulated model", "dagster", "dashboard"):
        assert name in output
    assert "Traceback" not in output, output[-3000:]
    assert wait_until(
        lambda: not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in descendants),
        30,
        what="children to exit",
    )
    assert not _ok(f"http://127.0.0.1:{port}/healthz")
    assert queue and max(queue) <= MAX_QUEUE, f"queue depths seen: {queue}"
    assert spec_built_after is not None and spec_built_after <= SPEC_BUILT_WITHIN_S, (
        f"the spec saved after {SPEC_AFTER_S} s was built after {spec_built_after} s"
    )

    steps = lake.read(SILVER_STEPS, columns=["step_key", "event_id"])
    assert steps.height > 1000  # 2.5 minutes of demo traffic (~20 steps/s)
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


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_claw_up_with_demo_traffic_prints_a_few_short_lines_and_logs_the_rest(tmp_path):
    port, dashboard, dagster = free_port(), free_port(), free_port()
    lake_path = tmp_path / "lake"
    proc = start_up_with_traffic(port, dashboard, dagster, lake_path)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any("Ctrl-C" in line for line in lines), 240, what="claw up ready")
        ready_at = len(lines)
        traffic_log = lake_path / "_logs" / "demo-traffic.log"
        wait_until(lambda: "round 2:" in _text(traffic_log), 120, what="two rounds of traffic")
        wait_until(
            lambda: any(line.startswith("up ") for line in lines[ready_at:]),
            30,
            what="a status line",
        )
        assert proc.poll() is None, "".join(lines)[-3000:]
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
        reader.join(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = "".join(lines)
    assert lines[0].startswith("lake ") and str(lake_path / "_logs") in lines[0]  # once, first
    assert output.count("logs in") == 1
    assert "\r" not in output and "%|" not in output and "task/s" not in output  # no bars
    assert "Traceback" not in output, output[-3000:]
    assert all(len(line.replace(str(lake_path), "LAKE")) <= 120 for line in lines), output
    status = lines[ready_at:]
    assert 1 <= len(status) <= 12, output  # a compact line per interval, nothing else
    assert all(line.startswith("up ") and "demo traffic" in line for line in status), output
    assert len(lines) <= 25, output
    for name in ("sim-llm", "gateway", "dagster-webserver", "dagster-daemon", "materializer",
                 "dashboard", "demo-traffic"):  # fmt: skip
        assert (lake_path / "_logs" / f"{name}.log").stat().st_size > 0, name


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_is_rewritten_on_a_terminal_and_a_line_per_interval_otherwise():
    for stream, tty in ((Terminal(), True), (io.StringIO(), False)):
        status = StatusLine(stream)
        for n in range(3):
            status.due = 0.0  # the interval has passed
            status.update(lambda n=n: f"up {n}")
        status.update(lambda: "too soon")  # within the interval: nothing
        status.end()
        if tty:
            assert stream.getvalue() == "\r\x1b[Kup 0\r\x1b[Kup 1\r\x1b[Kup 2\n"
        else:
            assert stream.getvalue() == "up 0\nup 1\nup 2\n"


def _text(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
