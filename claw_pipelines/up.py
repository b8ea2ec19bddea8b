"""`claw up`: the local stack as child processes, their URLs printed, Ctrl-C stops them all."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from claw_pipelines.processes import ServiceProcess
from claw_pipelines.settings import ClawSettings


def run_up(settings: ClawSettings, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Start the simulated model (when no upstream is set) and the gateway; supervise them."""
    logs = Path(settings.lake_uri if not settings.lake_is_remote else ".claw") / "_logs"
    children: list[ServiceProcess] = []
    env = {"CLAW_LAKE_URI": settings.lake_uri}
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    try:
        if not settings.upstream_url:
            sim = ServiceProcess("sim-llm", logs / "sim-llm.log", health="/health").start()
            children.append(sim)
            env["CLAW_UPSTREAM_URL"] = f"{sim.url}/v1"
            print(
                f"simulated model  {sim.url}/v1  (a test double; set CLAW_UPSTREAM_URL for a "
                "real one)"
            )
        gateway = ServiceProcess(
            "gateway",
            logs / "gateway.log",
            port=port,
            health="/readyz",
            args=("--host", host),
            env=env,
        ).start()
        children.append(gateway)
        print(
            f"gateway          http://{host}:{port}  (OpenAI base URL: "
            f"http://{host}:{port}/v1; docs: /docs)"
        )
        print(f"lake             {settings.lake_uri}; logs in {logs}")
        print("Ctrl-C stops everything.", flush=True)
        while not stopping:
            for child in children:
                if child.proc.poll() is not None:
                    print(
                        f"claw up: {child.verb} exited with {child.proc.returncode}; see "
                        f"{child.log_path}",
                        file=sys.stderr,
                    )
                    stopping = True
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        for child in reversed(children):
            child.stop()
