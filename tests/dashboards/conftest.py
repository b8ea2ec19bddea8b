"""AppTest runs the dashboard in this process, on no server: say it listens on loopback, as
`claw dashboard` does by default (with no login configured the dashboard serves only loopback,
and an unset address means every interface)."""

from __future__ import annotations

import pytest
from streamlit import config


@pytest.fixture(autouse=True)
def served_on_loopback():
    before = config.get_option("server.address")
    config.set_option("server.address", "127.0.0.1")
    yield
    config.set_option("server.address", before)
