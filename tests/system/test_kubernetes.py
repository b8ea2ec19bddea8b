"""deploy/k8s holds together with Kubernetes and with the code it deploys, checked offline (no
cluster runs here): every manifest validates against the Kubernetes JSON schemas
(`kubernetes-validate`, strict: a field Kubernetes does not have fails); each StatefulSet runs
a `claw` command our CLI accepts, with settings ClawSettings has, its volumes mounted where
those settings point; the gateways' probes hit routes the gateway serves without an API key,
and answer as probes need (served in-process from the manifest's own settings); Services and
NetworkPolicies select the pods they mean, and let in only what must talk to each component;
each component references only its own Secrets, the ones its comments tell the operator to
create, and nothing in the folder is a Secret or holds a credential (docs/DESIGN.md §17)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from claw_pipelines.app.cli import build_parser
from claw_pipelines.lake.identities import COMPONENTS
from claw_pipelines.settings import ClawSettings
from gateway.main import create_app
from gateway.openapi import registered_routes
from gateway.routes import ROUTES
from gateway.routes.ops import open_paths
from tests.support.compose_local import claw_image
from tests.support.inprocess import served
from tests.support.servers import REPO

K8S = REPO / "deploy" / "k8s"
# Kubernetes versions whose schemas kubernetes-validate ships (1.25 to 1.37 in 1.37.0): the
# oldest these manifests promise, and the newest
KUBERNETES_VERSIONS = ("1.30", "1.37")
COMPONENT = "app.kubernetes.io/component"
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# what the Secrets would hold (the comments' `kubectl create secret` lines): shapes only
SECRET_PLACEHOLDERS = {
    "CLAW_LAKE_URI": "s3://claw-lake/lake",
    "CLAW_STORAGE_OPTIONS": json.dumps(
        {"AWS_ENDPOINT_URL": "http://seaweedfs-s3:8333", "AWS_REGION": "us-east-1"}
    ),
}


def manifest_files() -> list[Path]:
    files = sorted(K8S.iterdir())
    assert files and all(f.suffix == ".yaml" for f in files), files  # none left unchecked
    return files


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def objects(kind: str) -> dict[str, dict]:
    """Name -> object of this kind, over every manifest."""
    found = {}
    for path in manifest_files():
        for doc in documents(path):
            if doc["kind"] == kind:
                assert doc["metadata"]["name"] not in found, doc["metadata"]["name"]
                found[doc["metadata"]["name"]] = doc
    return found


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels, or a Service's plain map) selects these labels."""
    assert "matchExpressions" not in selector, selector  # none used: keep this check exact
    wanted = selector.get("matchLabels", selector)
    return all(labels.get(key) == value for key, value in wanted.items())


def pod_labels(statefulset: dict) -> dict:
    return statefulset["spec"]["template"]["metadata"]["labels"]


def container(statefulset: dict) -> dict:
    (only,) = statefulset["spec"]["template"]["spec"]["containers"]
    return only


def container_port(statefulset: dict, port: int | str) -> int:
    """The container port a Service, probe or policy names (by name or by number)."""
    ports = container(statefulset).get("ports") or []
    matching = [p["containerPort"] for p in ports if port in (p.get("name"), p["containerPort"])]
    assert len(matching) == 1, (port, ports)
    return matching[0]


def mounts(statefulset: dict) -> dict[str, str]:
    """Volume name -> mount path."""
    return {m["name"]: m["mountPath"] for m in container(statefulset).get("volumeMounts") or ()}


# what the downward API gives a StatefulSet's pod `ordinal` (Kubernetes 1.28+ labels it with
# its ordinal)
POD_FIELDS = {
    "metadata.name": lambda name, ordinal: f"{name}-{ordinal}",
    "metadata.labels['apps.kubernetes.io/pod-index']": lambda name, ordinal: str(ordinal),
}


