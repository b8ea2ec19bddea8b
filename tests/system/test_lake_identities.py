"""The lake's object store refuses anonymous and unknown callers, and each component's S3
identity (docs/DESIGN.md §17) can do its job and no more. Everything runs against the real
SeaweedFS started from deploy/compose.yaml through tests/support/compose_local.py: the one-shot
`lake-secrets` lays out one volume per component, SeaweedFS starts with its `-s3.config` and
security.toml, the one-shot `bucket` creates the lake's bucket with the admin key. Requests are
signed as S3 clients sign them (botocore's S3SigV4Auth), or not at all."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import uuid

import grpc
import httpx
import numpy as np
import pytest

from claw_pipelines.contracts.specs import CurationSpec
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_CONSUMPTION,
    GOLD_POLICY_VERSIONS,
    SILVER_STEPS,
    gold_dataset_table,
)
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.specs import load_spec, save_spec
from gateway.auth import create_key
from tests.support.compose_local import LocalCompose
from tests.support.ingest import chat_trajectory
from tests.support.s3 import s3_error_codes, signed_s3_request, signed_s3_response
from tests.support.servers import REPO, free_port, wait_until

pytestmark = pytest.mark.slow

BUCKET = "claw-lake"
ROOT = "lake"  # deploy/compose.yaml's CLAW_LAKE_URI: s3://claw-lake/lake
URI = f"s3://{BUCKET}/{ROOT}"
NEW_BUCKET = "claw-intruder"
# the lake's folders (tables and the files beside them) and what each component may do there:
# the contract of docs/DESIGN.md §17, written out here rather than read from the code
FOLDERS = (
    "bronze/events",
    "silver/steps",
    "silver/trajectories",
    "gold/datasets/default",
    "gold/lineage",
    "gold/consumption",
    "gold/trainer_feedback",
    "gold/policy_versions",
    "specs",
    "_tokenizers",
    "_live",
    "_claw",
)
EVERYWHERE = set(FOLDERS)
WRITES = {
    "gateway": {"bronze/events", "_tokenizers", "_claw"},
    "materializer": EVERYWHERE,
    "dagster": EVERYWHERE,
    "trainer": {"gold/consumption", "gold/trainer_feedback", "gold/policy_versions", "_claw"},
    "dashboard": {"specs"},
}
READS = {
    "gateway": {"bronze/events", "gold/policy_versions", "_tokenizers"},
    "materializer": EVERYWHERE,
    "dagster": EVERYWHERE,
    "trainer": EVERYWHERE,
    "dashboard": EVERYWHERE,
}
SEEDER = "materializer"  # writes the objects the others are tried on


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The compose file's lake-secrets, s3, bucket and sim-llm as local processes, and a seed
    object in every folder."""
    workdir = tmp_path_factory.mktemp("identities")
    key, line = create_key("identities-tenant")
    keys_file = workdir / "api-keys"
    keys_file.write_text(line + "\n")
    with LocalCompose(workdir / "compose", binds={"./api-keys": keys_file}) as stack:
        stack.up(timeout=120, services=["bucket", "sim-llm"])
        stack.wait_done("bucket", 90)
        url, (access, secret) = stack.s3_url(), stack.credentials(SEEDER)
        for folder in FOLDERS:
            path = f"/{BUCKET}/{ROOT}/{folder}/seed"
            assert signed_s3_request(url, "PUT", path, access, secret, b"seed") == 200, path
        stack.api_key = key
        yield stack
        stack.down(timeout=5)  # SeaweedFS takes ~25 s to stop on SIGTERM: nothing to keep here


def lake_path(folder: str, name: str) -> str:
    return f"/{BUCKET}/{ROOT}/{folder}/{name}"


def exists(stack: LocalCompose, path: str) -> bool:
    """Whether an object is there, asked with the materializer's key (which reads everything)."""
    status = signed_s3_request(stack.s3_url(), "HEAD", path, *stack.credentials(SEEDER))
    assert status in (200, 404), (path, status)
    return status == 200


def buckets(stack: LocalCompose) -> set[str]:
    """The store's buckets, as its filer lists them (on the container's loopback only: no
    identity here may list other buckets than the lake's)."""
    _, _, filer = stack.services["s3"].extra
    listing = httpx.get(
        f"http://127.0.0.1:{filer}/buckets/", headers={"Accept": "application/json"}, timeout=10
    )
    return {entry["FullPath"].rsplit("/", 1)[-1] for entry in listing.json()["Entries"] or ()}


