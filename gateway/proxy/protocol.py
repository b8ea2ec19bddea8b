"""Protocol models of the proxy: OpenAI bodies (for the OpenAPI schema only; the proxy passes
bodies on as sent) and the Claw-R1 trajectory routes' bodies and answers."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from claw_pipelines.contracts.wire import (
    Count,
    TrajectoryCompletion,
    Uid,
    check_json_object,
)


class _Open(BaseModel):
    """Unknown fields are kept: agents and upstreams add their own."""

    model_config = ConfigDict(extra="allow")


class ChatCompletionBody(_Open):
    """An OpenAI chat completion request; every field goes upstream untouched."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool = False
    n: int = 1
    tools: list[dict[str, Any]] | None = None
    logprobs: bool | None = None
    return_token_ids: bool | None = Field(None, description="vLLM: also return token ids")


class CompletionBody(_Open):
    """An OpenAI legacy completion request; every field goes upstream untouched."""

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    n: int = 1
    logprobs: int | None = None


class ResponsesBody(_Open):
    """An OpenAI Responses API request, translated to a chat completion upstream."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False
    max_output_tokens: int | None = None


class MessagesBody(_Open):
    """An Anthropic Messages API request, translated to a chat completion upstream."""

    model: str
    max_tokens: int
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    stream: bool = False


class TrajectoryMetadata(_Open):
    """Trajectory metadata; `policy_version` applies to the trajectory's later steps."""

    policy_version: Count | None = None


def _bounded_metadata(value: TrajectoryMetadata) -> TrajectoryMetadata:
    check_json_object(value.model_dump())
    return value


class InitTrajectory(_Open):
    """Body of `POST /init_trajectory` (all optional: uids are made up when absent)."""

    trajectory_uid: Uid | None = None
    prompt_uid: Uid | None = None
    metadata: TrajectoryMetadata = Field(default_factory=TrajectoryMetadata)

    _bounded = field_validator("metadata")(_bounded_metadata)


class TrajectoryInitialized(BaseModel):
    """Answer of `POST /init_trajectory`: the agent's new OpenAI base URL."""

    trajectory_uid: str
    prompt_uid: str
    base_url: str


class RegisterTrajectory(_Open):
    """Body of `POST /{trajectory_uid}/{prompt_uid}/v1/register_trajectory`."""

    metadata: TrajectoryMetadata = Field(default_factory=TrajectoryMetadata)

    _bounded = field_validator("metadata")(_bounded_metadata)


class TrajectoryRegistered(BaseModel):
    """Answer of `register_trajectory`."""

    trajectory_uid: str
    prompt_uid: str
    policy_version: int | None


class CompleteTrajectory(TrajectoryCompletion):
    """Body of `POST /{trajectory_uid}/{prompt_uid}/v1/complete_trajectory`: a completion
    (reward, status, metadata, event_id); unknown Claw-R1 fields are kept, not refused."""

    model_config = ConfigDict(extra="allow")
