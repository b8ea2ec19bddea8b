"""`claw up`: the local stack as child processes, each health-checked, their URLs printed;
a child that dies is reported; Ctrl-C (or SIGTERM) stops them all."""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from claw_pipelines.app.processes import ServiceProcess, free_port
from claw_pipelines.lake import Lake
from claw_pipelines.live import materializer_running
from claw_pipelines.settings import ClawSettings

DAGSTER_YAML = """\
# Written by `claw up`. Maintenance runs one at a time (its op pool and its run tag).
telemetry:
  enabled: false
concurrency:
  pools:
    default_limit: 1
  runs:
    max_concurrent_runs: 4
    tag_concurrency_limits:
      - key: claw/maintenance
        limit: 1
"""
STOP_TIMEOUT_S = 60.0  # for all children together; SIGKILL after
SLOW_STOP_S = 10.0  # a child that takes longer to stop is reported
DAEMONS_QUERY = "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy } } } }"


def dagster_home(settings: ClawSettings) -> Path:
    """`DAGSTER_HOME`, or `<lake>/_dagster` (a local lake), with a dagster.yaml written once."""
    home = os.environ.get("DAGSTER_HOME")
    if home:
        path = Path(home)
    elif settings.lake_is_remote:
        path = Path.home() / ".claw" / "dagster"
    else:
        path = Path(settings.lake_uri).expanduser().resolve() / "_dagster"
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "dagster.yaml").exists():
        (path / "dagster.yaml").write_text(DAGSTER_YAML)
    return path


def daemons_healthy(webserver_url: str) -> bool:
    """Whether the Dagster daemon reports its sensor and scheduler daemons healthy."""
    try:
        answer = httpx.post(
            webserver_url + "/graphql", json={"query": DAEMONS_QUERY}, timeout=2
        ).json()
        statuses = answer["data"]["instance"]["daemonHealth"]["allDaemonStatuses"]
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return False
    healthy = {s["daemonType"] for s in statuses if s["healthy"]}
    return {"SENSOR", "SCHEDULER"} <= healthy