def multi_delete_refused(response: httpx.Response) -> bool:
    """A multi-object delete that deleted nothing: 403, or 200 with an error per key."""
    if response.status_code == 403:
        return True
    return response.status_code == 200 and "<Deleted>" not in response.text


def test_anonymous_and_unknown_callers_are_refused_everything(stack):
    """Unsigned requests, an access key the store does not know, and a known key with a wrong
    secret: creating, listing, reading, writing and deleting buckets and objects, in the lake's
    bucket and in a new one, all 403; nothing changed afterwards."""
    url = stack.s3_url()
    gateway_key, _ = stack.credentials("gateway")
    callers = {
        "anonymous": (None, None),
        "unknown key": (f"intruder-{secrets.token_hex(8)}", secrets.token_urlsafe(30)),
        "known key, wrong secret": (gateway_key, secrets.token_urlsafe(30)),
    }
    seed = lake_path("silver/steps", "seed")
    planted = lake_path("bronze/events", "intruder")
    attempts = [
        ("create the lake's bucket", "PUT", f"/{BUCKET}", None),
        ("create a new bucket", "PUT", f"/{NEW_BUCKET}", None),
        ("list buckets", "GET", "/", None),
        ("list the lake's bucket", "GET", f"/{BUCKET}", {"list-type": "2"}),
        ("list the lake", "GET", f"/{BUCKET}", {"list-type": "2", "prefix": f"{ROOT}/"}),
        ("list a new bucket", "GET", f"/{NEW_BUCKET}", {"list-type": "2"}),
        ("get an object", "GET", seed, None),
        ("head an object", "HEAD", seed, None),
        ("put an object", "PUT", planted, None),
        ("put into a new bucket", "PUT", f"/{NEW_BUCKET}/x", None),
        ("delete an object", "DELETE", seed, None),
        ("delete the lake's bucket", "DELETE", f"/{BUCKET}", None),
        ("delete a new bucket", "DELETE", f"/{NEW_BUCKET}", None),
    ]
    let_in = []
    for who, (access, secret) in callers.items():
        for what, method, path, params in attempts:
            body = b"intruder" if method == "PUT" and path.count("/") > 1 else b""
            status = signed_s3_request(url, method, path, access, secret, body, params)
            if status != 403:
                let_in.append(f"{who}: {what} ({method} {path}) -> {status}")
        objects = f"<Delete><Object><Key>{seed[len(BUCKET) + 2 :]}</Key></Object></Delete>"
        answer = signed_s3_response(
            url, "POST", f"/{BUCKET}", access, secret, objects.encode(), {"delete": ""}
        )
        if not multi_delete_refused(answer):
            let_in.append(f"{who}: multi-object delete -> {answer.status_code} {answer.text}")
    assert not let_in, "\n".join(let_in)
    assert exists(stack, seed) and not exists(stack, planted)
    assert NEW_BUCKET not in buckets(stack) and BUCKET in buckets(stack)