def pod_environment(statefulset: dict, ordinal: int) -> dict[str, str]:
    """The environment replica `ordinal` gets: its Secrets' keys (placeholders), then `env`
    (the pod's own name, or its ordinal, where the downward API gives it)."""
    spec = container(statefulset)
    environment = {}
    for source in spec.get("envFrom") or ():
        environment |= SECRET_PLACEHOLDERS  # every key a lake Secret holds (checked below)
        assert set(source) == {"secretRef"}, source
    for variable in spec.get("env") or ():
        if "valueFrom" in variable:
            path = variable["valueFrom"]["fieldRef"]["fieldPath"]
            assert set(variable["valueFrom"]) == {"fieldRef"}, variable
            assert path in POD_FIELDS, path
            value = POD_FIELDS[path](statefulset["metadata"]["name"], ordinal)
        else:
            value = variable["value"]
        environment[variable["name"]] = value
    return environment


def settings_of(environment: dict[str, str], monkeypatch) -> ClawSettings:
    """ClawSettings read from exactly this environment (every CLAW_ variable valid)."""
    for key in [k for k in os.environ if k.startswith("CLAW_")]:
        monkeypatch.delenv(key, raising=False)
    for key, value in environment.items():
        if key.startswith("CLAW_"):
            monkeypatch.setenv(key, value)
    return ClawSettings(_env_file=None)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas_strictly(version):
    checked = []
    for path in manifest_files():
        for doc in documents(path):
            where = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            try:  # a kind or apiVersion it has no schema for raises too
                validated = kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message}")
            assert validated == version, where
            checked.append(doc["kind"])
    assert {"StatefulSet", "Service", "NetworkPolicy"} <= set(checked), checked


def test_strict_validation_refuses_a_field_kubernetes_does_not_have():
    """The check above has teeth: a misspelt probe field, ignored by a lax schema, fails."""
    statefulset = copy.deepcopy(objects("StatefulSet")["claw-gateway"])
    probe = container(statefulset)["readinessProbe"]["httpGet"]
    probe["paht"] = probe.pop("path")
    kubernetes_validate.validate(statefulset, KUBERNETES_VERSIONS[-1], strict=False)
    with pytest.raises(kubernetes_validate.ValidationError, match="paht"):
        kubernetes_validate.validate(statefulset, KUBERNETES_VERSIONS[-1], strict=True)


def test_each_statefulset_runs_a_claw_command_the_cli_accepts():
    """The image's entrypoint is `claw`; each container names it and a verb with flags our
    parser takes (it exits on any other); the gateway listens on every interface on the port
    the container declares; the materializer follows, one replica (a second would only
    repeat its work)."""
    parser = build_parser()
    image = claw_image()
    sets = objects("StatefulSet")
    assert set(sets) == {"claw-gateway", "claw-materializer"}, set(sets)
    parsed = {}
    for name, statefulset in sets.items():
        spec = container(statefulset)
        argv = [*(spec.get("command") or image.entrypoint), *(spec.get("args") or ())]
        assert argv[0] == image.entrypoint[0] == "claw", (name, argv)
        parsed[name] = parser.parse_args(argv[1:])
        assert spec["image"].split(":")[0] == "claw-lakehouse", name  # deploy/Dockerfile's
    gateway, materializer = sets["claw-gateway"], sets["claw-materializer"]
    assert parsed["claw-gateway"].verb == "gateway"
    assert parsed["claw-gateway"].host == "0.0.0.0"
    assert container_port(gateway, "http") == parsed["claw-gateway"].port
    assert gateway["spec"]["replicas"] == 3
    assert parsed["claw-materializer"].verb == "materialize"
    assert parsed["claw-materializer"].follow is True
    assert materializer["spec"]["replicas"] == 1
    assert not container(materializer).get("ports"), "the follower serves nothing"


