"""The one route table: the dispatcher serves it, FastAPI documents it, nothing else exists."""

from __future__ import annotations

import asyncio

import pytest
from starlette.middleware.gzip import GZipMiddleware

from claw_pipelines.settings import ClawSettings
from gateway.main import check_only_table_routes, create_app
from gateway.openapi import registered_routes
from gateway.routes import ROUTES
from gateway.routes.table import Route, RouteTable


def app(tmp_path):
    return create_app(ClawSettings(lake_uri=str(tmp_path / "lake")))


def test_every_table_route_is_documented_and_nothing_else(tmp_path):
    documented = registered_routes(app(tmp_path))
    assert documented == {(route.method, route.path) for route in ROUTES.routes}
    schema = app(tmp_path).openapi()
    for route in ROUTES.routes:
        operation = schema["paths"][route.path][route.method.lower()]
        assert operation["summary"] == route.summary
        names = {p["name"] for p in operation.get("parameters", [])}
        assert set(route.params) <= names


def test_a_middleware_cannot_be_added(tmp_path):
    with pytest.raises(TypeError, match=r"gateway\.dispatch"):
        app(tmp_path).add_middleware(GZipMiddleware)
    with pytest.raises(TypeError, match=r"gateway\.dispatch"):

        @app(tmp_path).middleware("http")
        async def timing(request, call_next):
            return await call_next(request)


def test_a_route_or_dependency_outside_the_table_stops_the_app_from_starting(tmp_path):
    extra = app(tmp_path)

    @extra.get("/v1/sneaky")
    async def sneaky():
        return {}

    outside = r"routes outside the table: \[\('GET', '/v1/sneaky'\)\]"
    with pytest.raises(RuntimeError, match=outside):
        check_only_table_routes(extra)
    with pytest.raises(RuntimeError, match="outside the table"):
        asyncio.run(_start(extra))  # the lifespan is where FastAPI builds its stack

    dependent = app(tmp_path)
    dependent.router.dependencies.append(object())
    with pytest.raises(RuntimeError, match="dependencies"):
        check_only_table_routes(dependent)


async def _start(app) -> None:
    messages = iter([{"type": "lifespan.startup"}])

    async def receive():
        return next(messages)

    async def send(message):
        pass

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)


def test_matching_exact_templates_and_invalid_uids():
    async def handle(incoming):
        """A test route."""

    table = RouteTable(
        [
            Route("POST", "/v1/things", handle, "t"),
            Route("POST", "/{a_uid}/{b_uid}/v1/x", handle, "t"),
            Route("GET", "/{a_uid}/{b_uid}/v1/x", handle, "t"),
        ]
    )
    assert table.match("POST", "/v1/things")[1] == {}
    assert table.match("GET", "/p/q/v1/x")[1] == {"a_uid": "p", "b_uid": "q"}
    assert table.match("GET", "/v1/things") is None  # FastAPI answers 405
    assert table.match("POST", "/p/q/r/v1/x") is None
    with pytest.raises(Exception, match="b_uid: String should match pattern"):
        table.match("POST", "/p/bad uid/v1/x")
    with pytest.raises(ValueError, match="declared twice"):
        RouteTable([Route("GET", "/a", handle, "t"), Route("GET", "/a", handle, "t")])


def test_in_process_requests_are_served_from_the_table_and_validated(tmp_path):
    from tests.support.ingest import step
    from tests.support.inprocess import served

    async def scenario():
        async with served(ClawSettings(lake_uri=str(tmp_path / "lake"))) as (client, landing):
            ok = await client.post("/v1/steps", json={"steps": [step(), step(step_index=1)]})
            assert ok.status_code == 200 and ok.json()["accepted"] == 2
            assert [r.kind for r in landing.records] == ["step", "step"]

            bad = await client.post("/v1/steps", json={"steps": [step(prompt_ids=[])]})
            assert bad.status_code == 422
            assert bad.json()["error"]["param"].startswith("steps[0].prompt_ids")
            invalid_uid = await client.post("/v1/trajectories/bad uid/complete", json={})
            assert invalid_uid.status_code == 422
            assert invalid_uid.json()["error"]["param"] == "trajectory_uid"
            assert len(landing.records) == 2  # nothing more landed

            done = await client.post("/v1/trajectories/t-9/complete", json={"reward": 1.0})
            assert done.status_code == 200 and landing.records[-1].kind == "trajectory_complete"
            wrong_method = await client.get("/v1/steps")
            assert wrong_method.status_code == 405 and "error" in wrong_method.json()
            unknown = await client.get("/v2/nothing")
            assert unknown.status_code == 404 and "no route GET /v2/nothing" in unknown.text

            metrics = (await client.get("/metrics")).text
            template = 'route="/v1/trajectories/{trajectory_uid}/complete",status="200"'
            assert template in metrics
            assert (await client.get("/openapi.json")).json()["paths"]["/v1/steps"]["post"]

    asyncio.run(scenario())
