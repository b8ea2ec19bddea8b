"""The deployment artefacts hold together with the code they deploy: the Dockerfile lints, the
compose file parses and every command in it is one our CLI (or Dagster's) accepts, with
settings the gateway takes; the Helm values use only keys of Dagster's chart and name the
code location module, which loads; the pool limits are the ones `claw up` writes."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster._cli.api import grpc_command
from dagster._daemon.cli import run_command as daemon_run_command
from dagster_webserver.cli import dagster_webserver

from claw_pipelines.app.cli import build_parser
from claw_pipelines.app.up import DAGSTER_YAML
from claw_pipelines.settings import ClawSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# Key paths of Dagster's Helm chart (1.13) these values may use: its values schema
# (helm/dagster/schema: UserDeployment, Webserver, Daemon, Concurrency*). "[]" is a list item.
CHART_KEYS = {
    "dagster-user-deployments.enabled",
    "dagster-user-deployments.enableSubchart",
    "dagster-user-deployments.deployments[].name",
    "dagster-user-deployments.deployments[].image.repository",
    "dagster-user-deployments.deployments[].image.tag",
    "dagster-user-deployments.deployments[].image.pullPolicy",
    "dagster-user-deployments.deployments[].dagsterApiGrpcArgs[]",
    "dagster-user-deployments.deployments[].port",
    "dagster-user-deployments.deployments[].envSecrets[].name",
    "dagster-user-deployments.deployments[].envConfigMaps[].name",
    "dagsterWebserver.envSecrets[].name",
    "dagsterDaemon.enabled",
    "dagsterDaemon.envSecrets[].name",
    "concurrency.enabled",
    "concurrency.pools.defaultLimit",
    "concurrency.pools.granularity",
    "concurrency.pools.opGranularityRunBuffer",
    "concurrency.runs.maxConcurrentRuns",
    "concurrency.runs.tagConcurrencyLimits[].key",
    "concurrency.runs.tagConcurrencyLimits[].value",
    "concurrency.runs.tagConcurrencyLimits[].limit",
}
DAGSTER_COMMANDS = {
    ("dagster", "api", "grpc"): grpc_command,
    ("dagster-webserver",): dagster_webserver,
    ("dagster-daemon", "run"): daemon_run_command,
}


def key_paths(value, prefix: str = "") -> set[str]:
    """Every leaf's dotted path in a YAML document ("[]" for list items)."""
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


def test_compose_commands_and_settings_are_ones_the_code_accepts(monkeypatch):
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    parser = build_parser()
    gateway_ids, wal_volumes = [], []
    for name, service in services.items():
        for needed in service.get("depends_on") or ():
            assert needed in services, f"{name} depends on a missing service {needed}"
        for volume in service.get("volumes") or ():
            source = volume.split(":")[0]
            assert source.startswith(".") or source in compose["volumes"], (name, volume)
        if service.get("image") != "claw-lakehouse:latest":
            continue
        entrypoint, command = service.get("entrypoint") or ["claw"], service["command"]
        if entrypoint == ["claw"]:
            parser.parse_args(command)  # SystemExit on a verb or flag claw does not have
        elif tuple(entrypoint) in DAGSTER_COMMANDS:
            DAGSTER_COMMANDS[tuple(entrypoint)].make_context(entrypoint[-1], list(command))
        else:
            assert entrypoint == ["python", "-c"], (name, entrypoint)
            compile(command[0], name, "exec")
        environment = service.get("environment") or {}
        for key in [k for k in os.environ if k.startswith("CLAW_")]:
            monkeypatch.delenv(key, raising=False)
        for key, value in environment.items():
            assert key.startswith("CLAW_"), (name, key)
            monkeypatch.setenv(key, value)
        settings = ClawSettings(_env_file=None)  # every CLAW_ variable valid, options safe
        unknown = {k for k in environment if k[5:].lower() not in ClawSettings.model_fields}
        assert not unknown, (name, unknown)
        if command[0] == "gateway":
            gateway_ids.append(settings.gateway_id)
            wal_volumes += [v for v in service["volumes"] if v.endswith(":/var/lib/claw/wal")]
    assert len(gateway_ids) == len(set(gateway_ids)) == 3, gateway_ids
    assert len(set(wal_volumes)) == 3, "each replica needs a WAL of its own"


def test_helm_values_use_chart_keys_and_name_a_code_location_that_loads():
    values = yaml.safe_load((DEPLOY / "helm" / "values.yaml").read_text())
    assert key_paths(values) <= CHART_KEYS, key_paths(values) - CHART_KEYS
    (deployment,) = values["dagster-user-deployments"]["deployments"]
    args = deployment["dagsterApiGrpcArgs"]
    grpc_command.make_context("grpc", list(args))  # flags dagster api grpc accepts
    module = importlib.import_module(args[args.index("--module-name") + 1])
    assert isinstance(module.defs, dg.Definitions)
    assert module.defs.resolve_asset_graph().get_all_asset_keys()


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
