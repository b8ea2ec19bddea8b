"""deploy/compose.yaml started without a container runtime: every service's command as a local
process, as a container of the same image would run it.

For each service: the image's entrypoint (the claw image's from deploy/Dockerfile, `claw`, run
as `python -m claw_pipelines.app.cli` with this checkout first on PYTHONPATH; `dagster*` and
SeaweedFS's `weed` from the virtualenv) with the service's command; the image's ENV and the
service's environment, with `${VAR:-default}` interpolated from a given host environment; service
hostnames and container ports rewritten to 127.0.0.1 and free ports; every container a
directory of its own (its "root": absolute container paths in arguments and environment map
into it), the image's copied files placed there, and each volume or bind mount a symlink at
its target to a shared directory (named volumes, which start with the image's files there)
or to a local file (binds, relative to the compose file unless given; a missing bind source
fails as `create_host_path: false` makes compose fail); a service's `working_dir` is that
path in its root. SeaweedFS's listeners all bind loopback here (in compose its S3 port binds
the network); no other service gets one of its ports or their gRPC twins (+10000). Services
start in dependency order, honouring `service_started`, `service_healthy` (the healthcheck's
command, run locally) and `service_completed_successfully`; `up(services=[...])` starts only
those and what they depend on.

The lake's S3 identities (docs/DESIGN.md §17) as the one-shot `lake-secrets` laid them out:
`credentials(component)`, `storage_options(component)` (what that component's processes use
here), `secrets_dir(component)`, and `s3_url()` of the store; `tests.support.s3`'s
`signed_s3_request` tries a key on it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.support.s3 import seaweed_ports
from tests.support.servers import REPO, free_port, wait_until

COMPOSE = REPO / "deploy" / "compose.yaml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
LOOPBACK = "127.0.0.1"
BIN = Path(sys.executable).parent
SEAWEED_IMAGE = "chrislusf/seaweedfs"
# What an image's entrypoint program is on this machine
PROGRAMS = {
    "claw": [sys.executable, "-m", "claw_pipelines.app.cli"],
    "python": [sys.executable],
    "dagster": [str(BIN / "dagster")],
    "dagster-webserver": [str(BIN / "dagster-webserver")],
    "dagster-daemon": [str(BIN / "dagster-daemon")],
    "weed": [str(BIN / "weed")],
}
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
_HOST_PORT = re.compile(r"(?<=//)([A-Za-z0-9_.-]+):(\d+)")
_PORT_FLAGS = re.compile(r"^(-{1,2}[\w.-]*port|-p)$")
_HOST_FLAGS = re.compile(r"^(-{1,2}[\w.-]*host|-h)$")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose's variable syntax: $$, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}."""

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = match.groups()
        value = env.get(name)
        if (operator == ":-" and not value) or (operator == "-" and value is None):
            return argument
        if operator in (":?", "?") and (value is None or (operator == ":?" and not value)):
            raise ValueError(f"compose: {name} is required: {argument}")
        return value or ""

    return _VARIABLE.sub(one, text)


def _interpolated(value: Any, env: Mapping[str, str]) -> Any:
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [_interpolated(v, env) for v in value]
    if isinstance(value, dict):
        return {k: _interpolated(v, env) for k, v in value.items()}
    return value


