"""Real servers for tests: processes on free loopback ports, started and stopped for real."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from claw_pipelines.app.processes import ServiceProcess, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_APP = str(REPO / "dashboards" / "streamlit_app.py")
# the API keys of the secured gateway (tests/gateway/conftest.py), mapped to tenants a and b
TEST_KEY = "claw-test-key-tenant-a"
OTHER_KEY = "claw-test-key-tenant-b"
__all__ = [
    "DASHBOARD_APP",
    "OTHER_KEY",
    "REPO",
    "TEST_KEY",
    "GatewayProcess",
    "bronze",
    "free_port",
    "wait_landed",
    "wait_until",
]


class GatewayProcess(ServiceProcess):
    """`claw gateway` as a subprocess on a loopback port, with its own lake and WAL."""

    def __init__(self, lake: Path, port: int | None = None, **env: str) -> None:
        env = {"CLAW_LAKE_URI": str(lake), "CLAW_GATEWAY_ID": "gw-test", **env}
        port = port or free_port()
        super().__init__(
            "gateway",
            lake.parent / f"gateway-{port}.log",
            port=port,
            health="/readyz",
            env=env,
            cwd=REPO,
        )
        self.lake = lake

    def start(self, timeout: float = 30.0) -> GatewayProcess:
        """Start and wait for /readyz."""
        super().start(timeout)
        return self


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
