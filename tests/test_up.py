"""`claw up` starts the stack, every service answers, Ctrl-C leaves no child behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import httpx

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


def test_claw_up_starts_services_and_ctrl_c_stops_them_all(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "claw_pipelines.cli", "up", "--port", str(port),
         "--lake", str(tmp_path / "lake")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # so a failed test can stop the whole group
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: any("Ctrl-C" in line for line in lines), 90, what="claw up ready")
        assert _ok(url + "/readyz")
        descendants = children_of(proc.pid)
        assert len(descendants) >= 4  # sim-llm, gateway, its syncer and flusher
        assert httpx.get(url + "/v1/models", timeout=5).status_code == 200  # via the sim
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(10)
        output = "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "gateway" in output and "simulated model" in output
    assert wait_until(
        lambda: not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in descendants),
        30,
        what="children to exit",
    )
    assert not _ok(f"http://127.0.0.1:{port}/healthz")


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
