"""`claw up` starts the stack, every service answers, Ctrl-C leaves no child behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx
import polars as pl
import pytest

from claw_pipelines.up import daemons_healthy
from dashboards.dagster_graphql import launch_gold, run_status
from tests.servers import REPO, free_port, wait_until


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


@pytest.mark.slow
def test_claw_up_starts_services_data_flows_and_ctrl_c_stops_them_all(tmp_path):
    port, dashboard, dagster = free_port(), free_port(), free_port()
    lake = tmp_path / "lake"
    # Started with SIGINT ignored (inherited), as a shell without job control starts a
    # background command (a CI runner may): Ctrl-C must stop it all the same.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "claw_pipelines.cli", "up", "--port", str(port),
             "--dashboard-port", str(dashboard), "--dagster-port", str(dagster),
             "--lake", str(lake)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"},
            start_new_session=True,  # so a failed test can stop the whole group
        )  # fmt: skip
    finally:
        signal.signal(signal.SIGINT, previous)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: any("Ctrl-C" in line for line in lines), 240, what="claw up ready")
        assert _ok(url + "/readyz")
        assert _ok(f"http://127.0.0.1:{dagster}/server_info")
        assert daemons_healthy(f"http://127.0.0.1:{dagster}")
        assert _ok(f"http://127.0.0.1:{dashboard}/_stcore/health")
        assert (lake / "_dagster" / "dagster.yaml").exists()
        descendants = children_of(proc.pid)
        assert len(descendants) >= 7  # sim, gateway (+ syncer, flusher), webserver, daemon, ui
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200  # via the sim
        # data flows without clicking: bronze's new version -> the sensor -> a silver run
        step = {
            "trajectory_uid": "up-1",
            "step_index": 0,
            "prompt_ids": [1, 2],
            "response_ids": [3],
        }
        assert httpx.post(url + "/v1/steps", json={"steps": [step]}, timeout=10).status_code == 200
        wait_until(lambda: _silver_has(lake, "up-1:0"), 180, interval=2, what="the step in silver")
        # the dashboard's "build" button: gold runs launched over Dagster's GraphQL API
        dagster_url = f"http://127.0.0.1:{dagster}"
        run = launch_gold(dagster_url, "default", [0])[0]
        again = launch_gold(dagster_url, "default", [0])[0]  # coalesced while in flight
        assert again == run or run_status(dagster_url, run) in ("SUCCESS", "FAILURE")
        wait_until(
            lambda: run_status(dagster_url, run) in ("SUCCESS", "FAILURE"),
            180,
            interval=2,
            what="the gold run",
        )
        assert run_status(dagster_url, run) == "SUCCESS"
        assert (lake / "gold" / "datasets" / "default").exists()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("claw up did not stop within 90 s:\n" + "".join(lines)[-3000:])
        reader.join(10)
        output = "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for name in ("gateway", "simulated model", "dagster", "dashboard"):
        assert name in output
    assert wait_until(
        lambda: not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in descendants),
        30,
        what="children to exit",
    )
    assert not _ok(f"http://127.0.0.1:{port}/healthz")


def _silver_has(lake, step_key: str) -> bool:
    try:
        return step_key in pl.read_delta(str(lake / "silver" / "steps"))["step_key"].to_list()
    except Exception:  # not created yet
        return False


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