@pytest.mark.parametrize("name", ["claw-gateway", "claw-materializer"])
def test_settings_exist_and_the_volumes_are_where_they_point(name, monkeypatch):
    """Every CLAW_ variable is a ClawSettings field and the settings load; any other variable
    overrides one the image sets; each volume claim is mounted at a path a setting names; the
    gateways' ids differ per replica (each its own WAL folder inside its volume); the API keys
    file is the key the keys Secret's volume puts there; the image's defaults agree."""
    statefulset = objects("StatefulSet")[name]
    image = claw_image()
    mounted = mounts(statefulset)
    claims = {t["metadata"]["name"]: t for t in statefulset["spec"]["volumeClaimTemplates"]}
    assert claims and set(claims) <= set(mounted), (claims, mounted)
    for claim in claims.values():
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"], name  # a disk per replica
    policy = statefulset["spec"]["persistentVolumeClaimRetentionPolicy"]
    assert policy == {"whenScaled": "Retain", "whenDeleted": "Retain"}, name
    replicas = [
        settings_of(pod_environment(statefulset, i), monkeypatch)
        for i in range(statefulset["spec"]["replicas"])
    ]
    environment = pod_environment(statefulset, 0)
    unknown = {k for k in environment if k.startswith("CLAW_")} - {
        f"CLAW_{field.upper()}" for field in ClawSettings.model_fields
    }
    assert not unknown, unknown
    others = {k for k in environment if not k.startswith("CLAW_")}
    assert others <= set(image.env), others  # e.g. DAGSTER_HOME, the image's
    for settings in replicas:
        paths = {v for v in settings.model_dump().values() if isinstance(v, Path)}
        for claim in claims:
            assert Path(mounted[claim]) in paths, f"no setting points at {claim}'s volume"
    if name == "claw-materializer":  # one follows the whole lake; N split it, pod i shard i
        assert [s.resolved_shard for s in replicas] == [None]
        scaled = copy.deepcopy(statefulset)
        scaled["spec"]["replicas"] = 3
        for variable in container(scaled)["env"]:
            if variable["name"] == "CLAW_SHARD_COUNT":
                variable["value"] = "3"
        shards = [settings_of(pod_environment(scaled, i), monkeypatch) for i in range(3)]
        assert [s.resolved_shard for s in shards] == ["0/3", "1/3", "2/3"]
    if name == "claw-gateway":
        ids = [s.gateway_id for s in replicas]
        assert len(set(ids)) == len(ids) == 3, ids
        wal = Path(mounted["wal"])
        assert str(wal) == image.env["CLAW_WAL_DIR"]
        assert len({s.resolved_wal_dir for s in replicas}) == 3
        assert all(s.resolved_wal_dir.parent == wal for s in replicas)
        keys = replicas[0].api_keys_file
        volume = next(
            v
            for v in statefulset["spec"]["template"]["spec"]["volumes"]
            if Path(mounted[v["name"]]) == keys.parent
        )
        assert keys.name in [item["path"] for item in volume["secret"]["items"]]
        assert replicas[0].upstream_url  # the model it proxies to
    else:
        (settings,) = replicas
        state = Path(mounted["follower"])
        assert settings.resolved_follower_state == state
        assert str(state) == image.env["CLAW_FOLLOWER_STATE"]
        assert environment["DAGSTER_HOME"] == ""  # no Dagster instance in the container