def test_each_component_can_do_its_job_in_the_lake_and_no_more(stack):
    """Per component and folder: a put, a get, a list and a delete are let in exactly where
    its job needs them (WRITES, READS); everyone is refused a new bucket and anything outside
    the lake's prefix; only the admin's key may create the lake's bucket."""
    url = stack.s3_url()
    wrong = []
    for component in WRITES:
        access, secret = stack.credentials(component)
        for folder in FOLDERS:
            victim = lake_path(folder, f"victim-{component}")
            assert signed_s3_request(url, "PUT", victim, *stack.credentials(SEEDER), b"v") == 200
            listing = {"list-type": "2", "prefix": f"{ROOT}/{folder}/"}
            own = lake_path(folder, f"by-{component}-{uuid.uuid4().hex[:8]}")
            outcomes = {
                "put": (signed_s3_request(url, "PUT", own, access, secret, b"x"), WRITES),
                "delete": (signed_s3_request(url, "DELETE", victim, access, secret), WRITES),
                "get": (
                    signed_s3_request(url, "GET", lake_path(folder, "seed"), access, secret),
                    READS,
                ),
                "list": (
                    signed_s3_request(url, "GET", f"/{BUCKET}", access, secret, b"", listing),
                    READS,
                ),
            }
            for action, (status, rule) in outcomes.items():
                allowed = folder in rule[component]
                if (status in (200, 204)) != allowed or (not allowed and status != 403):
                    wrong.append(f"{component} {action} {folder}: {status}, allowed={allowed}")
            if folder not in WRITES[component]:
                assert exists(stack, victim), f"{component} deleted {victim}"
        for what, method, path in [
            ("create a new bucket", "PUT", f"/{NEW_BUCKET}"),
            ("put outside the lake", "PUT", f"/{BUCKET}/elsewhere/x"),
            ("read outside the lake", "GET", f"/{BUCKET}/elsewhere/x"),
            ("list the whole bucket", "GET", f"/{BUCKET}?list-type=2"),
            ("delete the lake's bucket", "DELETE", f"/{BUCKET}"),
        ]:
            path, _, query = path.partition("?")
            params = dict([query.split("=")]) if query else None
            status = signed_s3_request(url, method, path, access, secret, b"x", params)
            if status != 403:
                wrong.append(f"{component}: {what} -> {status}")
    assert not wrong, "\n".join(wrong)
    # the brief's examples, said once more in words
    gateway, dashboard, trainer = (
        stack.credentials(c) for c in ("gateway", "dashboard", "trainer")
    )
    assert signed_s3_request(url, "DELETE", lake_path("silver/steps", "seed"), *gateway) == 403
    assert signed_s3_request(url, "PUT", lake_path("gold/datasets/x", "y"), *gateway, b"1") == 403
    assert signed_s3_request(url, "PUT", lake_path("specs", "mine.yaml"), *dashboard, b"1") == 200
    assert signed_s3_request(url, "PUT", lake_path("gold/datasets/x", "y"), *dashboard, b"1") == 403
    assert signed_s3_request(url, "PUT", lake_path("gold/consumption", "z"), *trainer, b"1") == 200
    assert signed_s3_request(url, "PUT", lake_path("silver/steps", "z"), *trainer, b"1") == 403
    admin = stack.credentials("admin")
    assert signed_s3_request(url, "PUT", f"/{NEW_BUCKET}", *admin) == 403
    status = signed_s3_response(url, "PUT", f"/{BUCKET}", *admin)
    assert status.status_code == 409 and s3_error_codes(status) == ["BucketAlreadyOwnedByYou"]


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field."""
    return bytes([(number << 3) | 2]) + _varint(len(payload)) + payload


def test_the_stores_grpc_port_refuses_an_unsigned_identity(stack):
    """SeaweedFS's S3 gRPC port (the S3 port + 10000, on the network beside S3) takes identity
    updates (SeaweedS3IamCache.PutIdentity). Without the filer signing key `lake-secrets`
    writes into security.toml anyone could add an Admin identity there (measured); with it the
    call is refused and the key it carried gets nowhere."""
    access, secret = f"intruder-{secrets.token_hex(6)}", secrets.token_urlsafe(24)
    credential = _field(1, access.encode()) + _field(2, secret.encode()) + _field(3, b"Active")
    identity = _field(1, b"intruder") + _field(2, credential) + _field(3, b"Admin")
    port = int(stack.s3_url().rsplit(":", 1)[1]) + 10000
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        put = channel.unary_unary(
            "/messaging_pb.SeaweedS3IamCache/PutIdentity",
            request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw,
        )
        with pytest.raises(grpc.RpcError) as refused:
            put(_field(1, identity), timeout=20)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    assert signed_s3_request(stack.s3_url(), "PUT", f"/{NEW_BUCKET}", access, secret) == 403


def claw(args: list[str], env: dict[str, str], timeout: float = 90) -> tuple[int, str, float]:
    """`claw ARGS` with only `env` (and PATH): exit code, stderr, seconds."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CLAW_", "AWS_"))}
    base.pop("DAGSTER_HOME", None)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "claw_pipelines.app.cli", *args],
        env=base | {"PYTHONPATH": str(REPO)} | env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    return done.returncode, done.stderr.strip(), time.monotonic() - started


