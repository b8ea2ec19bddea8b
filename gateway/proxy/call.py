"""One proxied call as the proxy sees it (`ProxyCall`), its parsing, and what a stream relay
needs of whoever records it (`CallRecorder`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import pydantic_core

from gateway.errors import ApiError
from gateway.proxy.capture import COMPLETION_KIND, CapturedChoice, Endpoint
from gateway.proxy.failures import UpstreamFailure
from gateway.proxy.scope import Scope
from gateway.proxy.steps import CallSteps, StepPlace
from gateway.records import BronzeRecord

if TYPE_CHECKING:
    from gateway.proxy.dialects.base import DialectCall
    from gateway.proxy.token_in_plan import TokenInPlan


@dataclass(slots=True)
class ProxyCall:
    """One proxied request: the client's body, its scope and who sent it."""

    endpoint: Endpoint
    body: dict[str, Any]
    request_json: bytes  # the client's body as stored for audit
    scope: Scope
    tenant: str
    idempotency_key: str | None
    received: float  # perf_counter when the gateway got the call
    # the policy versions in force when the call went upstream (set at dispatch): its steps
    # carry these, however long the answer or stream takes and whatever is published meanwhile
    published_at_dispatch: int | None = None
    registered_at_dispatch: tuple[int | None, dict[str, Any]] = (None, {})
    token_in: Literal["off", "auto", "on"] | None = None  # X-Claw-Token-In (None: the default)
    token_in_plan: TokenInPlan | None = None  # when token-in records this call's turns
    client_retry: int = 0  # the client's retry count (OpenAI SDKs: x-stainless-retry-count)
    # a call in another protocol (Responses, Messages): `body` is its chat translation, and
    # `audit_json` the client's own body, kept as the step's request
    dialect: DialectCall | None = None
    audit_json: bytes | None = None
    routing_key: str | None = None  # what keeps the call on its trajectory's replica
    replica: dict[str, Any] | None = None  # which replica served it (and moves), for the step
    can_move: bool = False  # another replica is left to try should this one be unreachable

    @property
    def stream(self) -> bool:
        """Whether the client asked for server-sent events."""
        return self.body.get("stream") is True

    @property
    def n(self) -> int:
        """Choices per prompt."""
        n = self.body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1

    @property
    def prompts(self) -> int:
        """Prompts in the call (a legacy completion may batch several)."""
        prompt = self.body.get("prompt")
        if self.endpoint.kind == COMPLETION_KIND and isinstance(prompt, list) and prompt:
            return 1 if isinstance(prompt[0], int) else len(prompt)
        return 1

    def event_details(self) -> dict[str, Any]:
        """What an upstream_error event says about the call."""
        return {
            "endpoint": self.endpoint.path,
            "model": self.body.get("model"),
            "stream": self.stream,
            "prompt_uid": self.scope.prompt_uid,
        } | ({"replica": self.replica["url"]} if self.replica else {})


def parse_request(raw: bytes) -> tuple[dict[str, Any], bytes]:
    """The client's JSON object (400 otherwise), and its bytes as stored for audit."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError as exc:
        raise ApiError(400, f"body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body must be a JSON object", code="invalid_json")
    compact = raw.strip()
    if not compact.startswith(b"{"):  # e.g. a BOM or UTF-16: store it re-encoded as UTF-8
        compact = pydantic_core.to_json(body)
    return body, compact


class CallRecorder(Protocol):
    """What records a call's steps (gateway.proxy.service.ProxyService)."""

    def call_steps(
        self,
        call: ProxyCall,
        captured: list[CapturedChoice],
        model: str | None,
        upstream_ms: float | None,
        usage: Any = None,
        places: list[StepPlace] | None = None,
    ) -> CallSteps:
        """The call's step records (and events of choices without ids)."""

    def failure_record(
        self, failure: UpstreamFailure, tenant: str, call: ProxyCall | None
    ) -> BronzeRecord:
        """The `upstream_error` event of a failed call."""

    async def land_steps(
        self, call: ProxyCall, steps: CallSteps, also: list[BronzeRecord] | None = None
    ) -> bool:
        """Make a call's step records (and `also`) durable; False when the gateway could not."""
