"""Who may do what in the lake's object store (docs/DESIGN.md §17): one S3 identity per
component of a deployment, allowed what its job needs under the lake's prefix and nothing
more, and the files `claw lake-secrets` keeps them in.

`write_lake_secrets(directory, lake_uri)` mints each component's key pair once and keeps it on
later runs (`<directory>/<component>/storage-options.json`: the `AWS_ACCESS_KEY_ID` and
`AWS_SECRET_ACCESS_KEY` a process reads through `CLAW_STORAGE_OPTIONS_FILE`), and writes what
SeaweedFS needs to enforce them (`<directory>/seaweedfs/`: `identities.json` for its
`-s3.config`, and `security.toml`, whose filer signing key makes it refuse unsigned calls on
its internal gRPC port, where anyone could otherwise add an identity). One folder per
component, so a deployment can give each process only its own.

SeaweedFS 4.48 scopes an action to a bucket (`Admin:claw-lake`) or to a key prefix with a
trailing `*` (`Write:claw-lake/lake/bronze/events/*`); a list is checked against its
`prefix` parameter the same way. `Write` covers puts and deletes alike (measured), so a
component that writes a folder may also delete in it.

`create_bucket(lake_uri, options)` creates the lake's bucket with the admin identity (one
SigV4-signed PUT; "exists" is success), the one thing that identity is for.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from claw_pipelines.contracts.errors import ClawError
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS,
    GOLD_CONSUMPTION,
    GOLD_POLICY_VERSIONS,
    GOLD_TRAINER_FEEDBACK,
)
from claw_pipelines.lake.object_store import PROBE_PREFIX

OPTIONS_FILE = "storage-options.json"  # in each component's folder
SEAWEEDFS = "seaweedfs"  # the store's own folder: identities.json, security.toml
IDENTITIES_FILE = "identities.json"
SECURITY_FILE = "security.toml"
SPECS = "specs"  # claw_pipelines.lake.specs.spec_path's folder
TOKENIZERS = "_tokenizers"  # claw_pipelines.lake.tokenizers.TOKENIZER_FOLDER (tested equal)
PROBE_FOLDER = PROBE_PREFIX.split("/")[0]  # the start-up probe's keys (object_store)
WHOLE_LAKE = ""


@dataclass(frozen=True)
class Grant:
    """What one component may do, as folders under the lake root ("" = the whole lake)."""

    read: tuple[str, ...] = ()  # get and list
    write: tuple[str, ...] = ()  # put and delete (one action in SeaweedFS)
    create_bucket: bool = False  # the lake's bucket, nothing else
    job: str = ""


GRANTS: dict[str, Grant] = {
    "admin": Grant(create_bucket=True, job="creates the lake's bucket (the one-shot `bucket`)"),
    "gateway": Grant(
        read=(BRONZE_EVENTS, GOLD_POLICY_VERSIONS, TOKENIZERS),
        write=(BRONZE_EVENTS, TOKENIZERS, PROBE_FOLDER),
        job="lands records in bronze (delta-rs reads its log to commit), stamps the published "
        "policy version, keeps CLAW_TOKENIZER's files, probes the store at start",
    ),
    "materializer": Grant(
        read=(WHOLE_LAKE,),
        write=(WHOLE_LAKE,),
        job="builds silver and gold, compacts and vacuums (deletes) every table",
    ),
    "dagster": Grant(
        read=(WHOLE_LAKE,),
        write=(WHOLE_LAKE,),
        job="the code location's runs: the same assets and maintenance as the materializer",
    ),
    "trainer": Grant(
        read=(WHOLE_LAKE,),
        write=(GOLD_CONSUMPTION, GOLD_TRAINER_FEEDBACK, GOLD_POLICY_VERSIONS, PROBE_FOLDER),
        job="reads gold, records what it consumed and its feedback, publishes policy versions",
    ),
    "dashboard": Grant(
        read=(WHOLE_LAKE,),
        write=(SPECS,),
        job="reads the lake, saves the curation specs its Curation page makes (the "
        "materializer builds them)",
    ),
}
COMPONENTS = tuple(GRANTS)


class LakeSecretsError(ClawError, ValueError):
    """The lake's identities cannot be written or used as asked (one line says why)."""


def split_lake_uri(lake_uri: str) -> tuple[str, str]:
    """(bucket, root) of an `s3://bucket/root` lake URI; root may be ""."""
    match = re.fullmatch(r"s3a?://([^/]+)/?(.*?)/?", lake_uri)
    if not match:
        raise LakeSecretsError(f"{lake_uri!r}: the lake's identities are for an s3:// lake")
    return match[1], match[2]


