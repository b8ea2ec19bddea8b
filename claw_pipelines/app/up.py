"""`claw up`: the local stack as child processes, each health-checked, their URLs printed;
a child that dies is reported; Ctrl-C (or SIGTERM) stops them all.

While it runs, stdout gets one status line (rewritten in place on a terminal, one compact
line per interval otherwise); every child's output, and the demo traffic's, goes to a log
file under `<lake>/_logs` (`.claw/_logs` for a remote lake), named once at start."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import httpx
import polars as pl

from claw_pipelines.app.instance import dagster_home
from claw_pipelines.app.processes import ServiceProcess, free_port
from claw_pipelines.contracts.access import KeyRing, is_loopback
from claw_pipelines.contracts.errors import ClawError
from claw_pipelines.contracts.shards import Slot
from claw_pipelines.contracts.tables import BRONZE_EVENTS, SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.materialize.live import materializer_running
from claw_pipelines.settings import ClawSettings

STOP_TIMEOUT_S = 60.0  # for all children together; SIGKILL after
SLOW_STOP_S = 10.0  # a child that takes longer to stop is reported
STATUS_EVERY_S = {True: 5.0, False: 15.0}  # on a terminal / piped
DAEMONS_QUERY = "{ instance { daemonHealth { allDaemonStatuses { daemonType healthy } } } }"


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

    def __init__(self, settings: ClawSettings, host: str, materializers: int = 1) -> None:
        self.settings, self.host = settings, host
        self.materializers = materializers  # followers: more than one split the work (§19)
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
            "(sensors: bronze -> silver -> gold; maintenance every 10 minutes)",
        )
        follow = [sys.executable, "-m", "claw_pipelines.app.cli", "materialize", "--follow"]
        count = self.materializers
        slots = [None] if count == 1 else [Slot(i, count) for i in range(count)]
        for slot in slots:
            shard = [] if slot is None else ["--shard", str(slot)]
            suffix = "" if slot is None else f"-{slot.index}"
            self.start(
                ServiceProcess(
                    "materialize",
                    self.logs / f"materializer{suffix}.log",
                    env=dagster_env,
                    command=[*follow, *shard],
                    ready=lambda slot=slot: materializer_running(
                        Lake.from_settings(self.settings), slot=slot
                    ),
                ),
                "materializer" + ("" if slot is None else f" {slot}"),
                "(silver and gold seconds after each step; runs show in Dagster)"
                if slot is None
                else f"(shard {slot}: its prompt groups, under a lease)",
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


@dataclass
class Traffic:
    """What `--demo-traffic` has sent so far."""

    rounds: int = 0
    steps: int = 0
    errors: int = 0


def _traffic(stack: Stack, stopping: threading.Event, traffic: Traffic) -> None:
    """Simulated agents, round after round, until `claw up` stops; a log line per round."""
    from claw_pipelines.app.demo import drive_agents

    rng = random.Random(11)
    sim = stack.urls.get("simulated model")
    with open(stack.logs / "demo-traffic.log", "a", encoding="utf-8") as log:
        while not stopping.is_set() and sim:
            try:
                tally = drive_agents(sim, stack.urls["gateway"], rng)
            except Exception as exc:  # a stopping gateway; log it and keep going
                traffic.errors += 1
                print(f"{time.strftime('%H:%M:%S')} round failed: {exc!r}", file=log, flush=True)
                stopping.wait(2)
                continue
            traffic.rounds += 1
            traffic.steps += tally.steps
            print(
                f"{time.strftime('%H:%M:%S')} round {traffic.rounds}: {tally.steps} steps, "
                f"{tally.trajectories} trajectories acknowledged",
                file=log,
                flush=True,
            )


class StatusLine:
    """One line of status: rewritten in place on a terminal, else a line per interval."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.every_s = STATUS_EVERY_S[self.tty]
        self.due = 0.0
        self.shown = False

    def update(self, text: Callable[[], str]) -> None:
        """Show `text()` if the interval has passed since the last time."""
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + self.every_s
        line = text()
        self.stream.write(f"\r\x1b[K{line}" if self.tty else f"{line}\n")
        self.stream.flush()
        self.shown = True

    def end(self) -> None:
        """Finish the line in place, so what follows starts on a line of its own."""
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


def _rows(lake: Lake, table: str) -> str:
    try:
        return str(lake.scan(table).select(pl.len()).collect().item())
    except Exception:  # not created yet, or mid-commit: say nothing rather than fail
        return "-"


def status_text(lake: Lake, started: float, traffic: Traffic | None) -> str:
    """The status line: uptime, what bronze and silver hold, what the traffic sent."""
    up = time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - started))
    text = f"up {up}: bronze {_rows(lake, BRONZE_EVENTS)} records, "
    text += f"silver {_rows(lake, SILVER_STEPS)} steps"
    if traffic is not None:
        text += f"; demo traffic {traffic.steps} steps in {traffic.rounds} rounds"
        text += f" ({traffic.errors} failed)" if traffic.errors else ""
    return text


def run_up(
    settings: ClawSettings,
    host: str = "127.0.0.1",
    port: int = 8080,
    dashboard_port: int = 8501,
    dagster_port: int = 3000,
    demo_traffic: bool = False,
    materializers: int = 1,
) -> None:
    """Start the stack and supervise it until Ctrl-C, SIGTERM or a child's death. The gateway
    binds `host`; a non-loopback one needs API keys (refused before anything starts).
    `materializers` > 1: that many followers, shard i of N each."""
    if not is_loopback(host) and not KeyRing.from_settings(settings).enabled:
        raise ClawError(
            f"refusing to bind the gateway to {host}: no API keys configured (set "
            "CLAW_API_KEYS_FILE, made with `claw keys create`, or CLAW_API_KEYS; or bind 127.0.0.1)"
        )
    if materializers < 1:
        raise ClawError(f"--materializers {materializers}: at least one")
    stack = Stack(settings, host, materializers)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    # Ctrl-C stops the stack even when started with SIGINT ignored (as a shell without job
    # control starts background commands, and Python then keeps it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(f"lake             {settings.lake_uri}; logs in {stack.logs}", flush=True)
    traffic = Traffic() if demo_traffic else None
    status = StatusLine(sys.stdout)
    try:
        stack.up(port, dashboard_port or free_port(), dagster_port or free_port())
        if traffic is not None:
            thread = threading.Thread(target=_traffic, args=(stack, stopping, traffic))
            thread.daemon = True
            thread.start()
            print("demo traffic     simulated agents keep sending steps (demo-traffic.log)")
        print("Ctrl-C stops everything.", flush=True)
        _supervise(stack, stopping, status, traffic)
    except KeyboardInterrupt:
        pass
    finally:
        status.end()
        stopping.set()
        stack.stop()


def _supervise(
    stack: Stack, stopping: threading.Event, status: StatusLine, traffic: Traffic | None
) -> None:
    """Keep the status line fresh until stopping or a child's death (reported)."""
    lake, started = Lake.from_settings(stack.settings), time.monotonic()
    while not stopping.is_set():
        dead = stack.dead()
        if dead is not None:
            status.end()
            print(
                f"claw up: {dead.verb} exited with {dead.proc.returncode}; see {dead.log_path}",
                file=sys.stderr,
            )
            return
        status.update(lambda: status_text(lake, started, traffic))
        time.sleep(0.5)
