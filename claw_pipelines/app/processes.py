"""Child services on loopback: start a process, wait until it answers, stop it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(
    predicate: Callable[[], T | None],
    timeout: float = 20.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `predicate` until it returns neither None nor False; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value is not None and value is not False:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


class ServiceProcess:
    """`python -m claw_pipelines.app.cli VERB ...` (or any `command`, where "{port}" is replaced)
    on a loopback port, logging to a file; started when `health` answers 200 (or `ready`
    says so)."""

    def __init__(
        self,
        verb: str,
        log_path: Path,
        *,
        port: int | None = None,
        health: str = "/healthz",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        command: Sequence[str] | None = None,
        ready: Callable[[], bool] | None = None,
    ) -> None:
        self.verb, self.health, self.args = verb, health, args
        self.command, self.ready = command, ready
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        self.log_path, self.cwd = log_path, cwd
        self.proc: subprocess.Popen | None = None
        self._log: Any = None

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        """Start the process and wait until its health route answers 200."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()/kill()
        if self.command is not None:
            command = [part.replace("{port}", str(self.port)) for part in self.command]
        else:
            command = [sys.executable, "-m", "claw_pipelines.app.cli", self.verb]
            command += ["--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(
            command, env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            wait_until(self._healthy, timeout, what=f"{self.verb} on port {self.port}")
        except BaseException:  # never healthy: stopped, not left behind (no __exit__ runs)
            self.stop(timeout=10)
            raise
        return self

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.verb} exited with {self.proc.returncode}: {tail}")
        if self.ready is not None:
            return self.ready()
        try:
            return httpx.get(self.url + self.health, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()

    def terminate(self) -> None:
        """SIGTERM, without waiting: `stop` then waits for the graceful exit."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait for the graceful exit (SIGKILL after `timeout`); the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log is not None:
            self._log.close()
        return self.proc.returncode if self.proc else 0

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()


class TransformersServe(ServiceProcess):
    """`transformers serve` (a real third-party OpenAI-compatible server, from transformers;
    it needs accelerate) on a loopback port: pinned to one local model folder, whose path
    requests name as their `model`, or, with `model_dir` None, loading whichever local
    folder a request names (`claw demo --learn`: one checkpoint folder per policy version).
    Requests are decoded one at a time (its continuous batching starts anew for every other
    model asked: seconds per policy version)."""

    def __init__(self, model_dir: Path | None, log_dir: Path) -> None:
        port = free_port()
        transformers = Path(sys.executable).with_name("transformers")
        command = [str(transformers), "serve"]
        command += [str(model_dir)] if model_dir is not None else []
        command += ["--device", "cpu", "--host", "127.0.0.1", "--port", "{port}"]
        super().__init__(
            "transformers-serve",
            log_dir / f"transformers-serve-{port}.log",
            port=port,
            health="/health",
            command=command,
            # one core for the model, the other for whoever calls it (a gateway, a test): on
            # two cores a server that takes both slows every process beside it
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"},
        )
        self.model = None if model_dir is None else str(model_dir)
        self.base_url = self.url + "/v1"
