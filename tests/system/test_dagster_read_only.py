"""The compose file's read-only Dagster webserver (`dagster-webserver --read-only`, for viewers)
answers read queries and refuses every mutation: launching a run, wiping an asset, stopping a
sensor, reloading the workspace. Its twin without the flag (operators, loopback only) holds the
permissions the read-only one lacks. Both run for real from deploy/compose.yaml through
tests/support/compose_local.py, on the compose file's code location."""

from __future__ import annotations

import pytest

from gateway.auth import create_key
from tests.support.compose_local import LocalCompose
from tests.support.dagster_ui import REFUSED, graphql, repository, try_mutations
from tests.support.servers import wait_until

pytestmark = pytest.mark.slow

READ_ONLY, OPERATORS = "dagster-webserver-read-only", "dagster-webserver"
PERMISSIONS = "{ permissions { permission value } }"


def test_the_read_only_webserver_answers_queries_and_refuses_mutations(tmp_path):
    _, line = create_key("viewer-tenant")
    keys_file = tmp_path / "api-keys"
    keys_file.write_text(line + "\n")
    with LocalCompose(tmp_path / "compose", binds={"./api-keys": keys_file}) as stack:
        stack.up(timeout=240, services=[READ_ONLY, OPERATORS])
        for name in (READ_ONLY, OPERATORS):
            wait_until(lambda n=name: stack.answers(n, "/server_info"), 120, what=name)
        assert "--read-only" in stack.services[READ_ONLY].argv
        assert "--read-only" not in stack.services[OPERATORS].argv
        viewer = stack.services[READ_ONLY].url()

        found = repository(viewer)
        assert found["jobs"] and found["sensors"]  # a read query answers
        sensor = found["sensors"][0]
        for name, answer in try_mutations(viewer, found).items():
            assert answer == REFUSED, (name, answer)

        states = {s["name"]: s["sensorState"]["status"] for s in repository(viewer)["sensors"]}
        assert states[sensor["name"]] == sensor["sensorState"]["status"]  # not stopped
        runs = graphql(viewer, "{ runsOrError { ... on Runs { results { runId } } } }")
        assert runs["runsOrError"]["results"] == []  # nothing launched

        def held(url: str) -> dict[str, bool]:
            return {p["permission"]: p["value"] for p in graphql(url, PERMISSIONS)["permissions"]}

        assert not any(held(viewer).values())
        operator = held(stack.services[OPERATORS].url())
        for permission in ("launch_pipeline_execution", "wipe_assets", "edit_sensor"):
            assert operator[permission], permission
        stack.down(timeout=10)