def test_gateway_probes_hit_routes_it_serves_without_a_key(monkeypatch, tmp_path):
    """Readiness on /readyz, liveness (and start-up) on /healthz: GET routes of the gateway's
    table and of its FastAPI app, on the container's port, answered without an API key (the
    kubelet sends none). Served in-process from the manifest's settings, with keys in the keys
    file: both answer 200 unauthenticated while /metrics asks for a key; a gateway that is
    not ready answers 503 on /readyz and still 200 on /healthz, so the kubelet takes it out of
    the Service without restarting it. The materializer, which serves nothing, has no probe."""
    statefulset = objects("StatefulSet")["claw-gateway"]
    spec = container(statefulset)
    environment = pod_environment(statefulset, 0)
    keys_file = tmp_path / "keys" / Path(environment["CLAW_API_KEYS_FILE"]).name
    keys_file.parent.mkdir()
    keys_file.write_text("sha256:" + "0f" * 32 + " tenant-a\n")
    environment["CLAW_API_KEYS_FILE"] = str(keys_file)
    environment["CLAW_LAKE_URI"] = str(tmp_path / "lake")  # the landing is held in memory
    settings = settings_of(environment, monkeypatch)
    table = {(route.method, route.path) for route in ROUTES.routes}
    documented = registered_routes(create_app(settings))
    paths = {}
    for probe in PROBES:
        get = spec[probe]["httpGet"]
        assert set(get) == {"path", "port"}, get  # no headers: no key
        assert container_port(statefulset, get["port"]) == 8080
        assert ("GET", get["path"]) in table and ("GET", get["path"]) in documented
        assert get["path"] in open_paths(settings), f"{get['path']} would ask for a key"
        paths[probe] = get["path"]
    assert paths == {"startupProbe": "/healthz", "readinessProbe": "/readyz",
                     "livenessProbe": "/healthz"}  # fmt: skip

    async def scenario():
        async with served(settings) as (client, landing):
            for path in set(paths.values()):
                answer = await client.get(path)
                assert answer.status_code == 200, (path, answer.text)
            assert (await client.get("/readyz")).json()["status"] == "ready"
            assert (await client.get("/metrics")).status_code == 401  # keys are on
            landing.ready = False
            assert (await client.get("/readyz")).status_code == 503
            assert (await client.get("/healthz")).status_code == 200

    asyncio.run(scenario())
    materializer = container(objects("StatefulSet")["claw-materializer"])
    assert not set(PROBES) & set(materializer), "no route to probe, no claw verb to exec"


def test_services_reach_the_gateways_on_their_port():
    """The headless Service the StatefulSet names, and a ClusterIP one for clients, select
    the gateway pods and target the gateway's port; nothing selects the materializer; the
    disruption budget keeps all but one replica up."""
    sets = objects("StatefulSet")
    gateway, materializer = sets["claw-gateway"], sets["claw-materializer"]
    for statefulset in sets.values():
        assert selects(statefulset["spec"]["selector"], pod_labels(statefulset))
    services = objects("Service")
    selecting = {
        n for n, s in services.items() if selects(s["spec"]["selector"], pod_labels(gateway))
    }
    headless = gateway["spec"]["serviceName"]
    assert selecting == set(services) == {headless, "claw-gateway"}, selecting
    assert services[headless]["spec"]["clusterIP"] == "None"
    assert services["claw-gateway"]["spec"]["type"] == "ClusterIP"
    for service in services.values():
        (port,) = service["spec"]["ports"]
        assert container_port(gateway, port["targetPort"]) == port["port"] == 8080
        assert not selects(service["spec"]["selector"], pod_labels(materializer))
    assert materializer["spec"]["serviceName"] not in services  # it takes no traffic
    (budget,) = objects("PodDisruptionBudget").values()
    assert selects(budget["spec"]["selector"], pod_labels(gateway))
    assert budget["spec"]["maxUnavailable"] == 1 < gateway["spec"]["replicas"]


def test_network_policies_let_in_only_what_must_talk_to_each_component():
    """Each component's pods are selected by one policy that governs inbound traffic: the
    gateways take it from pods of this namespace only (no other namespace, no address
    block), on their port only; the materializer takes none. No policy selects every pod of
    the namespace (Dagster's chart runs there too, with its own traffic)."""
    sets = objects("StatefulSet")
    policies = objects("NetworkPolicy")
    governing = {}
    for name, statefulset in sets.items():
        (policy,) = [
            p
            for p in policies.values()
            if selects(p["spec"]["podSelector"], pod_labels(statefulset))
        ]
        assert "Ingress" in policy["spec"]["policyTypes"], name
        governing[name] = policy["spec"]
    assert all(p["spec"]["podSelector"].get("matchLabels") for p in policies.values())
    (rule,) = governing["claw-gateway"]["ingress"]
    assert rule["from"] == [{"podSelector": {}}], rule  # this namespace's pods, nothing else
    (port,) = rule["ports"]
    assert port.get("protocol", "TCP") == "TCP"
    assert container_port(sets["claw-gateway"], port["port"]) == 8080
    assert governing["claw-materializer"].get("ingress", []) == []


