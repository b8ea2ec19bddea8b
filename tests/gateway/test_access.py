"""Access as the README states it: with API keys set, health is open, `/metrics` needs a key
unless `CLAW_METRICS_PUBLIC=true`, and everything else (the docs and the schema too) needs one;
on the table's routes and FastAPI's alike. Real gateways on loopback."""

from __future__ import annotations

import httpx
import pytest

from tests.support.servers import TEST_KEY, GatewayProcess

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


def test_the_key_is_checked_before_the_body_is_judged(secured_gateway) -> None:
    """With keys set, nothing is answered before the key: an oversized or non-JSON body from
    a caller without one is a 401, never the 413 or 415 that would tell it about the limits."""
    url = secured_gateway.url + "/v1/steps"
    oversized = f"Content-Type: application/json\r\nContent-Length: {10**12}\r\n"
    assert _status_of_raw_post(url, oversized) == 401  # the declared length, judged later
    assert _status_of_raw_post(url, oversized + f"{_auth_line()}\r\n") == 413
    not_json = {"Content-Type": "text/plain"}
    without = httpx.post(url, headers=not_json, content=b"hello", timeout=10)
    assert without.status_code == 401, without.text
    assert without.json()["error"]["code"] == "missing_api_key"
    with_key = httpx.post(url, headers=not_json | WITH_KEY, content=b"hello", timeout=10)
    assert with_key.status_code == 415, with_key.text


def _auth_line() -> str:
    return f"Authorization: Bearer {TEST_KEY}"


def _status_of_raw_post(url: str, header_lines: str) -> int:
    """The status a POST with these header lines gets (its body never sent: the gateway
    must answer from the headers), over a plain socket (httpx will not send a length it does
    not have)."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as conn:
        head = f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n{header_lines}\r\n"
        conn.sendall(head.encode())
        status_line = conn.makefile("rb").readline().decode()
    return int(status_line.split()[1])


def test_a_websocket_handshake_needs_a_key_too(secured_gateway) -> None:
    """A websocket scope is authenticated like any request (the gateway serves none: with a
    key the handshake reaches FastAPI, which refuses the unknown path)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    ws_url = secured_gateway.url.replace("http://", "ws://") + "/v1/anything"
    cases = (({}, "missing_api_key"), ({"Authorization": "Bearer nope"}, "invalid_api_key"))
    for headers, reason in cases:
        before = _rejected(secured_gateway.url, reason)
        with pytest.raises(InvalidStatus) as refused:
            connect(ws_url, additional_headers=headers, open_timeout=10)
        assert refused.value.response.status_code == 403  # the handshake closed
        assert _rejected(secured_gateway.url, reason) == before + 1  # by the key check
    before = _rejected(secured_gateway.url, "missing_api_key")
    with pytest.raises(InvalidStatus):  # with a key: on to FastAPI (no such route)
        connect(ws_url, additional_headers=WITH_KEY, open_timeout=10)
    assert _rejected(secured_gateway.url, "missing_api_key") == before


def _rejected(url: str, reason: str) -> float:
    """The gateway's count of requests refused for `reason` (its /metrics)."""
    text = httpx.get(url + "/metrics", headers=WITH_KEY, timeout=10).text
    for line in text.splitlines():
        if line.startswith("claw_gateway_rejected_requests_total") and f'"{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
