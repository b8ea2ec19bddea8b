"""The write routes (steps, feedback, events, completions, Claw-R1 steps) as data, and the one
function that performs a write; both the FastAPI routes and the ASGI fast path call it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from claw_pipelines.contracts.limits import is_uid
from claw_pipelines.contracts.wire import (
    Event,
    Feedback,
    StepBatch,
    SubmitStepsRequest,
    TrajectoryCompleted,
    TrajectoryCompletion,
)
from gateway.deps import idempotency_key_of, parse_json, tenant_of
from gateway.intake import accept, fact_record, step_records
from gateway.records import BronzeRecord

# (body, tenant, idempotency key, path parameters, published policy version) -> records
Build = Callable[[Any, str, str | None, Mapping[str, str], int | None], list[BronzeRecord]]


@dataclass(frozen=True)
class WriteRoute:
    """A POST route that lands records: its path template, body model and record builder."""

    path: str
    model: type[BaseModel]
    build: Build
    optional_body: bool = False


def _steps(body: Any, tenant: str, key: str | None, _: Mapping[str, str], policy: int | None):
    return step_records(body.steps, tenant, key, policy_version=policy)


def _fact(kind: str) -> Build:
    return lambda body, tenant, key, _, __: [fact_record(body, kind, tenant, key)]


def _completion(body: Any, tenant: str, key: str | None, params: Mapping[str, str], _: int | None):
    completed = TrajectoryCompleted(trajectory_uid=params["trajectory_uid"], **body.model_dump())
    return [fact_record(completed, "trajectory_complete", tenant, key)]


STEPS = WriteRoute("/v1/steps", StepBatch, _steps)
FEEDBACK = WriteRoute("/v1/feedback", Feedback, _fact("feedback"))
EVENTS = WriteRoute("/v1/events", Event, _fact("event"))
COMPLETE = WriteRoute(
    "/v1/trajectories/{trajectory_uid}/complete", TrajectoryCompletion, _completion, True
)
CLAW_R1_STEPS = WriteRoute("/submit_steps", SubmitStepsRequest, _steps)
_EXACT = {route.path: route for route in (STEPS, FEEDBACK, EVENTS, CLAW_R1_STEPS)}
_COMPLETE_PATH = re.compile(r"^/v1/trajectories/([^/]+)/complete$")


def match_write(path: str) -> tuple[WriteRoute, dict[str, str]] | None:
    """The write route of a POST path and its path parameters (None: not a valid write)."""
    route = _EXACT.get(path)
    if route is not None:
        return route, {}
    found = _COMPLETE_PATH.match(path)
    if found and is_uid(found[1]):
        return COMPLETE, {"trajectory_uid": found[1]}
    return None  # an invalid trajectory uid is left to FastAPI, which names the field


async def perform_write(
    route: WriteRoute,
    state: Any,
    headers: Mapping[str, str],
    body: bytes,
    params: Mapping[str, str],
) -> bytes:
    """Authenticate, validate, land durably; the `Accepted` JSON (raises ApiError)."""
    tenant = tenant_of(state.keys, headers)
    key = idempotency_key_of(headers)
    model = parse_json(route.model, body, optional=route.optional_body)
    records = route.build(model, tenant, key, params, state.landing.policy_version)
    # Free the validated model (for steps: thousands of Python ints) before waiting on the
    # disk: freed now it is still in cache; freed after the wait it costs ~100 µs a request.
    del model, body
    return await accept(state.landing, records)
