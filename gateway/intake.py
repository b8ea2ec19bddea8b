"""Turn validated wire models into bronze records and land them (no FastAPI here)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pydantic import BaseModel

from claw_pipelines.contracts.ids import new_event_id
from claw_pipelines.contracts.wire import Step
from gateway.errors import ApiError
from gateway.landing import Landing, Overloaded
from gateway.records import TOKEN_FIELDS, BronzeRecord, typed_arrays

_TOKEN_FIELD_SET = set(TOKEN_FIELDS)


def now_us() -> int:
    """Current UTC time in microseconds."""
    return time.time_ns() // 1000


def event_ids(count: int, idempotency_key: str | None) -> list[str]:
    """Event ids of a request's records: from the Idempotency-Key (`key:i` when several),
    else new ones."""
    if idempotency_key is None:
        return [new_event_id() for _ in range(count)]
    if count == 1:
        return [idempotency_key]
    return [f"{idempotency_key}:{i}" for i in range(count)]


def event_ids_for(models: Sequence[BaseModel], idempotency_key: str | None) -> list[str]:
    """Each record's event_id: from the body, else from `event_ids`."""
    derived = event_ids(len(models), idempotency_key)
    return [getattr(m, "event_id", None) or d for m, d in zip(models, derived, strict=True)]


def step_records(
    steps: Sequence[Step],
    tenant: str,
    idempotency_key: str | None = None,
    *,
    kind: str = "step",
    token_source: str = "client",
    policy_version: int | None = None,
) -> list[BronzeRecord]:
    """Bronze records of white-box steps: token arrays typed, the rest as JSON payload. A
    step naming no policy version gets `policy_version` (the published one), and its
    metadata says so."""
    received = now_us()
    records = []
    for step, event_id in zip(steps, event_ids_for(steps, idempotency_key), strict=True):
        step.event_id = event_id
        if step.policy_version is None and policy_version is not None:
            step.policy_version = policy_version
            step.metadata = {**step.metadata, "policy_version_via": "published"}
        payload = step.model_dump_json(exclude=_TOKEN_FIELD_SET).encode()
        arrays = typed_arrays([getattr(step, name) for name in TOKEN_FIELDS])
        records.append(
            BronzeRecord(event_id, kind, tenant, received, payload, token_source, *arrays)
        )
    return records


def fact_record(
    model: BaseModel, kind: str, tenant: str, idempotency_key: str | None = None
) -> BronzeRecord:
    """The bronze record of a feedback, event or trajectory completion."""
    (event_id,) = event_ids_for([model], idempotency_key)
    model.event_id = event_id
    return BronzeRecord(event_id, kind, tenant, now_us(), model.model_dump_json().encode())


async def accept(landing: Landing, records: list[BronzeRecord]) -> bytes:
    """Land records durably; the `Accepted` JSON. Overload becomes 503 with Retry-After."""
    try:
        _written, duplicates = await landing.land(records)
    except Overloaded as exc:
        raise ApiError(
            503, str(exc), code="overloaded", headers={"Retry-After": str(exc.retry_after)}
        ) from None
    # Accepted, serialized by hand on the hot path (event ids are validated, JSON-safe).
    ids = '","'.join(r.event_id for r in records)
    return f'{{"accepted":{len(records)},"duplicates":{duplicates},"event_ids":["{ids}"]}}'.encode()
