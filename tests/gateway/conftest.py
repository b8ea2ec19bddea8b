"""The gateway folder's fixtures: real gateway processes, shared by a module's tests."""

from __future__ import annotations

import pytest

from tests.support.servers import OTHER_KEY, TEST_KEY, GatewayProcess


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway with auth off (loopback), its own lake, shared by a module's tests."""
    lake = tmp_path_factory.mktemp("gw") / "lake"
    with GatewayProcess(lake, CLAW_FLUSH_INTERVAL_MS="50") as server:
        yield server


@pytest.fixture(scope="module")
def secured_gateway(tmp_path_factory):
    """A gateway with two API keys mapped to tenants a and b."""
    lake = tmp_path_factory.mktemp("gw-auth") / "lake"
    keys = f"{TEST_KEY}=tenant-a,{OTHER_KEY}=tenant-b"
    with GatewayProcess(lake, CLAW_API_KEYS=keys, CLAW_FLUSH_INTERVAL_MS="50") as server:
        yield server
