"""The proxy as a serving object (no FastAPI): forward a call upstream, answer the client as
the upstream did, and record one step per choice.

Durability: a non-streamed answer is sent once its steps are in the write-ahead log; a
streamed answer's closing `data: [DONE]` likewise. Calls are refused up front (503) when the
gateway cannot record; should recording still fail after the upstream answered, the answer
is sent anyway, marked `X-Claw-Recorded: false` (and logged and counted).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, NoReturn

import pydantic_core
from prometheus_client import CollectorRegistry, Counter, Histogram

from claw_pipelines.contracts.ids import new_event_id
from claw_pipelines.settings import ClawSettings
from claw_pipelines.tokenization import ChatTokenizer
from gateway.asgi import JSON, Answer
from gateway.errors import ApiError
from gateway.landing import Landing, Overloaded
from gateway.metrics import LATENCY_BUCKETS, labelled
from gateway.numbering import RecordedSteps, turns_shown
from gateway.proxy.call import ProxyCall
from gateway.proxy.capture import (
    COMPLETIONS,
    Added,
    CapturedChoice,
    Uncapturable,
    augment,
    captured_choices,
    step_tokens,
    stripped,
    verified,
)
from gateway.proxy.capture_mode import CaptureMode
from gateway.proxy.chat_from_tokens import chat_chunks
from gateway.proxy.dialects import DialectCall, Responses, open_messages
from gateway.proxy.dialects.response_store import ResponseStore, reply_message
from gateway.proxy.proxied_calls import ProxiedCalls
from gateway.proxy.relay import StreamRelay
from gateway.proxy.replicas import Replica, Replicas, routing_key
from gateway.proxy.scope import Scope, TrajectoryBook
from gateway.proxy.steps import (
    CallSteps,
    StepPlace,
    step_keys,
    step_record,
    uncaptured_record,
    upstream_error_record,
)
from gateway.proxy.token_in import TokenIn
from gateway.proxy.token_in_plan import TokenInPlan
from gateway.proxy.upstream import (
    Upstream,
    UpstreamFailure,
    UpstreamReply,
    failure_of_status,
    openai_error_body,
    upstream_message,
)
from gateway.records import BronzeRecord, event_ids

log = logging.getLogger(__name__)
_COMPACT = {"ensure_ascii": False, "separators": (",", ":")}
_PASSED_HEADERS = ("retry-after", "x-request-id")  # of an upstream refusal


class ProxyService:
    """Forwards OpenAI calls to the upstream and records what it sampled."""

    def __init__(
        self,
        settings: ClawSettings,
        landing: Landing,
        upstream: Replicas | None,
        registry: CollectorRegistry | None = None,
        capture: CaptureMode | None = None,
        recorded: RecordedSteps | None = None,
    ) -> None:
        self.settings = settings
        self.landing = landing
        self.upstream = upstream
        self.capture = capture or CaptureMode(settings.tokenizer)
        self.book = TrajectoryBook(recorded=recorded)
        self.token_in = TokenIn(settings, landing, self.book, self.capture)
        self.responses = Responses(ResponseStore(settings.resolved_wal_dir, landing.lake))
        self.proxied_calls = ProxiedCalls()  # a traced span of one joins its step
        self._overloaded_until = 0.0
        self.failures = Counter(
            "claw_gateway_upstream_failures",
            "Upstream calls that failed, by code",
            ["code"],
            registry=registry,
        )
        self.upstream_seconds = Histogram(
            "claw_gateway_upstream_seconds",
            "Latency of non-streamed upstream calls",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.steps = Counter(
            "claw_gateway_proxy_steps",
            "Steps recorded from proxied calls, by token source",
            ["token_source"],
            registry=registry,
        )
        self.unrecorded = Counter(
            "claw_gateway_proxy_unrecorded",
            "Proxied answers sent although their records could not be stored",
            registry=registry,
        )
        self.uncaptured = Counter(
            "claw_gateway_proxy_uncaptured",
            "Choices answered without token ids that could not be tokenized here (events)",
            registry=registry,
        )

    # -- admission and failures -------------------------------------------------------------
    def admit(self, recording: bool = True) -> Replicas:
        """The upstream replicas, if configured and (for recorded calls) the gateway can record.

        Refusing up front (503) wastes no inference: after the landing reported overload,
        calls are refused for its Retry-After."""
        if self.upstream is None:
            raise ApiError(
                503, "no upstream configured: set CLAW_UPSTREAM_URL", code="upstream_not_configured"
            )
        if recording:
            busy = None
            if not self.landing.ready:
                busy = "the gateway is starting or stopping"
            elif time.monotonic() < self._overloaded_until:
                busy = (
                    "the gateway cannot record right now (write-ahead log backlog); retry shortly"
                )
            if busy is not None:
                raise ApiError(503, busy, code="overloaded", headers={"Retry-After": "2"})
        return self.upstream

    def failure_record(
        self, failure: UpstreamFailure, tenant: str, call: ProxyCall | None
    ) -> BronzeRecord:
        """The `upstream_error` event of a failed call (counted and logged)."""
        self.failures.labels(failure.code).inc()
        log.warning("upstream failure (%s -> %d): %s", failure.code, failure.status, failure)
        trajectory = call.scope.trajectory_uid if call else None
        details = call.event_details() if call else {}
        return upstream_error_record(failure, tenant, trajectory, details)

    async def fail(self, failure: UpstreamFailure, tenant: str, call: ProxyCall | None) -> NoReturn:
        """Record an upstream failure as an event, then answer it in the OpenAI envelope."""
        await self.land([self.failure_record(failure, tenant, call)])
        raise ApiError(failure.status, failure.message, code=failure.code)

    async def land(self, records: list[BronzeRecord]) -> bool:
        """Make records durable; False (logged, counted) when the gateway could not."""
        try:
            await self.landing.land(records)
        except Overloaded as exc:
            self._overloaded_until = time.monotonic() + exc.retry_after
            self.unrecorded.inc()
            log.warning("proxied call not recorded (%d records): %s", len(records), exc)
            return False
        return True

    # -- calls ------------------------------------------------------------------------------
    async def translate(
        self,
        protocol: str,
        body: dict[str, Any],
        scope: Scope,
        headers: Mapping[str, str],
        tenant: str,
    ) -> DialectCall:
        """A call in another protocol (`responses`, `messages`) as a chat completion; a
        Responses call continuing an earlier response (of its own tenant) joins its
        trajectory, after its step."""
        if protocol == "messages":
            return open_messages(body, headers, scope)
        translated = await self.responses.open(body, scope, tenant)
        if translated.previous is not None and translated.scope.via == "previous_response":
            previous = translated.previous
            self.book.ensure_next(previous.trajectory_uid, previous.step_index + 1)
        return translated

    async def models(self, tenant: str) -> Answer:
        """The upstream's model list, passed through."""
        upstream = self.admit(recording=False).route(None)[0].upstream
        try:
            reply = await upstream.get("/models")
        except UpstreamFailure as failure:
            await self.fail(failure, tenant, None)
        if reply.status >= 500:
            await self.fail(failure_of_status(reply.status, reply.body), tenant, None)
        return Answer(reply.status, reply.body, reply.content_type or JSON)

    async def complete(self, call: ProxyCall) -> Answer | StreamRelay:
        """Forward a (chat) completion to its replica; record its choices; answer as the
        upstream did. A replica that cannot be reached is skipped and the call (and its
        trajectory) moves to another, recorded on the step (`metadata.replica`)."""
        replicas = self.admit()
        if len(replicas) == 1:
            return await self._complete_on(call, replicas.replicas[0].upstream)
        key = routing_key(call.scope.trajectory_uid, call.body)
        tried: tuple[Replica, ...] = ()
        while True:
            replica, moved_from = replicas.route(key, tried)
            call.replica = {"url": replica.url}
            if moved_from is not None:
                call.replica["moved_from"] = moved_from.url
            call.can_move = len(tried) + 1 < len(replicas)
            replica.in_flight += 1
            try:
                answer = await self._complete_on(call, replica.upstream)
            except ReplicaFailed as failed:
                replica.release()
                replicas.failed(replica, failed.failure.message)
                tried += (replica,)
                continue
            except BaseException:
                replica.release()
                raise
            replicas.succeeded(replica)
            if isinstance(answer, StreamRelay):
                answer.on_close = replica.release
                answer.on_failure = lambda failure, r=replica: replicas.failed(r, failure.message)
            else:
                replica.release()
            return answer

    async def _upstream_failed(self, failure: UpstreamFailure, call: ProxyCall) -> NoReturn:
        """A failed upstream call: recorded as an event, then moved to another replica when
        the replica could not be reached and another is left, else answered as an error."""
        if call.can_move and failure.status == 502:
            await self.land([self.failure_record(failure, call.tenant, call)])
            raise ReplicaFailed(failure)
        await self.fail(failure, call.tenant, call)

    async def _complete_on(self, call: ProxyCall, upstream: Upstream) -> Answer | StreamRelay:
        """Forward a call to one upstream replica."""
        call.token_in_plan = plan = await self.token_in.plan(call, upstream.returns_token_ids())
        if plan is not None and not plan.via_chat:
            answer = await self._complete_token_in(call, upstream, plan)
            if answer is not None:
                return answer
            call.token_in_plan = None  # the upstream refused token ids: the call goes as it came
        path, kind = call.endpoint.path, call.endpoint.kind
        ask_token_ids = upstream.returns_token_ids(call.stream)
        self.stamp_dispatch(call)
        try:
            while True:
                body, added = augment(call.request_json, call.body, kind, ask_token_ids)
                started = time.perf_counter()
                if call.stream:
                    response = await upstream.open_stream(path, body)
                    if response.status < 400 and _is_event_stream(response.headers):
                        places = self._places(call, range(call.n * call.prompts))
                        return StreamRelay(self, call, response, added, places)
                    reply = await UpstreamReply.read(response)
                else:
                    reply = await upstream.post(path, body)
                if not (added.token_ids and _refuses_token_ids(reply.status, reply.body)):
                    break
                self._token_ids_unsupported(upstream, call.stream)
                ask_token_ids = False
        except UpstreamFailure as failure:
            await self._upstream_failed(failure, call)
        if reply.status >= 400:
            return await self._refused(reply, call)
        seconds = time.perf_counter() - started
        labelled(self.upstream_seconds, kind).observe(seconds)
        return await self._answer(call, reply, added, seconds)

    async def _answer(
        self, call: ProxyCall, reply: UpstreamReply, added: Added, upstream_s: float
    ) -> Answer:
        """Record the choices of a whole answer, then pass it on minus what we added (with
        a Server-Timing header: the upstream's time and the gateway's own)."""
        try:
            answer = pydantic_core.from_json(reply.body)
            view = stripped(answer, added)
            captured = captured_choices(answer, view, call.endpoint.kind)
        except (ValueError, AttributeError, TypeError):
            failure = UpstreamFailure(502, "upstream_error", "upstream answered invalid JSON")
            await self.fail(failure, call.tenant, call)
        upstream_ms = upstream_s * 1000
        body = reply.body if view is answer else pydantic_core.to_json(view)
        if call.dialect is not None:
            body = pydantic_core.to_json(self._dialect_answer(call, view, captured))
        steps = self.call_steps(
            call, captured, answer.get("model"), round(upstream_ms, 2), answer.get("usage")
        )
        headers = {"X-Claw-Step-Keys": step_keys(steps.places)}
        if not await self.land_steps(call, steps):
            headers["X-Claw-Recorded"] = "false"
        headers["Server-Timing"] = server_timing(call.received, upstream_ms)
        return Answer(reply.status, body, reply.content_type or JSON, headers)

    async def _complete_token_in(
        self, call: ProxyCall, upstream: Upstream, plan: TokenInPlan
    ) -> Answer | None:
        """A chat call sent upstream as the trajectory's token ids, answered as chat once its
        steps are durable (a stream as one burst); None when the upstream refuses token ids
        and the call's mode lets it go upstream as it came."""
        self.stamp_dispatch(call)
        started = time.perf_counter()
        try:
            reply = await upstream.post(COMPLETIONS.path, plan.body)
        except UpstreamFailure as failure:
            await self._upstream_failed(failure, call)
        if _refuses_token_ids(reply.status, reply.body):
            self._token_ids_unsupported(upstream, stream=False)
            if self.token_in.mode_of(call) == "auto":
                return None
        if reply.status >= 400:
            return await self._refused(reply, call)
        upstream_ms = (time.perf_counter() - started) * 1000
        labelled(self.upstream_seconds, COMPLETIONS.kind).observe(upstream_ms / 1000)
        try:
            chat, captured = self.token_in.chat_answer(plan, pydantic_core.from_json(reply.body))
        except (ValueError, AttributeError, TypeError) as exc:
            failure = UpstreamFailure(502, "upstream_error", f"upstream answer unusable: {exc}")
            await self.fail(failure, call.tenant, call)
        translated = None
        if call.dialect is not None:
            translated = self._dialect_answer(call, chat, captured)
        steps = self.call_steps(
            call, captured, chat.get("model"), round(upstream_ms, 2), chat.get("usage")
        )
        headers = {"X-Claw-Step-Keys": step_keys(steps.places)}
        if not await self.land_steps(call, steps):
            headers["X-Claw-Recorded"] = "false"
        if call.stream:
            options = call.body.get("stream_options")
            usage = isinstance(options, dict) and options.get("include_usage") is True
            if call.dialect is not None:
                body = call.dialect.burst(chat)
            else:
                body = chat_chunks(chat, usage)
            content_type = "text/event-stream"
            headers["Cache-Control"] = "no-cache"
        else:
            body, content_type = pydantic_core.to_json(translated or chat), JSON
        headers["Server-Timing"] = server_timing(call.received, upstream_ms)
        return Answer(200, body, content_type, headers)

    async def _refused(self, reply: UpstreamReply, call: ProxyCall) -> Answer:
        """An upstream 4xx goes back with its status and Retry-After, in the OpenAI envelope
        (an OpenAI-shaped body unchanged; any other, e.g. FastAPI's `detail`, plain text or
        HTML, rewrapped with its message); a 5xx becomes a recorded 502."""
        if reply.status >= 500:
            await self.fail(failure_of_status(reply.status, reply.body), call.tenant, call)
        headers = {k: v for k, v in reply.headers.items() if k in _PASSED_HEADERS}
        if call.dialect is not None:
            message = f"upstream answered {reply.status}: {upstream_message(reply.body)}"
            return Answer(
                reply.status, call.dialect.error_body(reply.status, message), JSON, headers
            )
        body = openai_error_body(reply.status, reply.body)
        if body is None:
            return Answer(reply.status, reply.body, reply.content_type or JSON, headers)
        return Answer(reply.status, body, JSON, headers)

    def stamp_dispatch(self, call: ProxyCall) -> None:
        """Fix the policy versions in force now, as the call goes upstream: the published one
        and the trajectory's registered one (a step is attributed at dispatch, not answer)."""
        call.published_at_dispatch = self.landing.policy_version
        if call.scope.trajectory_uid is not None:
            version, metadata = self.book.registered(call.scope.trajectory_uid)
            call.registered_at_dispatch = (version, dict(metadata))

    def _token_ids_unsupported(self, upstream: Upstream, stream: bool) -> None:
        if upstream.returns_token_ids(stream):
            where = "streamed calls" if stream else "calls"
            log.warning(
                "upstream %s refuses return_token_ids on %s: %s",
                upstream.base_url,
                where,
                "tokenizing locally" if self.capture.tokenizer_setting else "no tokenizer set",
            )
        upstream.refuses_token_ids(stream)

    # -- records ----------------------------------------------------------------------------
    async def land_steps(
        self, call: ProxyCall, steps: CallSteps, also: list[BronzeRecord] | None = None
    ) -> bool:
        """Make a call's step records (its uncaptured events, and `also`, e.g. its failure
        event) durable; then token-in keeps their turns. False (logged, counted) when the
        gateway could not."""
        if not await self.land([*steps.records, *steps.uncaptured, *(also or ())]):
            return False
        for choice, place in zip(steps.captured, steps.places, strict=False):
            key = f"{place.trajectory_uid}:{place.step_index}"
            self.proxied_calls.add(call.tenant, choice.response.get("id"), key)
        if call.token_in_plan is not None:
            self.token_in.remember(call.token_in_plan, steps.captured, steps.records, steps.places)
        if call.dialect is not None:
            for choice, place in zip(steps.captured, steps.places, strict=False):
                reply = reply_message(choice.output)
                call.dialect.remember(place.trajectory_uid, place.step_index, reply)
        return True

    def _dialect_answer(
        self, call: ProxyCall, chat: dict[str, Any], captured: list[CapturedChoice]
    ) -> dict[str, Any]:
        """The client's answer in its protocol, also kept as each step's response."""
        assert call.dialect is not None
        translated = call.dialect.answer(chat)
        for choice in captured:
            choice.response = translated
        return translated

    def call_steps(
        self,
        call: ProxyCall,
        captured: list[CapturedChoice],
        model: str | None,
        upstream_ms: float | None,
        usage: Any = None,
        places: list[StepPlace] | None = None,
    ) -> CallSteps:
        """One step record per choice with token ids (the upstream's, else computed here and
        checked against `usage`), placed in the call's trajectory (or new ones; `places`:
        assigned when a stream opened, by choice index); an `uncaptured_call` event for a
        choice whose ids could not be had."""
        scope, kind = call.scope, call.endpoint.kind
        if not isinstance(model, str):
            requested = call.body.get("model")
            model = requested if isinstance(requested, str) else None
        kept, tokens, uncaptured = [], [], []
        for choice in captured:
            try:
                tokens.append(
                    step_tokens(
                        choice, call.body, kind, choice.index // call.n, self.local_tokenizer
                    )
                )
                kept.append(choice)
            except Uncapturable as exc:
                self.uncaptured.inc()
                log.warning("choice %d of a call not recorded as a step: %s", choice.index, exc)
                uncaptured.append(
                    uncaptured_record(choice, call.tenant, scope.trajectory_uid, str(exc), model)
                )
        tokens = verified(tokens, [c.index // call.n for c in kept], usage)
        named = self._tokenizer_named() if kept else {}
        if places is None:
            places = self._places(call, [c.index for c in kept])
        else:
            places = [
                places[c.index] if c.index < len(places) else self._places(call, [c.index])[0]
                for c in kept
            ]
        registered = dict(call.registered_at_dispatch[1]) if scope.trajectory_uid else {}
        if places and places[0].stamped:
            registered["policy_version_via"] = "published"
        ids = event_ids(len(kept), call.idempotency_key)
        records = []
        plan = call.token_in_plan
        for choice, place, event_id, step in zip(kept, places, ids, tokens, strict=True):
            if plan is not None and choice.metadata is None:  # a token-in root, via chat
                choice.metadata = {"token_in": plan.metadata({"role": "assistant"} | choice.output)}
            metadata = (
                registered
                | (choice.metadata or {})
                | (step.metadata or {})
                | named
                | {
                    "scoped": scope.trajectory_uid is not None,
                    "scope_via": scope.via,
                    "prompt_group_via": "client" if scope.prompt_uid is not None else "gateway",
                    "choice_index": choice.index,
                    "stream": call.stream,
                    "response_id": choice.response.get("id"),
                    "upstream_ms": upstream_ms,
                }
            )
            if step.rollout_log_probs is None:
                metadata["log_probs"] = False  # the upstream gave none for this step
            if call.client_retry:
                metadata["client_retry"] = call.client_retry
            extra = None
            if call.dialect is not None:
                metadata |= call.dialect.metadata()
                extra = call.dialect.record_extra(reply_message(choice.output))
            if call.replica is not None:
                metadata["replica"] = call.replica
            records.append(
                step_record(
                    event_id=event_id,
                    kind=kind,
                    tenant=call.tenant,
                    place=place,
                    model=model,
                    metadata=metadata,
                    request_json=call.audit_json or call.request_json,
                    choice=choice,
                    tokens=step,
                    extra=extra,
                )
            )
            labelled(self.steps, step.token_source).inc()
        return CallSteps(kept, records, places, uncaptured)

    def local_tokenizer(self) -> ChatTokenizer | None:
        """The model's chat tokenizer when the gateway has one (loaded on first use)."""
        return self.capture.tokenizer

    def _tokenizer_named(self) -> dict[str, Any]:
        """What a step's metadata says of the tokenizer its ids belong to (the model's, as
        configured, or the simulated model's own); nothing when the gateway has none."""
        tokenizer = self.capture.tokenizer
        if tokenizer is None:
            return {}
        return {"tokenizer": {"name": tokenizer.name, "fingerprint": tokenizer.fingerprint}}

    def _places(self, call: ProxyCall, indices) -> list[StepPlace]:
        """Where the choices with these indices go. Scoped: consecutive indices in the
        trajectory, one per choice (`choice_index` in metadata says which), after every
        index this process gave, the WAL and bronze held at start, or the call's history
        shows (gateway.numbering). Unscoped: each choice starts its own trajectory at index
        0, and the choices of one prompt share a prompt group (GRPO-style)."""
        indices = list(indices)
        scope = call.scope
        published = call.published_at_dispatch  # when neither the agent nor its scope says
        if scope.trajectory_uid is not None:
            shown = turns_shown(call.body)
            first = self.book.claim_steps(scope.trajectory_uid, len(indices), shown)
            version = call.registered_at_dispatch[0]
            if scope.policy_version is not None:
                version = scope.policy_version
            stamped = version is None and published is not None
            if stamped:
                version = published
            return [
                StepPlace(scope.trajectory_uid, first + i, scope.prompt_uid, version, stamped)
                for i in range(len(indices))
            ]
        groups: dict[int, str] = {}
        places = []
        version, stamped = scope.policy_version, False
        if version is None and published is not None:
            version, stamped = published, True
        for index in indices:
            group = scope.prompt_uid
            if group is None:
                group = groups.setdefault(index // call.n, new_event_id())
            places.append(StepPlace(new_event_id(), 0, group, version, stamped))
        return places


class ReplicaFailed(Exception):
    """A replica could not be reached; the call goes to another."""

    def __init__(self, failure: UpstreamFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def server_timing(received: float, upstream_ms: float) -> str:
    """`Server-Timing` of an answer: the upstream's time, and the gateway's own (the rest,
    from receiving the call until its answer was durable and ready to send), in ms."""
    total_ms = (time.perf_counter() - received) * 1000
    return f"upstream;dur={upstream_ms:.3f}, gateway;dur={max(0.0, total_ms - upstream_ms):.3f}"


def _refuses_token_ids(status: int, body: bytes) -> bool:
    return status in (400, 422) and b"return_token_ids" in body


def _is_event_stream(headers: dict[str, str]) -> bool:
    # An upstream that ignores `stream` answers JSON: handled like a non-streamed answer.
    return headers.get("content-type", "text/event-stream").startswith("text/event-stream")