def _dagster_script(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


class Stack:
    """The children of `claw up`, started in order and stopped in reverse."""

    def __init__(self, settings: ClawSettings, host: str) -> None:
        self.settings, self.host = settings, host
        lake = settings.lake_uri if not settings.lake_is_remote else ".claw"
        self.logs = Path(lake) / "_logs"
        self.children: list[ServiceProcess] = []
        self.env = {"CLAW_LAKE_URI": settings.lake_uri}
        self.urls: dict[str, str] = {}

    def start(self, child: ServiceProcess, name: str, note: str = "") -> ServiceProcess:
        """Start a child, wait for its health check, remember and print its URL."""
        self.children.append(child)
        child.start(timeout=120)
        self.urls[name] = child.url
        shown = child.url if child.ready is None else "running"  # `ready`: no HTTP of its own
        print(f"{name:<17}{shown}{('  ' + note) if note else ''}", flush=True)
        return child

    def up(self, gateway_port: int, dashboard_port: int, dagster_port: int) -> None:
        """Start everything; the simulated model only when no upstream is set."""
        if not self.settings.upstream_url:
            sim = self.start(
                ServiceProcess("sim-llm", self.logs / "sim-llm.log", health="/health"),
                "simulated model",
                "(a test double; set CLAW_UPSTREAM_URL for a real model)",
            )
            self.env["CLAW_UPSTREAM_URL"] = f"{sim.url}/v1"
        gateway = self.start(
            ServiceProcess(
                "gateway",
                self.logs / "gateway.log",
                port=gateway_port,
                health="/readyz",
                args=("--host", self.host),
                env=self.env,
            ),
            "gateway",
            "(OpenAI base URL: <this>/v1; API docs: /docs)",
        )
        home = dagster_home(self.settings)
        dagster_env = {**self.env, "DAGSTER_HOME": str(home)}
        location = ("-m", "claw_pipelines.definitions")
        webserver = self.start(
            ServiceProcess(
                "dagster-webserver",
                self.logs / "dagster-webserver.log",
                port=dagster_port,
                health="/server_info",
                env=dagster_env,
                command=[
                    _dagster_script("dagster-webserver"),
                    *location,
                    "-h",
                    "127.0.0.1",
                    "-p",
                    "{port}",
                ],
            ),
            "dagster",
            f"(DAGSTER_HOME {home})",
        )
        self.start(
            ServiceProcess(
                "dagster-daemon",
                self.logs / "dagster-daemon.log",
                env=dagster_env,
                command=[_dagster_script("dagster-daemon"), "run", *location],
                ready=lambda: daemons_healthy(webserver.url),
            ),
            "dagster daemon",
            "(sensors: bronze -> silver -> gold; hourly maintenance)",
        )
        self.start(
            ServiceProcess(
                "materialize",
                self.logs / "materializer.log",
                env=dagster_env,
                command=[sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--follow"],
                ready=lambda: materializer_running(Lake.from_settings(self.settings)),
            ),
            "materializer",
            "(silver and gold seconds after each step; runs show in Dagster)",
        )
        self.start(
            ServiceProcess(
                "dashboard",
                self.logs / "dashboard.log",
                port=dashboard_port,
                health="/_stcore/health",
                env={
                    **self.env,
                    "CLAW_GATEWAY_URL": gateway.url,
                    "CLAW_DAGSTER_URL": webserver.url,
                },
            ),
            "dashboard",
        )

    def dead(self) -> ServiceProcess | None:
        """A child that exited, if any."""
        return next((c for c in self.children if c.proc and c.proc.poll() is not None), None)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop every child at once (their graceful stops overlap), then the simulated model,
        through which the gateway may still be answering; SIGKILL for any still running after
        `timeout`. A slow stop is reported."""
        first = [c for c in reversed(self.children) if c.verb != "sim-llm"]
        last = [c for c in self.children if c.verb == "sim-llm"]
        started = time.monotonic()
        for group in (first, last):
            for child in group:
                child.terminate()
            for child in group:
                child.stop(max(0.1, started + timeout - time.monotonic()))
                took = time.monotonic() - started
                if took > SLOW_STOP_S:
                    print(f"claw up: {child.verb} stopped after {took:.0f} s", file=sys.stderr)


def _traffic(stack: Stack, stopping: threading.Event) -> None:
    """Simulated agents, round after round, until `claw up` stops."""
    from claw_pipelines.app.demo import drive_agents

    rng = random.Random(11)
    sim = stack.urls.get("simulated model")
    while not stopping.is_set() and sim:
        try:
            drive_agents(sim, stack.urls["gateway"], rng)
        except Exception as exc:  # a stopping gateway; report and keep going
            print(f"claw up: demo traffic: {exc}", file=sys.stderr)
            stopping.wait(2)


def run_up(
    settings: ClawSettings,
    host: str = "127.0.0.1",
    port: int = 8080,
    dashboard_port: int = 8501,
    dagster_port: int = 3000,
    demo_traffic: bool = False,
) -> None:
    """Start the stack and supervise it until Ctrl-C, SIGTERM or a child's death."""
    stack = Stack(settings, host)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    # Ctrl-C stops the stack even when started with SIGINT ignored (as a shell without job
    # control starts background commands, and Python then keeps it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        stack.up(port, dashboard_port or free_port(), dagster_port or free_port())
        print(f"lake             {settings.lake_uri}; logs in {stack.logs}")
        if demo_traffic:
            threading.Thread(target=_traffic, args=(stack, stopping), daemon=True).start()
            print("demo traffic     simulated agents keep sending steps")
        print("Ctrl-C stops everything.", flush=True)
        while not stopping.is_set():
            dead = stack.dead()
            if dead is not None:
                print(
                    f"claw up: {dead.verb} exited with {dead.proc.returncode}; see {dead.log_path}",
                    file=sys.stderr,
                )
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        stopping.set()
        stack.stop()