def referenced_secrets(value) -> set[str]:
    """Names of every Secret an object refers to: envFrom, env valueFrom, volumes, pulls."""
    found = set()
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in ("secretRef", "secretKeyRef") and isinstance(inner, dict):
                found.add(inner["name"])
            elif key == "secret" and isinstance(inner, dict):
                found.add(inner["secretName"])
            elif key == "imagePullSecrets":
                found |= {s["name"] for s in inner}
            found |= referenced_secrets(inner)
    elif isinstance(value, list):
        for inner in value:
            found |= referenced_secrets(inner)
    return found


def test_each_component_references_only_its_own_secrets():
    """No Secret object is in the folder. Each component (a lake identity `claw lake-secrets`
    knows) reads exactly one lake Secret, its own claw-lake-<component>, through envFrom; any
    other Secret it mounts is its own too (claw-<component>-...); nothing else refers to a
    Secret. The comments tell the operator to create exactly the Secrets the manifests name,
    with keys ClawSettings reads or the keys a Secret volume mounts."""
    kinds = {doc["kind"] for path in manifest_files() for doc in documents(path)}
    assert "Secret" not in kinds
    for path in manifest_files():
        text = path.read_text()
        named, mounted_keys = set(), set()
        for doc in documents(path):
            refs = referenced_secrets(doc)
            named |= refs
            if doc["kind"] != "StatefulSet":
                assert not refs, (doc["kind"], refs)
                continue
            component = pod_labels(doc)[COMPONENT]
            assert component in COMPONENTS, component
            lake = {r for r in refs if r.startswith("claw-lake-")}
            assert lake == {f"claw-lake-{component}"}, (component, refs)
            env_from = [s["secretRef"]["name"] for s in container(doc).get("envFrom") or ()]
            assert env_from == [f"claw-lake-{component}"], env_from
            others = refs - lake
            assert all(r.startswith(f"claw-{component}-") for r in others), others
            mounted_keys |= {
                item["key"]
                for v in doc["spec"]["template"]["spec"].get("volumes") or ()
                if "secret" in v
                for item in v["secret"]["items"]
            }
        told = set(re.findall(r"kubectl create secret generic ([\w-]+)", text))
        assert told == named, (path.name, told, named)
        literal_keys = set(re.findall(r"--from-literal=(\w+)=", text))
        assert literal_keys == set(SECRET_PLACEHOLDERS), literal_keys
        assert all(k[5:].lower() in ClawSettings.model_fields for k in literal_keys)
        file_keys = set(re.findall(r"--from-file=([\w-]+)=", text))
        assert file_keys <= mounted_keys, (file_keys, mounted_keys)


SENSITIVE = re.compile(r"SECRET|PASSWORD|TOKEN|_KEY$|_KEYS$|ACCESS_KEY|STORAGE_OPTIONS$")


def test_nothing_in_deploy_k8s_holds_a_credential():
    """No key pair, key hash, private key or the old claw/claw-secret pair is written in the
    folder; no environment variable that carries a credential (the lake's storage options,
    API keys) is given a value inline: they come from the Secrets."""
    for path in manifest_files():
        text = path.read_text()
        for secret in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "claw-secret", "secretKey"):
            assert secret not in text, (path.name, secret)
        for shape in (r"AKIA[0-9A-Z]{16}", r"sha256:[0-9a-f]{64}", r"-----BEGIN"):
            assert not re.search(shape, text), (path.name, shape)
        for doc in documents(path):
            if doc["kind"] != "StatefulSet":
                continue
            for variable in container(doc).get("env") or ():
                if SENSITIVE.search(variable["name"]):
                    assert "value" not in variable, (path.name, variable["name"])


def test_the_manifests_cite_only_what_the_repository_has():
    sections = set(re.findall(r"^## (\d+)\. ", (REPO / "docs" / "DESIGN.md").read_text(), re.M))
    for path in manifest_files():
        text = path.read_text()
        for cited in re.findall(r"\b(?:deploy|docs)/[\w./-]*[\w/]", text):
            assert (REPO / cited).exists(), (path.name, cited)
        for section in re.findall(r"docs/DESIGN\.md §(\d+)", text):
            assert section in sections, (path.name, section)
