"""OpenAPI for bodies we parse ourselves (fast JSON validation) instead of through FastAPI."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
_BODY_MODELS: dict[str, type[BaseModel]] = {}


def json_body(
    model: type[BaseModel], required: bool = True, parameters: list[dict] | None = None
) -> dict[str, Any]:
    """`openapi_extra` documenting `model` as the JSON request body (and extra parameters)."""
    _BODY_MODELS[model.__name__] = model
    extra: dict[str, Any] = {"parameters": parameters} if parameters else {}
    return extra | {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    }


def install_openapi(app: FastAPI) -> None:
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
            for name, model in _BODY_MODELS.items():
                body = model.model_json_schema(ref_template=REF, mode="validation")
                components.update(body.pop("$defs", {}))
                components[name] = body
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
