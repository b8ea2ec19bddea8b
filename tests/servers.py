"""Real servers for tests: processes on free loopback ports, started and stopped for real."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import polars as pl

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns neither None nor False; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value is not None and value is not False:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class GatewayProcess:
    """`claw gateway` as a subprocess on a loopback port, with its own lake and WAL."""

    def __init__(self, lake: Path, port: int | None = None, **env: str) -> None:
        self.lake = lake
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "CLAW_LAKE_URI": str(lake),
            "CLAW_GATEWAY_ID": "gw-test",
            **env,
        }
        self.proc: subprocess.Popen | None = None
        self.log_path = lake.parent / f"gateway-{self.port}.log"

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        """Start the process and wait until /readyz answers 200."""
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "claw_pipelines.cli", "gateway", "--port", str(self.port)],
            env=self.env,
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-2000:]}")
            try:
                return httpx.get(self.url + "/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout, what="gateway readiness")
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self.log.close()

    def stop(self) -> int:
        """SIGTERM and wait for the graceful shutdown (flushes everything)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.stop()


def bronze(lake: Path) -> pl.DataFrame:
    """The whole bronze table (empty frame when it does not exist yet)."""
    try:
        return pl.read_delta(str(lake / "bronze" / "events"))
    except Exception:  # table not created yet
        return pl.DataFrame({"event_id": []}, schema={"event_id": pl.String})


def wait_landed(lake: Path, event_ids, timeout: float = 20.0) -> pl.DataFrame:
    """Wait until every id in `event_ids` is in bronze; return those rows."""
    wanted = set(event_ids)

    def landed():
        frame = bronze(lake)
        got = frame.filter(pl.col("event_id").is_in(list(wanted)))
        return got if set(got["event_id"].to_list()) >= wanted else None

    return wait_until(landed, timeout, interval=0.1, what=f"{len(wanted)} records in bronze")
