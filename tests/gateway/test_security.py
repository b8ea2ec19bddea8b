"""Security: every route but health needs a key, keys never leave their tenant, no route
reaches a lake path, and the dashboard binds loopback unless told otherwise."""

from __future__ import annotations

import re

import httpx
import pytest

from claw_pipelines.app.cli import build_parser, main
from claw_pipelines.lake.delta import Lake
from tests.support.servers import TEST_KEY

OPEN = {"/healthz", "/readyz"}  # /metrics too only with CLAW_METRICS_PUBLIC (test_access.py)


def test_every_route_but_health_refuses_a_request_without_a_key(secured_gateway):
    auth = {"Authorization": f"Bearer {TEST_KEY}"}
    spec = httpx.get(secured_gateway.url + "/openapi.json", headers=auth, timeout=10).json()
    checked = 0
    for path, methods in spec["paths"].items():
        concrete = re.sub(r"\{[^}]+\}", "x1", path)
        for method in methods:
            answer = httpx.request(
                method.upper(), secured_gateway.url + concrete, json={}, timeout=10
            )
            if path in OPEN:
                assert answer.status_code != 401, path
                continue
            assert answer.status_code == 401, (method, path, answer.status_code)
            assert answer.json()["error"]["type"] == "authentication_error"
            checked += 1
    assert checked >= 15


def test_a_key_writes_only_for_its_own_tenant(secured_gateway):
    body = {
        "target": {"step_key": "someone-else:0"},
        "kind": "reward",
        "value": 1,
        "source": "rule",
        "tenant": "tenant-b",
    }
    answer = httpx.post(
        secured_gateway.url + "/v1/feedback",
        json=body,
        headers={"Authorization": f"Bearer {TEST_KEY}"},
        timeout=10,
    )
    assert answer.status_code == 422 and answer.json()["error"]["param"] == "tenant"


@pytest.mark.parametrize("uid", ["..%2F..%2Fsecrets", "%2Fetc%2Fpasswd", "a%00b"])
def test_no_route_takes_a_path_into_the_lake(secured_gateway, uid):
    answer = httpx.post(
        f"{secured_gateway.url}/v1/trajectories/{uid}/complete",
        json={},
        headers={"Authorization": f"Bearer {TEST_KEY}"},
        timeout=10,
    )
    assert answer.status_code in (404, 422)
    with pytest.raises(ValueError, match="invalid table name"):
        Lake("/tmp/lake").table_uri("../outside")


def test_the_dashboard_and_the_stack_bind_loopback_by_default():
    parser = build_parser()
    assert parser.parse_args(["dashboard"]).host == "127.0.0.1"
    assert parser.parse_args(["gateway"]).host == "127.0.0.1"
    assert parser.parse_args(["up"]).host == "127.0.0.1"


def test_claw_up_on_another_address_without_keys_refuses_before_starting_anything(
    tmp_path, monkeypatch, capsys
):
    for name in ("CLAW_API_KEYS", "CLAW_API_KEYS_FILE"):
        monkeypatch.delenv(name, raising=False)
    lake = tmp_path / "lake"
    code = main(["up", "--host", "0.0.0.0", "--lake", str(lake)])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1
    assert err.startswith("claw: error: refusing to bind the gateway to 0.0.0.0: no API keys")
    assert "CLAW_API_KEYS_FILE" in err
    assert not lake.exists()  # nothing started, nothing written
