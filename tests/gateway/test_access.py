"""Access as the README states it: with API keys set, health is open, `/metrics` needs a key
unless `CLAW_METRICS_PUBLIC=true`, and everything else (the docs and the schema too) needs one;
on the table's routes and FastAPI's alike. Real gateways on loopback."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import TEST_KEY
from tests.servers import GatewayProcess

WITH_KEY = {"Authorization": f"Bearer {TEST_KEY}"}
# (method, path, status without a key, status with one); /metrics's open status is its setting's
ROUTES = [
    ("GET", "/healthz", 200, 200),
    ("GET", "/readyz", 200, 200),
    ("GET", "/docs", 401, 200),
    ("GET", "/docs/oauth2-redirect", 401, 200),
    ("GET", "/redoc", 401, 200),
    ("GET", "/openapi.json", 401, 200),
    ("GET", "/v1/models", 401, 503),  # no upstream configured: the key passes, then 503
    ("POST", "/v1/events", 401, 200),
    ("GET", "/v1/steps", 401, 405),  # FastAPI's answer, after the key
    ("GET", "/no/such/route", 401, 404),
]


@pytest.fixture(scope="module")
def public_metrics_gateway(tmp_path_factory):
    """A gateway with keys and CLAW_METRICS_PUBLIC=true."""
    lake = tmp_path_factory.mktemp("gw-metrics") / "lake"
    keys = f"{TEST_KEY}=tenant-a"
    with GatewayProcess(lake, CLAW_API_KEYS=keys, CLAW_METRICS_PUBLIC="true") as server:
        yield server


def statuses(url: str, headers: dict[str, str]) -> dict[tuple[str, str], int]:
    """Each route's status with these headers."""
    with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
        answers = {}
        for method, path, *_ in [*ROUTES, ("GET", "/metrics")]:
            body = {"type": "ping"} if method == "POST" else None
            answers[method, path] = client.request(method, path, json=body).status_code
        return answers


@pytest.mark.parametrize("public", [False, True], ids=["metrics-need-a-key", "metrics-public"])
def test_every_route_but_health_needs_a_key_and_metrics_only_when_asked(
    request, public: bool
) -> None:
    gateway = request.getfixturevalue("public_metrics_gateway" if public else "secured_gateway")
    without, with_key = statuses(gateway.url, {}), statuses(gateway.url, WITH_KEY)
    expected_without = {(m, p): s for m, p, s, _ in ROUTES} | {
        ("GET", "/metrics"): 200 if public else 401
    }
    expected_with = {(m, p): s for m, p, _, s in ROUTES} | {("GET", "/metrics"): 200}
    assert without == expected_without
    assert with_key == expected_with
    refused = httpx.get(gateway.url + "/openapi.json", headers={"Authorization": "Bearer nope"})
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"
    assert refused.headers["www-authenticate"] == "Bearer"


def test_metrics_with_a_key_still_count_requests(secured_gateway) -> None:
    text = httpx.get(secured_gateway.url + "/metrics", headers=WITH_KEY, timeout=10).text
    assert 'claw_gateway_requests_total{route="/healthz",status="200"}' in text