def test_a_writer_with_wrong_or_missing_credentials_stops_at_start_in_one_line(stack, tmp_path):
    """`claw gateway` and `claw materialize --follow` started with a key the store refuses (a
    wrong secret, an unknown key, the read-only dashboard's key), a credentials file that is not
    there, or no key pair at all: exit 1 within seconds, one line naming the key, the lake and
    the store's answer (403 ...), no traceback, no hang."""
    shared = json.loads(stack.services["gateway-1"].env["CLAW_STORAGE_OPTIONS"])
    gateway_key, _ = stack.credentials("gateway")
    dashboard_key, dashboard_secret = stack.credentials("dashboard")
    unknown = f"gateway-{secrets.token_hex(8)}"

    def options_file(access: str, secret: str) -> str:
        path = tmp_path / f"{access}-{secret[:6]}.json"
        path.write_text(json.dumps({"AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret}))
        return str(path)

    lake = {"CLAW_LAKE_URI": URI, "CLAW_STORAGE_OPTIONS": json.dumps(shared)}
    gateway = {
        "CLAW_UPSTREAM_URL": stack.services["sim-llm"].url() + "/v1",
        "CLAW_WAL_DIR": str(tmp_path / "wal"),
        "CLAW_GATEWAY_ID": "gw-refused",
    }
    writers = {
        "gateway": ["gateway", "--port", str(free_port())],
        "materializer": ["materialize", "--follow"],
    }
    cases = [
        (
            "gateway",
            options_file(gateway_key, "not-its-secret"),
            [gateway_key, "403 SignatureDoesNotMatch"],
        ),
        ("gateway", options_file(unknown, "whatever"), [unknown, "403 InvalidAccessKeyId"]),
        (
            "gateway",
            options_file(dashboard_key, dashboard_secret),
            [dashboard_key, "403 AccessDenied"],
        ),
        (
            "materializer",
            options_file(dashboard_key, dashboard_secret),
            [dashboard_key, "403 AccessDenied"],
        ),
        ("gateway", str(tmp_path / "missing.json"), ["CLAW_STORAGE_OPTIONS_FILE", "no such file"]),
        (
            "materializer",
            None,
            ["no AWS_ACCESS_KEY_ID or AWS_SECRET_ACCESS_KEY", "http://127.0.0.1"],
        ),
    ]
    for writer, credentials, named in cases:
        env = lake | (gateway if writer == "gateway" else {"CLAW_ERROR_LOG": str(tmp_path / "e")})
        if credentials is not None:
            env["CLAW_STORAGE_OPTIONS_FILE"] = credentials
        code, stderr, seconds = claw(writers[writer], env)
        case = f"{writer} with {credentials}: exit {code} after {seconds:.1f} s: {stderr}"
        assert code == 1 and seconds < 30, case
        assert len(stderr.splitlines()) == 1 and stderr.startswith("claw: error: "), case
        assert "Traceback" not in stderr and all(part in stderr for part in named), case
        if credentials is not None and "403" in named[-1]:
            assert URI in stderr, case


def test_each_component_runs_its_real_job_with_its_own_key(stack, monkeypatch):
    """The compose file's gateway and materializer, each with only its own volume's key pair,
    land chat calls in bronze and build silver and gold; a trainer with the trainer's key pulls
    a batch, records its feedback and publishes a policy version; the dashboard's key reads all
    of it and saves a curation spec, but writes nothing else."""
    stack.up(timeout=180, services=["gateway-1", "materializer"])
    wait_until(lambda: stack.answers("gateway-1", "/readyz"), 120, what="gateway-1 ready")
    trajectories = {chat_trajectory(stack.services["gateway-1"].url(), stack.api_key)}
    reader = Lake(URI, stack.storage_options("dashboard"))

    def in_gold() -> bool:
        try:
            gold = reader.read(gold_dataset_table("default"), columns=["trajectory_uid"])
        except Exception:  # not built yet
            return False
        return trajectories <= set(gold["trajectory_uid"])

    wait_until(in_gold, 150, interval=1, what="the trajectory in gold (materializer's key)")
    assert reader.read(BRONZE_EVENTS).height and reader.read(SILVER_STEPS).height
    for name in ("gateway-1", "materializer"):
        assert stack.services[name].running, stack.tail(name)

    from claw_pipelines.consume import open_dataset, publish_policy_version

    monkeypatch.setenv("CLAW_LAKE_URI", URI)
    monkeypatch.setenv("CLAW_STORAGE_OPTIONS", json.dumps(stack.storage_options("trainer")))
    for name in (
        "CLAW_STORAGE_OPTIONS_FILE",
        "CLAW_API_KEY",
        "CLAW_API_KEYS",
        "CLAW_API_KEYS_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    dataset = open_dataset("default")
    batch = dataset.next_batch(consumer="identities-trainer", timeout=60)
    log_probs = np.full(len(batch.input_ids), -0.5, dtype=np.float32)
    assert dataset.record_feedback(batch, log_probs)
    publish_policy_version(7, by="identities-trainer")
    consumed = reader.read(GOLD_CONSUMPTION)
    assert "identities-trainer" in set(consumed["consumer"])
    assert 7 in set(reader.read(GOLD_POLICY_VERSIONS)["policy_version"])
    saved = save_spec(reader, CurationSpec(name="from-the-dashboard", tenant="identities-tenant"))
    assert load_spec(reader, "from-the-dashboard") == saved  # the Curation page's save
    with pytest.raises(Exception, match=r"403|denied|privileges"):
        reader.write_text("silver/steps/from-the-dashboard.json", "{}")
