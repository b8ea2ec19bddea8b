"""The FastAPI side of the route table: documented routes generated from it, and the schema.

Requests for the table's routes are served by gateway.dispatch; the generated FastAPI routes
give /docs and /openapi.json, and answer 405 for a known path with another method. Were one
called directly, it would run the same handler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN
from gateway.asgi import Answer
from gateway.incoming import Incoming
from gateway.routes.table import Route, RouteTable, check_uids
from gateway.services import GatewayServices

REF = "#/components/schemas/{model}"


def _path_parameter(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "minLength": 1, "maxLength": MAX_UID_CHARS},
        "description": f"a uid: {UID_PATTERN}",
    }


def _openapi_extra(route: Route) -> dict[str, Any]:
    """Parameters and body of a route (we parse bodies ourselves: FastAPI sees no model)."""
    extra: dict[str, Any] = {}
    parameters = [_path_parameter(name) for name in route.params] + list(route.headers)
    if parameters:
        extra["parameters"] = parameters
    if route.body is not None:
        schema = {"$ref": REF.format(model=route.body.__name__)}
        extra["requestBody"] = {
            "required": route.body_required,
            "content": {"application/json": {"schema": schema}},
        }
    return extra


def _endpoint(route: Route, services: Callable[[], GatewayServices]):
    """A FastAPI endpoint that runs the route's handler."""

    async def endpoint(request: Request) -> Response:
        params = dict(request.path_params)
        check_uids(params)
        incoming = Incoming(services(), request.headers, params, request.receive, request.scope)
        answer = await route.handle(incoming)
        if isinstance(answer, Answer):
            return Response(answer.body, answer.status, answer.headers, answer.media_type)
        return answer

    endpoint.__name__ = route.handle.__name__
    endpoint.__doc__ = route.handle.__doc__
    return endpoint


def document_routes(
    app: FastAPI, routes: RouteTable, services: Callable[[], GatewayServices]
) -> None:
    """Add a FastAPI route for every route of the table (`services()` gives the services)."""
    for route in routes.routes:
        app.router.add_api_route(
            route.path,
            _endpoint(route, services),
            methods=[route.method],
            summary=route.summary,
            description=route.summary,
            tags=[route.tag],
            response_model=route.response_model,
            responses=route.responses,
            openapi_extra=_openapi_extra(route) or None,
        )
    install_openapi(app, [r.body for r in routes.routes if r.body is not None])


def install_openapi(app: FastAPI, body_models: list[type[BaseModel]]) -> None:
    """Generate the schema once, with the self-parsed body models in its components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in body_models:
                body = model.model_json_schema(ref_template=REF, mode="validation")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def registered_routes(app: FastAPI) -> set[tuple[str, str]]:
    """(method, path) of the app's API routes (the docs' own routes aside)."""
    found = set()
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if methods is None or not getattr(route, "include_in_schema", False):
            continue
        found |= {(method, route.path) for method in methods if method != "HEAD"}
    return found
