"""Token-in: a scoped chat trajectory's next prompt is the exact ids of its turns so far (what
the model saw and sampled) plus only the new messages rendered with the model's template; the
upstream is called with those ids (`/completions`, a token-id prompt) and the agent answered in
the chat format it asked for.

Modes (`CLAW_TOKEN_IN`, or per call the `X-Claw-Token-In` header): `off`; `auto`, token-in
for scoped chat calls it can translate when the upstream returns token ids; `on`, the same,
and a scoped chat call it cannot translate is refused (400 naming the field).

Each step records `metadata.token_in`: `mode` (`start`: the trajectory's first turn;
`extend`: continues its newest step; `fork`: its history no longer matches the newest step,
so it continues an earlier one, `parent_step`, or none: a new branch from the start),
`parent_step`, `history` (the key of the conversation up to this reply), `new_tokens`, and
`sent_as`: `ids` (spliced onto the parent's exact ids) or `text` (the upstream rendered the
messages: a first turn, or a turn whose history matches no recorded turn, as when an agent
compacts its context by summarizing or trimming earlier turns; silver then says why the turn
starts a new fragment of the trajectory, docs/DESIGN.md §13). Only a recorded turn's exact
conversation and reply are ever continued, so a rewritten history is never spliced onto ids
it no longer holds.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from functools import cached_property
from typing import Any, Literal

import numpy as np
import pydantic_core

from claw_pipelines.settings import ClawSettings
from claw_pipelines.tokenization import ChatTokenizer
from gateway.errors import ApiError
from gateway.landing import Landing
from gateway.proxy.call import ProxyCall
from gateway.proxy.capture import CHAT_KIND, CapturedChoice, choice_index
from gateway.proxy.capture_mode import CaptureMode
from gateway.proxy.chat_from_tokens import chat_logprobs, reply_message
from gateway.proxy.scope import TrajectoryBook
from gateway.proxy.steps import StepPlace
from gateway.proxy.token_history import (
    TokenHistory,
    Turn,
    conversation_chain,
    restore_trajectory,
)
from gateway.proxy.token_in_plan import TokenInPlan
from gateway.records import BronzeRecord

TOKEN_IN_HEADER = "x-claw-token-in"
TokenInMode = Literal["off", "auto", "on"]
MODES: tuple[TokenInMode, ...] = ("off", "auto", "on")
# the chat request's fields a token-id completion carries differently, or not at all
_CHAT_ONLY = (
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "return_token_ids",
)
# fields that change what a chat call means beyond its rendered prompt
_UNTRANSLATABLE = (
    "response_format",
    "functions",
    "function_call",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_generation_prompt",
    "echo",
    "audio",
    "modalities",
    "prediction",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)


def header_mode(value: str | None) -> TokenInMode | None:
    """The mode an `X-Claw-Token-In` header asks for (422 naming the header otherwise)."""
    if value is None:
        return None
    mode = value.strip().lower()
    if mode not in MODES:
        raise ApiError(
            422,
            "X-Claw-Token-In: must be one of on, off, auto",
            param="X-Claw-Token-In",
            code="invalid_header",
        )
    return mode  # type: ignore[return-value]


def untranslatable(body: dict[str, Any]) -> tuple[str, str] | None:
    """The field (and why) that keeps a chat call from going upstream as token ids."""
    for name in _UNTRANSLATABLE:
        if body.get(name) is not None:
            return name, f"{name} cannot be sent as a token-id completion"
    if body.get("tool_choice") not in (None, "auto"):
        return "tool_choice", "only tool_choice auto can be sent as a token-id completion"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "messages", "messages must be a non-empty list"
    for position, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"messages[{position}]", "each message needs a role"
    return None


class TokenIn:
    """Plans token-in calls, turns their answers into chat answers, remembers their turns."""

    def __init__(
        self, settings: ClawSettings, landing: Landing, book: TrajectoryBook, capture: CaptureMode
    ) -> None:
        self.settings = settings
        self.landing = landing
        self.book = book
        self.capture = capture
        self.history = TokenHistory()

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The model's tokenizer and template (loaded once, on first use; plans are made only
        when there is one)."""
        tokenizer = self.capture.tokenizer
        assert tokenizer is not None
        return tokenizer

    @cached_property
    def eos_id(self) -> int:
        """The id of the template's end-of-turn token (-1 when it is not one token)."""
        ids = self.tokenizer.encode(self.tokenizer.eos_token)
        return ids[0] if len(ids) == 1 else -1

    def mode_of(self, call: ProxyCall) -> TokenInMode:
        """The call's mode: its header's, else the gateway's default."""
        return call.token_in or self.settings.token_in

    async def plan(self, call: ProxyCall, upstream_ids: bool) -> TokenInPlan | None:
        """The token-in plan of a call, or None when it goes upstream as it came."""
        mode = self.mode_of(call)
        if mode == "off":
            return None
        asked = call.token_in == "on"
        if call.endpoint.kind != CHAT_KIND or call.scope.trajectory_uid is None:
            if asked:
                raise _refusal(
                    "X-Claw-Token-In", "token-in needs a chat completion scoped to a trajectory"
                )
            return None
        problem = untranslatable(call.body)
        if problem is None and not upstream_ids:
            problem = ("X-Claw-Token-In", "the upstream does not return token ids")
        if problem is None and self.capture.tokenizer_setting is None:
            problem = ("X-Claw-Token-In", "it needs the model's chat template: set CLAW_TOKENIZER")
        if problem is None:
            try:
                return await self._plan(call)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                problem = ("messages", f"cannot render the conversation: {exc}")
        if mode == "on":
            raise _refusal(*problem)
        return None

    async def _plan(self, call: ProxyCall) -> TokenInPlan:
        uid = call.scope.trajectory_uid
        assert uid is not None
        body = call.body
        messages, tools = body["messages"], body.get("tools")
        tokens = self.history.get(uid)
        if tokens is None and any(m.get("role") == "assistant" for m in messages):
            tokens = await self._restore(uid)
        chain = conversation_chain(messages, tools)
        parent: Turn | None = None
        matched = 0
        if tokens is not None:
            for k in range(len(messages), 0, -1):
                if messages[k - 1].get("role") == "assistant" and chain[k - 1] in tokens.turns:
                    parent, matched = tokens.turns[chain[k - 1]], k
                    break
        continued = None
        if parent is not None:
            continued = self._continued(parent, messages[:matched], tools, messages)
        if continued is None:  # a new root: the upstream renders it, as without token-in
            mode = "start" if tokens is None or not tokens.turns else "fork"
            return TokenInPlan(uid, tools, chain, mode, None, via_chat=True)
        assert parent is not None and tokens is not None
        ids, new_tokens = continued
        logprobs_top = None
        if body.get("logprobs") is True:
            top = body.get("top_logprobs")
            logprobs_top = top if isinstance(top, int) and not isinstance(top, bool) else 0
        return TokenInPlan(
            trajectory_uid=uid,
            tools=tools,
            chain=chain,
            mode="extend" if parent.step_index == tokens.last_step else "fork",
            parent_step=parent.step_index,
            via_chat=False,
            prompt_ids=ids,
            new_tokens=new_tokens,
            body=upstream_body(body, ids, logprobs_top),
            logprobs_top=logprobs_top,
            token_ids=body.get("return_token_ids") is True,
        )

    def _continued(
        self, parent: Turn, history: list[dict[str, Any]], tools: Any, messages: list[Any]
    ) -> tuple[np.ndarray, int] | None:
        """The parent's ids plus the new messages' ids (and how many those are); None when the
        template renders the history differently inside the whole conversation (then the
        conversation starts over)."""
        tokenizer = self.tokenizer
        full = tokenizer.render(messages, tools)
        rendered = tokenizer.render(history, tools, generation=False)
        if not full.startswith(rendered):
            return None
        eos = tokenizer.eos_token
        # What the template writes after the reply's end-of-turn token (ChatML: a newline);
        # a reply cut short (no end-of-turn) gets the token the template closes it with.
        tail = rendered[rendered.rfind(eos) + len(eos) :] if eos and eos in rendered else ""
        if not parent.ended and eos:
            tail = eos + tail
        new = np.asarray(tokenizer.encode(tail + full[len(rendered) :]), np.int32)
        return np.concatenate([parent.ids, new]), len(new)

    async def _restore(self, uid: str):
        since = (
            dt.datetime.now(dt.UTC) - dt.timedelta(seconds=self.settings.idle_timeout_s)
        ).date() - dt.timedelta(days=1)
        restored = await asyncio.to_thread(
            restore_trajectory,
            uid,
            self.settings.resolved_wal_dir,
            self.landing.lake,
            since,
            self.eos_id,
        )
        self.book.ensure_next(uid, restored.last_step + 1)
        return self.history.merge(uid, restored)

    # -- answers ----------------------------------------------------------------------------
    def chat_answer(
        self, plan: TokenInPlan, answer: dict[str, Any]
    ) -> tuple[dict[str, Any], list[CapturedChoice]]:
        """The chat answer of a token-id completion, and its choices as steps."""
        envelope = {
            "id": "chatcmpl-" + str(answer.get("id", "")).removeprefix("cmpl-"),
            "object": "chat.completion",
            "created": answer.get("created"),
            "model": answer.get("model"),
        }
        if "system_fingerprint" in answer:
            envelope["system_fingerprint"] = answer["system_fingerprint"]
        choices, captured = [], []
        for position, raw in enumerate(answer.get("choices") or ()):
            response_ids = raw.get("token_ids") if isinstance(raw, dict) else None
            if not isinstance(response_ids, list):
                raise ValueError("the upstream's choice has no token_ids")
            index = choice_index(raw, position)
            message = reply_message(self.tokenizer, response_ids, self.eos_id)
            finish = raw.get("finish_reason")
            if message.get("tool_calls") and finish == "stop":
                finish = "tool_calls"
            logprobs = raw.get("logprobs")
            choice = {
                "index": index,
                "message": message,
                "logprobs": None
                if plan.logprobs_top is None
                else chat_logprobs(logprobs, plan.logprobs_top),
                "finish_reason": finish,
            }
            choices.append(choice | ({"token_ids": response_ids} if plan.token_ids else {}))
            captured.append(
                CapturedChoice(
                    index=index,
                    prompt_ids=plan.prompt_ids,
                    response_ids=response_ids,
                    logprobs=(logprobs or {}).get("token_logprobs")
                    if isinstance(logprobs, dict)
                    else None,
                    finish_reason=finish,
                    output=message,
                    response=envelope | {"choices": [choice]},
                    metadata={"token_in": plan.metadata(message)},
                )
            )
        chat = envelope | {"choices": choices}
        if "usage" in answer:
            chat["usage"] = answer["usage"]
        if plan.token_ids and plan.prompt_ids is not None:
            chat["prompt_token_ids"] = plan.prompt_ids.tolist()
        return chat, captured

    def remember(
        self,
        plan: TokenInPlan,
        captured: list[CapturedChoice],
        records: list[BronzeRecord],
        places: list[StepPlace],
    ) -> None:
        """Keep the turns of durable steps (their ids as recorded) for the next calls."""
        for choice, record, place in zip(captured, records, places, strict=False):
            token_in = (choice.metadata or {}).get("token_in")
            if token_in is None:
                continue
            response = np.frombuffer(record.response_ids or b"", "<i4")
            ids = np.frombuffer((record.prompt_ids or b"") + (record.response_ids or b""), "<i4")
            ended = bool(response.size) and int(response[-1]) == self.eos_id
            turn = Turn(place.step_index, ids, ended)
            self.history.add(plan.trajectory_uid, bytes.fromhex(token_in["history"]), turn)


def upstream_body(body: dict[str, Any], prompt_ids: np.ndarray, logprobs_top: int | None) -> bytes:
    """The token-id completion request of a chat call (its sampling fields kept)."""
    fields = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
    if fields.get("max_tokens") is None:
        fields["max_tokens"] = body.get("max_completion_tokens")
    fields["return_token_ids"] = True
    fields["logprobs"] = logprobs_top or 0
    head = pydantic_core.to_json(fields)
    return head[:-1] + b',"prompt":' + pydantic_core.to_json(prompt_ids.tolist()) + b"}"


def _refusal(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message} (token-in)", param=param, code="token_in_unavailable")