def load_compose(path: Path = COMPOSE, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as compose reads it: YAML anchors and merges, variables interpolated."""
    return _interpolated(yaml.safe_load(path.read_text()), env or {})


@dataclass
class Image:
    """What deploy/Dockerfile puts in the claw image that a service relies on."""

    entrypoint: list[str]
    env: dict[str, str]
    files: dict[str, Path]  # container path -> the repository file COPY put there
    workdir: str = "/"


def claw_image(dockerfile: Path = DOCKERFILE) -> Image:
    """ENTRYPOINT, ENV, WORKDIR and single-file COPYs of the Dockerfile."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    entrypoint, env, files, workdir = ["claw"], {}, {}, "/"
    for line in text.splitlines():
        instruction, _, rest = line.strip().partition(" ")
        if instruction == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif instruction == "WORKDIR":
            workdir = rest.strip()
        elif instruction == "ENV":
            for pair in shlex.split(rest):
                key, _, value = pair.partition("=")
                env[key] = value
        elif instruction == "COPY" and not rest.startswith("--"):
            *sources, target = rest.split()
            if len(sources) == 1 and (REPO / sources[0]).is_file() and not target.endswith("/"):
                files[target] = REPO / sources[0]
    return Image(entrypoint, env, files, workdir)


def _depends(service: dict[str, Any]) -> dict[str, str]:
    needed = service.get("depends_on") or {}
    if isinstance(needed, list):
        return dict.fromkeys(needed, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in needed.items()}


def _mounts(service: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(kind, source, target) of each volume entry: kind "volume" or "bind"."""
    mounts = []
    for entry in service.get("volumes") or ():
        if isinstance(entry, str):
            source, target = entry.split(":")[:2]
            kind = "bind" if source.startswith((".", "/")) else "volume"
        else:
            kind, source, target = entry["type"], entry["source"], entry["target"]
        mounts.append((kind, source, target))
    return mounts


def _listen_ports(argv: list[str]) -> list[int]:
    """The container ports a command listens on (`--port N`, `-p N`, `-s3.port=N`)."""
    ports = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if eq and flag.endswith(".port") and value.isdigit():
            ports.append(int(value))
        elif arg in ("--port", "-p") and i + 1 < len(argv) and argv[i + 1].isdigit():
            ports.append(int(argv[i + 1]))
    return ports


def _free_port(taken: set[int]) -> int:
    """A free loopback port not in `taken` (then taken too)."""
    port = free_port()
    while port in taken:
        port = free_port()
    taken.add(port)
    return port


@dataclass
class LocalService:
    """One compose service as a local process."""

    name: str
    spec: dict[str, Any]
    argv: list[str]  # as the container runs it (entrypoint + command)
    depends: dict[str, str]
    ports: dict[int, int] = field(default_factory=dict)  # container port -> local port
    extra: list[int] = field(default_factory=list)  # local ports of listeners it keeps private
    local_argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # its environment, translated
    root: Path = Path()
    cwd: Path = Path()  # the image's WORKDIR in its root
    log_path: Path = Path()
    proc: subprocess.Popen | None = None

    def url(self, port: int | None = None) -> str:
        """http://127.0.0.1:<local port> of a container port (its only one by default)."""
        (only,) = self.ports.values() if port is None else (self.ports[port],)
        return f"http://{LOOPBACK}:{only}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalCompose:
    """The services of a compose file as local processes under `workdir`."""

    def __init__(
        self,
        workdir: Path,
        binds: Mapping[str, Path],
        host_env: Mapping[str, str] | None = None,
        compose: Path = COMPOSE,
    ) -> None:
        self.workdir, self.binds = workdir, dict(binds)
        self.compose_dir = compose.parent
        self.host_env = dict(host_env or {})
        self.file = load_compose(compose, self.host_env)
        self.image = claw_image()
        self.services: dict[str, LocalService] = {}
        for name, spec in self.file["services"].items():
            argv = [*(spec.get("entrypoint") or self._entrypoint(spec)), *spec.get("command", [])]
            self.services[name] = LocalService(name, spec, argv, _depends(spec))
        taken: set[int] = set()  # SeaweedFS's ports and their gRPC twins (+10000)
        for service in self.services.values():
            if service.spec["image"].startswith(SEAWEED_IMAGE + ":"):
                local = seaweed_ports(4)  # s3, and the master, volume and filer it runs too
                listening = _listen_ports(service.argv)
                service.ports = dict(zip(listening, local, strict=False))
                service.extra = local[len(listening) :]
                taken |= {*local, *(port + 10000 for port in local)}
        for service in self.services.values():
            if not service.spec["image"].startswith(SEAWEED_IMAGE + ":"):
                service.ports = {port: _free_port(taken) for port in _listen_ports(service.argv)}
        for service in self.services.values():
            self._translate(service)

    def _entrypoint(self, spec: dict[str, Any]) -> list[str]:
        if spec["image"].startswith(SEAWEED_IMAGE + ":"):
            return ["weed"]  # its /entrypoint.sh runs `weed <command>` (adds -dir=/data)
        assert spec["image"] == "claw-lakehouse:latest", spec["image"]
        return self.image.entrypoint

    # -- translation -----------------------------------------------------------------------

    def _local_path(self, service: LocalService, path: str) -> str:
        return str(service.root / path.lstrip("/"))

    def _text(self, service: LocalService, text: str) -> str:
        """URLs naming a service's port, and absolute paths, as they are here."""

        def host_port(match: re.Match) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in self.services:
                return f"{LOOPBACK}:{self.services[host].ports[port]}"
            return match.group(0)

        text = _HOST_PORT.sub(host_port, text)
        if text.startswith("/"):
            return self._local_path(service, text)
        flag, eq, value = text.partition("=")
        if eq and flag.startswith("-") and value.startswith("/"):
            return f"{flag}={self._local_path(service, value)}"
        return text

    def _arguments(self, service: LocalService, argv: list[str]) -> list[str]:
        """Hosts to loopback, ports to local ports (a service's own, or the one of the
        service named by the last host argument), paths into the container's root."""
        out, peer = [], service
        for i, arg in enumerate(argv):
            if i and _HOST_FLAGS.match(argv[i - 1]) and arg in self.services:
                peer = self.services[arg]
                out.append(LOOPBACK)
            elif i and _HOST_FLAGS.match(argv[i - 1]) and arg == "0.0.0.0":
                out.append(LOOPBACK)
            elif i and _PORT_FLAGS.match(argv[i - 1]) and arg.isdigit():
                owner = peer if "grpc" in argv[i - 1] and peer is not service else service
                out.append(str(owner.ports[int(arg)]))
            else:
                flag, eq, value = arg.partition("=")
                if eq and flag.endswith(".port") and value.isdigit():
                    out.append(f"{flag}={service.ports[int(value)]}")
                else:
                    out.append(self._text(service, arg))
        return out

    def _translate(self, service: LocalService) -> None:
        service.root = self.workdir / "containers" / service.name
        claw = service.spec["image"] == "claw-lakehouse:latest"
        workdir = service.spec.get("working_dir") or (self.image.workdir if claw else "/")
        service.cwd = Path(self._local_path(service, workdir))
        service.log_path = self.workdir / "logs" / f"{service.name}.log"
        argv = service.argv
        program, rest = PROGRAMS[argv[0]], argv[1:]
        service.local_argv = [*program, *self._arguments(service, rest)]
        if argv[0] == "weed":
            s3, master, volume, filer = service.ports[_listen_ports(argv)[0]], *service.extra
            service.local_argv += [
                f"-ip={LOOPBACK}",
                f"-ip.bind={LOOPBACK}",
                f"-master.port={master}",
                f"-volume.port={volume}",
                f"-filer.port={filer}",
                f"-s3.ip.bind={LOOPBACK}",  # every listener here, whatever the container's
                "-s3.port.iceberg=0",  # listeners on fixed ports, private in a container
                "-s3.port.lance=0",
            ]
            assert s3 not in (master, volume, filer)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CLAW_")}
        env.pop("DAGSTER_HOME", None)
        env |= {"PYTHONPATH": str(REPO), "HOME": str(service.root / "home")}
        declared = dict(self.image.env) if claw else {}
        for key, value in (service.spec.get("environment") or {}).items():
            if value is None:  # passed through from the host's environment, when set there
                if key in self.host_env:
                    declared[key] = self.host_env[key]
            else:
                declared[key] = str(value)
        service.env = env | {k: self._text(service, v) for k, v in declared.items()}

    def _lay_out(self, service: LocalService) -> None:
        """The container's root: the image's files, its mounts as symlinks."""
        (service.root / "home").mkdir(parents=True, exist_ok=True)
        if service.spec["image"] == "claw-lakehouse:latest":
            for target, source in self.image.files.items():
                path = Path(self._local_path(service, target))
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, path)
        mounts = sorted(_mounts(service.spec), key=lambda mount: mount[2].count("/"))
        for kind, source, target in mounts:  # outer mounts first, then those inside them
            link = Path(self._local_path(service, target))
            if kind == "volume":
                assert source in (self.file.get("volumes") or {}), (service.name, source)
                local = self.workdir / "volumes" / source
                if not local.exists():  # a new volume starts with the image's files there
                    if link.is_dir():
                        shutil.copytree(link, local)
                    else:
                        local.mkdir(parents=True)
            else:
                local = self.binds.get(source, self.compose_dir / source)
                if not local.exists():  # create_host_path: false
                    raise FileNotFoundError(
                        f"{service.name}: bind source path does not exist: {source}"
                    )
            link.parent.mkdir(parents=True, exist_ok=True)
            if link.is_symlink() or link.is_file():
                link.unlink()
            elif link.is_dir():
                shutil.rmtree(link)  # what the image has there, hidden by the mount
            link.symlink_to(local.resolve())
        service.cwd.mkdir(parents=True, exist_ok=True)  # a mount's target, or the image's

    # -- running ---------------------------------------------------------------------------

    def order(self) -> list[str]:
        """Service names in dependency order."""
        done: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            assert name not in path, f"dependency cycle: {path}"
            for needed in self.services[name].depends:
                visit(needed, (*path, name))
            if name not in done:
                done.append(name)

        for name in self.services:
            visit(name, ())
        return done

    def start(self, name: str) -> LocalService:
        """Start one service's process (its root laid out the first time)."""
        service = self.services[name]
        if not service.root.exists():
            self._lay_out(service)
        service.log_path.parent.mkdir(parents=True, exist_ok=True)
        with service.log_path.open("ab") as log:
            service.proc = subprocess.Popen(
                service.local_argv,
                env=service.env,
                cwd=service.cwd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its run workers and other children go with it
            )
        return service

    def healthy(self, name: str) -> bool:
        """The service's healthcheck command, run here, exits 0."""
        service = self.services[name]
        test = service.spec["healthcheck"]["test"]
        assert test[0] == "CMD", test
        argv = [*PROGRAMS[test[1]], *self._arguments(service, test[2:])]
        try:
            done = subprocess.run(
                argv, env=service.env, cwd=service.cwd, capture_output=True, timeout=30
            )
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def _condition(self, name: str, condition: str, timeout: float) -> None:
        service = self.services[name]

        def met() -> bool:
            if condition == "service_completed_successfully":
                code = service.proc.poll()
                if code not in (None, 0):
                    raise RuntimeError(f"{name} exited with {code}: {self.tail(name)}")
                return code == 0
            if not service.running:
                raise RuntimeError(f"{name} exited with {service.proc.poll()}: {self.tail(name)}")
            return condition == "service_started" or self.healthy(name)

        wait_until(met, timeout, interval=0.5, what=f"{name}: {condition}")

    def needed(self, names: list[str]) -> set[str]:
        """`names` and every service they depend on, transitively."""
        found: set[str] = set()
        pending = list(names)
        while pending:
            name = pending.pop()
            if name not in found:
                found.add(name)
                pending += list(self.services[name].depends)
        return found

    def up(self, timeout: float = 240.0, services: list[str] | None = None) -> list[str]:
        """Start every service (or only `services` and what they depend on) in dependency
        order, each once what it depends on is ready as its `depends_on` condition says; the
        order they started in."""
        deadline = time.monotonic() + timeout
        wanted = self.needed(services) if services is not None else set(self.services)
        order = [name for name in self.order() if name in wanted]
        for name in order:
            if self.services[name].proc is not None:  # started before: running, or done
                continue
            for needed, condition in self.services[name].depends.items():
                self._condition(needed, condition, max(1.0, deadline - time.monotonic()))
            self.start(name)
        return order

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        service = self.services[name]
        service.proc.send_signal(signal.SIGKILL)
        service.proc.wait(10)

    def down(self, timeout: float = 30.0) -> None:
        """SIGTERM the process groups in waves, dependents before what they depend on (a
        gateway drains its WAL into S3 before S3 stops); SIGKILL what is left after
        `timeout`."""
        remaining = {n for n, s in self.services.items() if s.proc is not None}
        deadline = time.monotonic() + timeout
        while remaining:
            wave = [
                name
                for name in remaining
                if not any(name in self.services[other].depends for other in remaining)
            ]
            for name in wave:
                if self.services[name].running:
                    os.killpg(self.services[name].proc.pid, signal.SIGTERM)
            for name in wave:
                proc = self.services[name].proc
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.1, deadline - time.monotonic()))
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # the group: children too
                proc.wait(10)
            remaining -= set(wave)

    def wait_done(self, name: str, timeout: float = 120.0) -> None:
        """Wait until a one-shot service exited 0 (RuntimeError with its log if it failed)."""
        self._condition(name, "service_completed_successfully", timeout)

    # -- the lake's S3 identities (`claw lake-secrets`, docs/DESIGN.md §17) ---------------

    def secrets_dir(self, component: str) -> Path:
        """The local folder of the volume the one-shot `lake-secrets` writes `component`'s
        credentials into (gateway, materializer, dagster, trainer, dashboard, admin; and
        seaweedfs: its identities.json and security.toml)."""
        (writer,) = [s for s in self.services.values() if s.argv[1:2] == ["lake-secrets"]
                     and "--dir" in s.argv]  # fmt: skip
        root = writer.argv[writer.argv.index("--dir") + 1].rstrip("/")
        for kind, source, target in _mounts(writer.spec):
            if kind == "volume" and target == f"{root}/{component}":
                return self.workdir / "volumes" / source
        raise KeyError(f"lake-secrets writes no volume for {component!r}")

    def credentials(self, component: str) -> tuple[str, str]:
        """(access key, secret key) of `component`'s S3 identity, as laid out by the one-shot
        `lake-secrets` (after it ran: `up()`, or `up(services=["bucket"])`)."""
        options = json.loads((self.secrets_dir(component) / "storage-options.json").read_text())
        return options["AWS_ACCESS_KEY_ID"], options["AWS_SECRET_ACCESS_KEY"]

    def s3_url(self) -> str:
        """http://127.0.0.1:<port> of the compose file's S3 service (SeaweedFS) here."""
        (s3,) = [s for s in self.services.values() if s.argv[0] == "weed"]
        return s3.url(_listen_ports(s3.argv)[0])

    def storage_options(self, component: str) -> dict[str, str]:
        """The storage options a process of `component` uses here: the services'
        CLAW_STORAGE_OPTIONS (the endpoint, translated) and `component`'s key pair."""
        shared = next(
            json.loads(s.env["CLAW_STORAGE_OPTIONS"])
            for s in self.services.values()
            if "CLAW_STORAGE_OPTIONS" in s.env
        )
        access_key, secret_key = self.credentials(component)
        return shared | {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}

    def tail(self, name: str, chars: int = 2000) -> str:
        """The end of a service's log."""
        path = self.services[name].log_path
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def answers(self, name: str, path: str, port: int | None = None) -> bool:
        """A GET of `path` on the service answers 200 (it must still be running)."""
        if not self.services[name].running:
            raise RuntimeError(f"{name} exited: {self.tail(name)}")
        try:
            return httpx.get(self.services[name].url(port) + path, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def __enter__(self) -> LocalCompose:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()