def identity_actions(grant: Grant, bucket: str, root: str) -> list[str]:
    """SeaweedFS actions of a grant on the lake at `bucket`/`root`."""

    def under(folder: str) -> str:
        path = "/".join(part for part in (bucket, root, folder) if part)
        return f"{path}/*"

    actions = [f"Admin:{bucket}"] if grant.create_bucket else []
    for folder in grant.read:
        actions += [f"Read:{under(folder)}", f"List:{under(folder)}"]
    actions += [f"Write:{under(folder)}" for folder in grant.write]
    return actions


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read, atomically (a crash leaves the old one)."""
    partial = path.with_name(path.name + ".partial")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.chmod(partial, 0o600)
    os.replace(partial, path)


def _kept_keys(path: Path) -> tuple[str, str] | None:
    try:
        options = json.loads(path.read_text(encoding="utf-8"))
        return options["AWS_ACCESS_KEY_ID"], options["AWS_SECRET_ACCESS_KEY"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _kept_signing_key(path: Path) -> str | None:
    try:
        found = re.search(r'^key = "([A-Za-z0-9_-]+)"$', path.read_text(), re.M)
    except OSError:
        return None
    return found[1] if found else None


def write_lake_secrets(directory: Path, lake_uri: str) -> dict[str, bool]:
    """Every component's credentials and SeaweedFS's identities under `directory` (one folder
    each, mode 0700, files 0600); keys already there are kept, so a restart changes nothing
    but the identities' actions, which are written again from GRANTS. Returns, per component,
    whether its key was minted now."""
    bucket, root = split_lake_uri(lake_uri)
    minted: dict[str, bool] = {}
    identities = []
    for component, grant in GRANTS.items():
        folder = directory / component
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        keys = _kept_keys(folder / OPTIONS_FILE)
        minted[component] = keys is None
        if keys is None:
            keys = (f"{component}-{secrets.token_hex(8)}", secrets.token_urlsafe(30))
            options = {"AWS_ACCESS_KEY_ID": keys[0], "AWS_SECRET_ACCESS_KEY": keys[1]}
            _write_private(folder / OPTIONS_FILE, json.dumps(options, indent=2) + "\n")
        identities.append(
            {
                "name": component,
                "credentials": [{"accessKey": keys[0], "secretKey": keys[1]}],
                "actions": identity_actions(grant, bucket, root),
            }
        )
    store = directory / SEAWEEDFS
    store.mkdir(parents=True, exist_ok=True)
    store.chmod(0o700)
    document = {"identities": identities}
    _write_private(store / IDENTITIES_FILE, json.dumps(document, indent=2) + "\n")
    signing = _kept_signing_key(store / SECURITY_FILE) or secrets.token_urlsafe(32)
    _write_private(
        store / SECURITY_FILE,
        "# SeaweedFS reads this from its working directory. The filer signing key makes its\n"
        "# gRPC services (the S3 port + 10000 among them) refuse calls not signed with it.\n"
        f'[jwt.filer_signing]\nkey = "{signing}"\n',
    )
    return minted


def _sign_v4(method: str, request: httpx.Request, access_key: str, secret: str, region: str):
    """Add AWS SigV4 headers (service s3, empty body) to `request`."""
    now = datetime.now(UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    empty = hashlib.sha256(b"").hexdigest()
    headers = {"host": request.headers["host"], "x-amz-content-sha256": empty, "x-amz-date": stamp}
    signed = ";".join(sorted(headers))
    canonical = "\n".join(
        [
            method,
            request.url.raw_path.decode().split("?")[0],
            "",
            "".join(f"{k}:{headers[k]}\n" for k in sorted(headers)),
            signed,
            empty,
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{digest}"
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    request.headers.update({k: v for k, v in headers.items() if k != "host"})
    request.headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, "
        f"Signature={signature}"
    )


def create_bucket(lake_uri: str, options: Mapping[str, str], wait_s: float = 60.0) -> str:
    """Create the bucket of an `s3://` lake at `options["AWS_ENDPOINT_URL"]` with the key pair
    in `options`, waiting up to `wait_s` for the store to answer: "created", or "exists"
    (a restart). LakeSecretsError naming the key and the bucket when the store refuses."""
    bucket, _ = split_lake_uri(lake_uri)
    endpoint = options.get("AWS_ENDPOINT_URL") or options.get("aws_endpoint_url")
    access_key = options.get("AWS_ACCESS_KEY_ID")
    secret = options.get("AWS_SECRET_ACCESS_KEY")
    if not (endpoint and access_key and secret):
        raise LakeSecretsError(
            "creating the lake's bucket needs AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in the storage options (CLAW_STORAGE_OPTIONS, "
            "CLAW_STORAGE_OPTIONS_FILE)"
        )
    region = options.get("AWS_REGION") or "us-east-1"
    deadline = time.monotonic() + wait_s
    with httpx.Client(timeout=10) as client:
        while True:
            request = client.build_request("PUT", f"{endpoint.rstrip('/')}/{bucket}")
            _sign_v4("PUT", request, access_key, secret, region)
            try:
                answer = client.send(request)
            except httpx.TransportError as exc:
                if time.monotonic() > deadline:
                    raise LakeSecretsError(f"no answer from {endpoint}: {exc}") from None
                time.sleep(1)
                continue
            if answer.status_code == 200:
                return "created"
            code = re.search(r"<Code>([^<]+)</Code>", answer.text)
            code = code[1] if code else ""
            if answer.status_code == 409 and code.startswith("BucketAlready"):
                return "exists"
            if answer.status_code >= 500 and time.monotonic() < deadline:
                time.sleep(1)
                continue
            raise LakeSecretsError(
                f"{endpoint}: access key {access_key} may not create bucket {bucket} "
                f"({answer.status_code} {code or answer.reason_phrase})"
            )
