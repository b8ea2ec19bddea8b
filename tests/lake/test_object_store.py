"""Object-store lakes keep concurrent commits safe: no unsafe option is accepted, a store that
ignores conditional writes is refused before anything is written, and specs live in the
store with the same options (moto enforces conditional writes; a proxy in front of it that
drops the headers stands for a store that does not)."""

from __future__ import annotations

import datetime as dt
import json
import uuid

import boto3
import pyarrow as pa
import pytest
from botocore.exceptions import ClientError
from pydantic import ValidationError

from claw_pipelines.contracts.tables import BRONZE_EVENTS, BRONZE_EVENTS_SPEC
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.object_store import (
    UnsafeStore,
    _check_racing_puts,
    _check_sequential_puts,
    check_conditional_put,
    open_store,
    verify_lake_store,
)
from claw_pipelines.settings import ClawSettings
from tests.support.s3 import header_dropping_proxy, moto_server, s3_options, seaweed_server
from tests.support.servers import GatewayProcess

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def s3_server():
    with moto_server() as url:
        yield url


def one_event() -> pa.Table:
    now = dt.datetime.now(dt.UTC)
    return pa.table(
        {
            "event_id": [uuid.uuid4().hex],
            "kind": ["event"],
            "tenant": ["t"],
            "received_at": pa.array([now], pa.timestamp("us", tz="UTC")),
            "ingest_date": pa.array([now.date()], pa.date32()),
            "gateway_id": ["gw"],
            "batch_seq": [0],
            "schema_version": pa.array([1], pa.int32()),
            "payload": ["{}"],
        }
    )


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    with seaweed_server(tmp_path_factory.mktemp("seaweed")) as url:
        yield url


@pytest.mark.parametrize("server", ["s3_server", "seaweed"])
def test_the_test_servers_refuse_a_second_if_none_match_put(server, request):
    """Both local servers the tests and the soak use enforce conditional writes."""
    s3_server = request.getfixturevalue(server)
    client = boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    key = f"probe-{uuid.uuid4().hex}"
    client.put_object(Bucket="claw-lake", Key=key, Body=b"a", IfNoneMatch="*")
    with pytest.raises(ClientError, match="PreconditionFailed"):
        client.put_object(Bucket="claw-lake", Key=key, Body=b"b", IfNoneMatch="*")
    assert client.get_object(Bucket="claw-lake", Key=key)["Body"].read() == b"a"
    check_conditional_put("s3://claw-lake/checked", s3_options(s3_server))  # no error


def test_a_store_that_ignores_conditional_writes_is_refused_before_any_write(s3_server, tmp_path):
    with header_dropping_proxy(s3_server) as proxy:
        uri = f"s3://claw-lake/unsafe-{uuid.uuid4().hex[:8]}"
        options = s3_options(proxy)
        with pytest.raises(UnsafeStore, match="does not enforce conditional writes"):
            check_conditional_put(uri, options)
        lake = Lake(uri, options)
        with pytest.raises(UnsafeStore):
            lake.append(BRONZE_EVENTS_SPEC, one_event())
        assert not Lake(uri, s3_options(s3_server)).exists(BRONZE_EVENTS)  # nothing written
        gateway = GatewayProcess(
            tmp_path / "unused",
            CLAW_STORAGE_OPTIONS=json.dumps(options),
            CLAW_WAL_DIR=str(tmp_path / "wal"),
        )
        gateway.env["CLAW_LAKE_URI"] = uri
        with pytest.raises(RuntimeError, match="exited"):
            gateway.start(timeout=30)
        lines = [line for line in gateway.log_path.read_text().splitlines() if line.strip()]
        assert lines and "does not enforce conditional writes" in lines[-1]
        assert not any("Traceback" in line for line in lines)


def test_a_store_that_checks_then_writes_passes_one_put_after_another_but_not_the_race(
    s3_server,
):
    """A store that tests for the key and then writes (seaweedfs#8800) refuses a second put
    made after the first, so only the probe's race of two concurrent puts catches it."""
    with header_dropping_proxy(s3_server, check_then_put_s=0.3) as proxy:
        uri = f"s3://claw-lake/racy-{uuid.uuid4().hex[:8]}"
        store = open_store(uri, s3_options(proxy))
        _check_sequential_puts(store, uri)  # no error: one put after another is refused
        with pytest.raises(UnsafeStore, match=r"of 2 concurrent If-None-Match puts .* 2 succeeded"):
            check_conditional_put(uri, s3_options(proxy))
        with pytest.raises(UnsafeStore, match="under concurrency"):
            verify_lake_store(uri, s3_options(proxy))
        assert not Lake(uri, s3_options(s3_server)).exists(BRONZE_EVENTS)


@pytest.mark.parametrize("server", ["s3_server", "seaweed"])
def test_of_two_racing_conditional_puts_the_test_servers_let_exactly_one_win(server, request):
    url = request.getfixturevalue(server)
    uri = f"s3://claw-lake/race-{uuid.uuid4().hex[:8]}"
    store = open_store(uri, s3_options(url))
    for _ in range(5):  # the probe's race, a few times over
        _check_racing_puts(store, uri)


@pytest.mark.parametrize(
    "option",
    [
        {"AWS_S3_ALLOW_UNSAFE_RENAME": "true"},
        {"aws_s3_locking_provider": "dynamodb"},
        {"conditional_put": "disabled"},
    ],
)
def test_options_that_would_lose_commits_are_refused_naming_the_option(s3_server, option):
    name = next(iter(option))
    with pytest.raises(ValidationError, match=name):
        ClawSettings(lake_uri="s3://claw-lake/x", storage_options=option)
    with pytest.raises(UnsafeStore, match=name):
        verify_lake_store(f"s3://claw-lake/{uuid.uuid4().hex}", s3_options(s3_server) | option)


def test_specs_live_in_the_store_with_the_lake_options(s3_server):
    lake = Lake(f"s3://claw-lake/specs-{uuid.uuid4().hex[:8]}", s3_options(s3_server))
    assert lake.read_text("specs/a.yaml") is None and lake.list_files("specs") == []
    lake.write_text("specs/a.yaml", "name: a\n")
    lake.write_text("specs/b.yml", "name: b\n")
    assert lake.read_text("specs/a.yaml") == "name: a\n"
    assert lake.list_files("specs", ".yaml") == ["specs/a.yaml"]


def test_every_accepted_scheme_takes_the_storage_options():
    for scheme in ("gs", "gcs"):
        google = open_store(f"{scheme}://bucket/lake", {"GOOGLE_SKIP_SIGNATURE": "true"})
        assert "bucket" in repr(google)
    azure = {
        "AZURE_STORAGE_ACCOUNT_NAME": "devstoreaccount1",
        "AZURE_STORAGE_USE_EMULATOR": "true",
        "AZURE_ALLOW_HTTP": "true",
    }
    assert "devstoreaccount1" in repr(open_store("az://container/lake", azure))
    abfs = "abfss://container@devstoreaccount1.dfs.core.windows.net/lake"
    assert "devstoreaccount1" in repr(open_store(abfs, azure))
    assert "s3" in repr(open_store("s3a://bucket/lake", s3_options("http://127.0.0.1:1"))).lower()
