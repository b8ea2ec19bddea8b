"""The gateway's one route table: every route it serves, as data.

The gateway's dispatcher (gateway.dispatch) serves requests by matching this table, and the
FastAPI routes behind /docs and /openapi.json are generated from it (gateway.openapi), so a
route cannot exist in one and not in the other.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.types import ASGIApp

from claw_pipelines.contracts.limits import MAX_UID_CHARS, UID_PATTERN, is_uid
from gateway.asgi import Answer
from gateway.errors import ApiError
from gateway.incoming import Incoming

_PARAM = re.compile(r"\{([a-z_]+)\}")


# A handler answers an Incoming with an Answer, or with an ASGI app streaming its answer.
Handler = Callable[[Incoming], Awaitable[Answer | ASGIApp]]


@dataclass(frozen=True)
class Route:
    """One route: method and path template (also its metrics label), the handler, and how
    it is documented (tag, body model, response model, extra header parameters)."""

    method: str
    path: str
    handle: Handler
    tag: str
    body: type[BaseModel] | None = None
    body_required: bool = True
    response_model: type[BaseModel] | None = None
    responses: dict[int | str, dict[str, Any]] = field(default_factory=dict)
    headers: Sequence[dict[str, Any]] = ()
    doc: str | None = None  # the summary, when not the handler's docstring
    media_types: Sequence[str] = ()  # the body's media types beside JSON (the handler reads it)

    @property
    def params(self) -> list[str]:
        """The path parameters of the template, in order (each a uid)."""
        return _PARAM.findall(self.path)

    @property
    def summary(self) -> str:
        """What the route does: `doc`, else the first line of the handler's docstring."""
        return self.doc or (self.handle.__doc__ or "").strip().splitlines()[0]


class RouteTable:
    """Routes matched by exact path first, then by template in table order."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        self._exact: dict[tuple[str, str], Route] = {}
        self._templates: list[tuple[re.Pattern[str], list[Route]]] = []
        by_template: dict[str, list[Route]] = {}
        seen: set[tuple[str, str]] = set()
        for route in self.routes:
            key = (route.method, route.path)
            if key in seen:
                raise ValueError(f"route {route.method} {route.path} is declared twice")
            seen.add(key)
            if route.params:
                by_template.setdefault(route.path, []).append(route)
            else:
                self._exact[key] = route
        for template, routes in by_template.items():
            pattern = re.escape(template)
            for name in routes[0].params:
                pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>[^/]+)")
            self._templates.append((re.compile(pattern), routes))

    def match(self, method: str, path: str) -> tuple[Route, dict[str, str]] | None:
        """The route of a request and its path parameters; None when no route has this
        method and path (FastAPI then answers 404 or 405). A path parameter that is not a
        valid uid is a 422 naming it."""
        route = self._exact.get((method, path))
        if route is not None:
            return route, {}
        for pattern, routes in self._templates:
            found = pattern.fullmatch(path)
            if found is None:
                continue
            for route in routes:
                if route.method == method:
                    params = found.groupdict()
                    check_uids(params)
                    return route, params
            return None
        return None


def check_uids(params: dict[str, str]) -> None:
    """Raise a 422 naming the first path parameter that is not a valid uid."""
    for name, value in params.items():
        if not is_uid(value):
            raise ApiError(
                422,
                f"{name}: String should match pattern '{UID_PATTERN}' "
                f"(1 to {MAX_UID_CHARS} characters)",
                param=name,
                code="string_pattern_mismatch",
            )
