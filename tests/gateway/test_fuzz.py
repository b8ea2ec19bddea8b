"""schemathesis against the live gateway's OpenAPI schema: every route, valid and invalid
data (a bounded number of cases each). No 5xx, and every response is what the schema
documents (status code, content type, body schema)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.support.servers import GatewayProcess
from tests.support.upstreams import SimProcess, proxy_env

KEY = "fuzz-key"
EXAMPLES = 20
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzzed_gateway(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    with (
        SimProcess(base) as sim,
        GatewayProcess(base / "lake", **proxy_env(sim.url, KEY, "fuzz")) as gateway,
    ):
        yield gateway


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_route_answers_5xx_or_off_schema(fuzzed_gateway, mode):
    headers = {"Authorization": f"Bearer {KEY}"}  # the schema, like every route, needs a key
    schema = schemathesis.openapi.from_url(fuzzed_gateway.url + "/openapi.json", headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15  # every route is documented and fuzzed
    fuzzed = 0
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case):
            case.headers = {**(case.headers or {}), **headers}
            response = case.call(base_url=fuzzed_gateway.url, timeout=30)
            case.validate_response(response, checks=CHECKS)

        try:
            fuzz()
            fuzzed += 1
        except Unsatisfiable:  # nothing about this route can be made invalid (e.g. /healthz)
            assert mode == GenerationMode.NEGATIVE
    assert fuzzed >= 10
