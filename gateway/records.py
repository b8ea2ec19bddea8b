"""Bronze records: what an accepted request becomes (built from its validated wire models), and
a batch of them as Arrow (their WAL frames are in gateway.wal.frames)."""

from __future__ import annotations

import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import BaseModel

from claw_pipelines.contracts.ids import new_event_id
from claw_pipelines.contracts.tables import (
    BRONZE_EVENTS_SPEC,
    BRONZE_STEP_COLUMNS,
    SCHEMA_VERSION,
)
from claw_pipelines.contracts.wire import Step
from claw_pipelines.contracts.wire_structs import FastStep

TOKEN_FIELDS = ("prompt_ids", "response_ids", "rollout_log_probs", "response_mask")
_ARRAY_DTYPES = (np.dtype("<i4"), np.dtype("<i4"), np.dtype("<f4"), np.dtype("i1"))
_STRUCT_CODES = ("i", "i", "f", "b")
_US_PER_DAY = 86_400_000_000
_PAYLOAD = msgspec.json.Encoder()  # a FastStep's payload (a Step's is the model's JSON)

# Scalar step fields decoded from the (small) JSON payload into typed columns at flush time.
_SCALAR_COLUMNS = [f for f in BRONZE_STEP_COLUMNS if f.name not in (*TOKEN_FIELDS, "token_source")]
_SCALAR_STRUCT = pl.Struct(
    {f.name: pl.from_arrow(pa.array([], f.type)).dtype for f in _SCALAR_COLUMNS}
)


@dataclass(slots=True)
class BronzeRecord:
    """One accepted record: envelope, JSON payload, and its token arrays lifted out typed.

    The payload is the canonical JSON of the record as accepted, except that the per-token
    arrays (TOKEN_FIELDS) live in typed columns of the same bronze row. Here they are packed
    little-endian bytes (int32, int32, float32, int8), or None when absent.
    """

    event_id: str
    kind: str
    tenant: str
    received_us: int
    payload: bytes
    token_source: str | None = None
    prompt_ids: bytes | None = None
    response_ids: bytes | None = None
    rollout_log_probs: bytes | None = None
    response_mask: bytes | None = None

    def arrays(self) -> tuple[bytes | None, ...]:
        """The packed token arrays in TOKEN_FIELDS order."""
        return (self.prompt_ids, self.response_ids, self.rollout_log_probs, self.response_mask)

    def array(self, field: str) -> np.ndarray | None:
        """One token array as numpy (a view on the packed bytes)."""
        packed = getattr(self, field)
        if packed is None:
            return None
        return np.frombuffer(packed, dtype=_ARRAY_DTYPES[TOKEN_FIELDS.index(field)])


def typed_arrays(values: Sequence[Sequence[float] | None]) -> list[bytes | None]:
    """Pack validated per-token lists (in TOKEN_FIELDS order) as little-endian bytes."""
    return [
        None if v is None else struct.pack(f"<{len(v)}{code}", *v)
        for v, code in zip(values, _STRUCT_CODES, strict=True)
    ]


# -- from wire models ----------------------------------------------------------------------

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


def event_ids_for(models: Sequence[BaseModel | FastStep], idempotency_key: str | None) -> list[str]:
    """Each record's event_id: from the body, else from `event_ids`."""
    derived = event_ids(len(models), idempotency_key)
    return [getattr(m, "event_id", None) or d for m, d in zip(models, derived, strict=True)]


def step_records(
    steps: Sequence[Step | FastStep],
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
        payload = (
            step.model_dump_json(exclude=_TOKEN_FIELD_SET).encode()
            if isinstance(step, BaseModel)
            else _PAYLOAD.encode(step.payload())
        )
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


# -- Arrow ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PackedColumn:
    """One token array of many records: their packed bytes back to back, each row's byte
    count (0 when null) and whether it is null."""

    values: bytes
    nbytes: np.ndarray  # int64 per row
    is_null: np.ndarray  # bool per row

    @classmethod
    def of(cls, packed: Sequence[bytes | memoryview | None]) -> PackedColumn:
        """The column of per-record packed arrays (None: null)."""
        n = len(packed)
        return cls(
            b"".join(p for p in packed if p is not None),
            np.fromiter((0 if p is None else len(p) for p in packed), np.int64, n),
            np.fromiter((p is None for p in packed), bool, n),
        )


@dataclass(frozen=True, slots=True)
class RecordColumns:
    """Bronze records as columns (what a micro-batch needs to become Arrow): the envelope as
    lists, the payloads as one string array, the token arrays packed (TOKEN_FIELDS order)."""

    event_id: list[str]
    kind: list[str]
    tenant: list[str]
    received_us: np.ndarray  # int64
    token_source: list[str | None]
    payload: pa.StringArray
    arrays: tuple[PackedColumn, ...]

    def __len__(self) -> int:
        return len(self.event_id)


def _list_column(packed: PackedColumn, dtype: np.dtype, arrow_type) -> pa.Array:
    """A list column from rows' packed arrays: one buffer, no per-value work."""
    n = len(packed.nbytes)
    offsets = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(packed.nbytes // dtype.itemsize, out=offsets[1:])
    values = np.frombuffer(packed.values, dtype=dtype)
    return pa.ListArray.from_arrays(
        pa.array(offsets), pa.array(values), mask=pa.array(packed.is_null)
    ).cast(arrow_type)


def bronze_table(records: RecordColumns, gateway_id: str, batch_seq: int) -> pa.Table:
    """One micro-batch of records, as columns, as a `bronze/events` Arrow table."""
    n = len(records)
    received = records.received_us
    scalars = (
        pl.Series("payload", records.payload)
        .str.json_decode(_SCALAR_STRUCT)
        .struct.unnest()
        .to_arrow()
    )
    columns: dict[str, pa.Array] = {
        "event_id": pa.array(records.event_id, pa.string()),
        "kind": pa.array(records.kind, pa.string()),
        "tenant": pa.array(records.tenant, pa.string()),
        "received_at": pa.array(received, pa.timestamp("us", tz="UTC")),
        "ingest_date": pa.array((received // _US_PER_DAY).astype(np.int32), pa.date32()),
        "gateway_id": pa.array([gateway_id] * n, pa.string()),
        "batch_seq": pa.array(np.full(n, batch_seq, np.int64)),
        "schema_version": pa.array(np.full(n, SCHEMA_VERSION, np.int32)),
        "payload": records.payload,
        "token_source": pa.array(records.token_source, pa.string()),
        "shard_order": pa.nulls(n, pa.int32()),  # set as the lake lays the batch out
    }
    for field in _SCALAR_COLUMNS:
        columns[field.name] = scalars.column(field.name).cast(field.type)
    fields = {f.name: f.type for f in BRONZE_STEP_COLUMNS}
    for i, name in enumerate(TOKEN_FIELDS):
        columns[name] = _list_column(records.arrays[i], _ARRAY_DTYPES[i], fields[name])
    schema = BRONZE_EVENTS_SPEC.schema
    return pa.Table.from_arrays([columns[f.name] for f in schema], schema=schema)
