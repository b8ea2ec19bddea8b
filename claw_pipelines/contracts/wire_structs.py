"""Typed msgspec structs of the hottest body, `POST /v1/steps`, decoded at wire speed.

The pydantic models (`contracts.wire`) stay the contract and the OpenAPI document. These
structs accept a subset of what they accept, to the same values: a body they decode and
`checked_steps` passes is one `StepBatch` accepts; anything else (a body they refuse, or
one a check is unsure of) goes to `StepBatch`, which accepts it or names the field in its
error. `tests/gateway/test_wire_structs.py` holds the two to that on generated bodies.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from pydantic import JsonValue, TypeAdapter, ValidationError

from claw_pipelines.contracts.limits import (
    FLOAT32_MAX,
    INT32_MAX,
    LABEL_PATTERN,
    MAX_LABEL_CHARS,
    MAX_SEQUENCE_TOKENS,
    MAX_STEPS_PER_REQUEST,
    MAX_UID_CHARS,
    UID_PATTERN,
)
from claw_pipelines.contracts.wire import check_json_object


def _anchored(pattern: str) -> str:
    """A pattern as `re.search` must read it to match what pydantic's (Rust) regex does:
    `$` there is the end of the text, in Python it also matches before a final newline."""
    return pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern


Uid = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_UID_CHARS, pattern=_anchored(UID_PATTERN))
]
Label = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_LABEL_CHARS, pattern=_anchored(LABEL_PATTERN))
]
ShortText = Annotated[str, msgspec.Meta(max_length=MAX_UID_CHARS)]
Count = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[Count], msgspec.Meta(max_length=MAX_SEQUENCE_TOKENS)]
MaskBit = Annotated[int, msgspec.Meta(ge=0, le=1)]
LogProb = Annotated[float, msgspec.Meta(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]


class StepStruct(msgspec.Struct, forbid_unknown_fields=True):
    """`contracts.wire.Step`, field for field and in its order."""

    trajectory_uid: Uid
    step_index: Count
    prompt_ids: Annotated[TokenIds, msgspec.Meta(min_length=1)]
    response_ids: TokenIds
    prompt_uid: Uid | None = None
    rollout_log_probs: (
        Annotated[list[LogProb], msgspec.Meta(max_length=MAX_SEQUENCE_TOKENS)] | None
    ) = None
    response_mask: Annotated[list[MaskBit], msgspec.Meta(max_length=MAX_SEQUENCE_TOKENS)] | None = (
        None
    )
    reward: float | None = None
    policy_version: Count | None = None
    is_last: bool = False
    finish_reason: Label | None = None
    model: ShortText | None = None
    metadata: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))
    event_id: Uid | None = None


class StepBatchStruct(msgspec.Struct, forbid_unknown_fields=True):
    """`contracts.wire.StepBatch`."""

    steps: Annotated[list[StepStruct], msgspec.Meta(min_length=1, max_length=MAX_STEPS_PER_REQUEST)]


# the payload's fields in `Step`'s order (the pydantic model's JSON), token arrays left out
PAYLOAD_FIELDS = (
    "trajectory_uid",
    "prompt_uid",
    "step_index",
    "reward",
    "policy_version",
    "is_last",
    "finish_reason",
    "model",
    "metadata",
    "event_id",
)
_DECODER = msgspec.json.Decoder(StepBatchStruct)
_METADATA = TypeAdapter(dict[str, JsonValue])


class FastStep:
    """A step decoded by the structs and checked: what `gateway.records.step_records` reads
    of a `Step` (its fields, `metadata` as a dict)."""

    __slots__ = (
        *PAYLOAD_FIELDS,
        "prompt_ids",
        "response_ids",
        "rollout_log_probs",
        "response_mask",
    )

    def __init__(self, step: StepStruct, metadata: dict[str, Any]) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(step, name) if name != "metadata" else metadata)

    def payload(self) -> dict[str, Any]:
        """The fields a bronze payload holds, in the model's order."""
        return {name: getattr(self, name) for name in PAYLOAD_FIELDS}


def checked_steps(body: bytes) -> list[FastStep] | None:
    """The steps of a `POST /v1/steps` body when the structs decode it and every check the
    model makes holds; None when the model must decide (and name the field)."""
    try:
        batch = _DECODER.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):  # the model names what is wrong
        return None
    steps = []
    # (every float decoded is finite: msgspec's JSON has no NaN or Infinity and refuses a
    # number out of range, so no float is scanned again here)
    for step in batch.steps:
        responses = len(step.response_ids)
        for values in (step.rollout_log_probs, step.response_mask):
            if values is not None and len(values) != responses:
                return None
        if step.model is not None and not _encodable(step.model):
            return None
        metadata = _metadata(bytes(step.metadata))
        if metadata is None:
            return None
        steps.append(FastStep(step, metadata))
    return steps


def _encodable(text: str) -> bool:
    """Whether a free-form string is valid UTF-8 (no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _metadata(raw: bytes) -> dict[str, Any] | None:
    """The metadata object as the model reads it (its own validator, bounded), or None."""
    if raw == b"{}":
        return {}
    try:
        return check_json_object(_METADATA.validate_json(raw))
    except (ValidationError, ValueError):
        return None
