"""Pydantic wire models: what agents, services and trainers send to the gateway."""

from __future__ import annotations

import json
import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    Strict,
    StringConstraints,
    ValidationInfo,
    field_validator,
)

from claw_pipelines.contracts.limits import (
    FLOAT32_MAX,
    INT32_MAX,
    LABEL_PATTERN,
    MAX_LABEL_CHARS,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    MAX_SEQUENCE_TOKENS,
    MAX_STEPS_PER_REQUEST,
    MAX_TEXT_CHARS,
    MAX_UID_CHARS,
    UID_PATTERN,
)

Uid = Annotated[str, StringConstraints(min_length=1, max_length=MAX_UID_CHARS, pattern=UID_PATTERN)]
StepKey = Annotated[
    str,
    StringConstraints(
        min_length=3, max_length=MAX_UID_CHARS + 12, pattern=UID_PATTERN[:-1] + r":[0-9]+$"
    ),
]
Label = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_LABEL_CHARS, pattern=LABEL_PATTERN)
]
ShortText = Annotated[str, StringConstraints(max_length=MAX_UID_CHARS)]
TokenId = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_SEQUENCE_TOKENS)]
MaskBit = Annotated[int, Strict(), Field(ge=0, le=1)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
LogProb = Annotated[float, Field(allow_inf_nan=False, ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
Count = Annotated[int, Strict(), Field(ge=0, le=INT32_MAX)]
Metadata = dict[str, JsonValue]

FeedbackKind = Literal["reward", "rating", "label", "comment", "correction"]
TrajectoryEnd = Literal["complete", "abandoned"]


def _json_depth(value: Any, depth: int = 0) -> int:
    """Nesting depth of a JSON value (iterative fast path for flat values)."""
    if isinstance(value, dict):
        return max((_json_depth(v, depth + 1) for v in value.values()), default=depth + 1)
    if isinstance(value, list):
        return max((_json_depth(v, depth + 1) for v in value), default=depth + 1)
    return depth


def check_json_object(value: dict[str, Any]) -> dict[str, Any]:
    """Bound a free-form JSON object in size and depth."""
    if not value:
        return value
    if _json_depth(value) > MAX_METADATA_DEPTH:
        raise ValueError(f"nested deeper than {MAX_METADATA_DEPTH} levels")
    size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"is {size} bytes of JSON; the limit is {MAX_METADATA_BYTES}")
    return value


class WireModel(BaseModel):
    """Base of every ingestion model: unknown fields are refused by name."""

    model_config = ConfigDict(extra="forbid", str_max_length=MAX_TEXT_CHARS)


class Step(WireModel):
    """One LLM call in the RL sense: state = prompt token ids, action = response token ids."""

    trajectory_uid: Uid
    prompt_uid: Uid | None = Field(None, description="GRPO prompt group; rollouts share it")
    step_index: Count
    prompt_ids: Annotated[TokenIds, Field(min_length=1)]
    response_ids: TokenIds
    rollout_log_probs: list[LogProb] | None = Field(
        None, max_length=MAX_SEQUENCE_TOKENS, description="one log-prob per response token"
    )
    response_mask: list[MaskBit] | None = Field(
        None, max_length=MAX_SEQUENCE_TOKENS, description="1 = trained on, one per response token"
    )
    reward: FiniteFloat | None = None
    policy_version: Count | None = None
    is_last: bool = False
    finish_reason: Label | None = None
    model: ShortText | None = None
    metadata: Metadata = Field(default_factory=dict)
    event_id: Uid | None = None

    _check_metadata = field_validator("metadata")(check_json_object)

    @field_validator("rollout_log_probs", "response_mask")
    @classmethod
    def _one_per_response_token(cls, values: list | None, info: ValidationInfo) -> list | None:
        response_ids = info.data.get("response_ids")
        if values is not None and response_ids is not None and len(values) != len(response_ids):
            raise ValueError(
                f"has {len(values)} entries but response_ids has {len(response_ids)}; "
                "they must match one per response token"
            )
        return values


class StepBatch(WireModel):
    """Body of `POST /v1/steps`: a batch is accepted or rejected whole."""

    steps: Annotated[list[Step], Field(min_length=1, max_length=MAX_STEPS_PER_REQUEST)]


class StepTarget(WireModel):
    """Feedback addressed to one step."""

    step_key: StepKey


class TrajectoryTarget(WireModel):
    """Feedback addressed to a whole trajectory."""

    trajectory_uid: Uid


class Feedback(WireModel):
    """A reward or a piece of human feedback: a fact about a step or a trajectory."""

    target: StepTarget | TrajectoryTarget
    kind: FeedbackKind
    value: JsonValue = Field(description="number for reward/rating, string for label/comment")
    source: Label = Field(description="who produced it: rule, model, human, env, judge, ...")
    annotator: ShortText | None = None
    judge: Uid | None = Field(
        None,
        description="the reward function or verifier that produced it (a versioned judge's "
        "rewards resolve only for specs that choose it, never by the default rule)",
    )
    judge_version: Uid | None = Field(None, description="the judge's version")
    created_at: datetime | None = Field(None, description="when the feedback was given")
    metadata: Metadata = Field(default_factory=dict)
    event_id: Uid | None = None

    _check_metadata = field_validator("metadata")(check_json_object)

    @field_validator("value")
    @classmethod
    def _value_fits_kind(cls, value: Any, info: ValidationInfo) -> Any:
        kind = info.data.get("kind")
        if kind in ("reward", "rating"):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"a {kind} must be a number")
            if not math.isfinite(value):
                raise ValueError(f"a {kind} must be finite")
            return float(value)
        if kind in ("label", "comment") and not isinstance(value, str):
            raise ValueError(f"a {kind} must be a string")
        if kind == "label" and not 0 < len(value) <= MAX_LABEL_CHARS:
            raise ValueError(f"a label must have 1 to {MAX_LABEL_CHARS} characters")
        if kind == "comment" and len(value) > MAX_TEXT_CHARS:
            raise ValueError(f"a comment must have at most {MAX_TEXT_CHARS} characters")
        if kind == "correction" and not isinstance(value, str | dict):
            raise ValueError("a correction must be a string or an object")
        if isinstance(value, dict | list):
            check_json_object({"value": value})
        return value


class Event(WireModel):
    """A live interaction event from a black-box service (session started, user edit, ...)."""

    type: Label
    trajectory_uid: Uid | None = None
    payload: Metadata = Field(default_factory=dict)
    occurred_at: datetime | None = None
    event_id: Uid | None = None

    _check_payload = field_validator("payload")(check_json_object)


class TrajectoryCompletion(WireModel):
    """Body of `POST /v1/trajectories/{trajectory_uid}/complete`."""

    reward: FiniteFloat | None = None
    status: TrajectoryEnd = "complete"
    metadata: Metadata = Field(default_factory=dict)
    event_id: Uid | None = None

    _check_metadata = field_validator("metadata")(check_json_object)


class TrajectoryCompleted(TrajectoryCompletion):
    """The stored form of a completion: the body plus the trajectory it closes."""

    trajectory_uid: Uid


class ClawR1Step(Step):
    """A step as Claw-R1 agents submit it; unknown fields are kept, not refused."""

    model_config = ConfigDict(extra="allow")


class SubmitStepsRequest(BaseModel):
    """Body of the Claw-R1 `POST /submit_steps` route."""

    model_config = ConfigDict(extra="allow")

    steps: Annotated[list[ClawR1Step], Field(min_length=1, max_length=MAX_STEPS_PER_REQUEST)]


class Accepted(BaseModel):
    """Answer to an accepted write: the records are durable when this is sent."""

    accepted: int = Field(description="records in the request")
    duplicates: int = Field(0, description="records already stored under the same event_id")
    event_ids: list[str]


class ErrorDetail(BaseModel):
    """The inside of the OpenAI error envelope."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI error envelope: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail
