"""Token capture: ask the upstream for the sampled ids and log-probs, take back out of its
answer what the client did not ask for, and tokenize locally when the upstream cannot say.

Upstream ids follow vLLM's `return_token_ids`: chat answers carry a top-level
`prompt_token_ids` and per-choice `token_ids`; legacy completions carry both per choice.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic_core

from claw_pipelines.tokenization import ChatTokenizer

log = logging.getLogger(__name__)

CHAT_KIND = "chat_completion"
COMPLETION_KIND = "completion"
TERMINAL_FINISHES = ("stop", "tool_calls", "function_call")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A proxied OpenAI endpoint: its bronze record kind and its path under the upstream."""

    kind: str
    path: str


CHAT = Endpoint(CHAT_KIND, "/chat/completions")
COMPLETIONS = Endpoint(COMPLETION_KIND, "/completions")


@dataclass(frozen=True, slots=True)
class Added:
    """What the gateway asked the upstream for on its own behalf (stripped from answers)."""

    token_ids: bool = False
    logprobs: bool = False

    @property
    def any(self) -> bool:
        """Whether anything was added."""
        return self.token_ids or self.logprobs


def augment(
    raw: bytes, body: dict[str, Any], kind: str, ask_token_ids: bool = True
) -> tuple[bytes, Added]:
    """The upstream request body: the client's, plus token-id and log-prob requests."""
    extra: dict[str, Any] = {}
    if ask_token_ids and body.get("return_token_ids") is not True:
        extra["return_token_ids"] = True
    if kind == CHAT_KIND:
        if body.get("logprobs") is not True:
            extra["logprobs"] = True
    elif body.get("logprobs") is None:
        extra["logprobs"] = 0  # the sampled token's log-prob only
    if not extra:
        return raw, Added()
    added = Added("return_token_ids" in extra, "logprobs" in extra)
    stripped = raw.rstrip()
    if body and stripped.endswith(b"}") and not extra.keys() & body.keys():
        # Splice instead of re-encoding the whole (often long) conversation.
        return stripped[:-1] + b"," + pydantic_core.to_json(extra)[1:], added
    return pydantic_core.to_json(body | extra), added


def stripped(answer: dict[str, Any], added: Added) -> dict[str, Any]:
    """A copy of a response or stream chunk without what `added` asked for (as the client
    would have got it from the upstream directly); the answer itself when nothing was added."""
    if not added.any:
        return answer
    view = dict(answer)
    if added.token_ids:
        view.pop("prompt_token_ids", None)
    choices = view.get("choices")
    if isinstance(choices, list):
        view["choices"] = [_stripped_choice(c, added) for c in choices]
    return view


def _stripped_choice(choice: Any, added: Added) -> Any:
    if not isinstance(choice, dict):
        return choice
    choice = dict(choice)
    if added.token_ids:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    if added.logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    return choice


def logprobs_of(logprobs: Any, kind: str) -> list[float] | None:
    """The sampled tokens' log-probs from a choice's (or chunk's) `logprobs`."""
    if not isinstance(logprobs, dict):
        return None
    if kind == CHAT_KIND:
        content = logprobs.get("content")
        if not isinstance(content, list):
            return None
        return [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    values = logprobs.get("token_logprobs")
    return values if isinstance(values, list) else None


@dataclass(slots=True)
class CapturedChoice:
    """One choice of an answer: what the step needs, and the answer as the client saw it."""

    index: int
    prompt_ids: list[int] | None
    response_ids: list[int] | None
    logprobs: list[float] | None
    finish_reason: str | None
    output: dict[str, Any]  # chat: the assistant message; completions: {"text": ...}
    response: dict[str, Any]  # the client's answer reduced to this choice (for audit)
    metadata: dict[str, Any] | None = None  # what the step's metadata adds (token-in)


def captured_choices(
    upstream: dict[str, Any], client_view: dict[str, Any], kind: str
) -> list[CapturedChoice]:
    """The choices of a complete upstream answer, each with the client's view of it."""
    prompt_ids = upstream.get("prompt_token_ids")
    envelope = {k: v for k, v in client_view.items() if k not in ("choices", "prompt_token_ids")}
    seen_choices = client_view.get("choices")
    captured = []
    for position, raw in enumerate(upstream.get("choices") or ()):
        if not isinstance(raw, dict):
            continue
        seen = seen_choices[position] if isinstance(seen_choices, list) else raw
        output = raw.get("message") if kind == CHAT_KIND else {"text": raw.get("text")}
        captured.append(
            CapturedChoice(
                index=choice_index(raw, position),
                prompt_ids=raw.get("prompt_token_ids") or prompt_ids,
                response_ids=raw.get("token_ids"),
                logprobs=logprobs_of(raw.get("logprobs"), kind),
                finish_reason=raw.get("finish_reason"),
                output=output if isinstance(output, dict) else {},
                response=envelope | {"choices": [audit_choice(seen)]},
            )
        )
    return captured


def choice_index(choice: dict[str, Any], default: int) -> int:
    """A choice's `index` (its position when the upstream gives none that is usable)."""
    index = choice.get("index")
    return (
        index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else default
    )


def audit_choice(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice as stored in the audit payload: token ids live in typed columns instead."""
    if "token_ids" not in choice and "prompt_token_ids" not in choice:
        return choice
    return {k: v for k, v in choice.items() if k not in ("token_ids", "prompt_token_ids")}


# -- packing, with local tokenization when the upstream gave no ids ------------------------


@dataclass(frozen=True, slots=True)
class StepTokens:
    """A step's token arrays packed for bronze (int32, int32, float32) and where they came from."""

    prompt_ids: bytes
    response_ids: bytes
    rollout_log_probs: bytes | None
    token_source: str


def _pack_ids(ids: Any) -> bytes | None:
    """Little-endian int32 bytes of a list (or array) of token ids; None when it is not one."""
    if isinstance(ids, np.ndarray):
        return ids.astype("<i4", copy=False).tobytes()
    if not isinstance(ids, list):
        return None
    try:
        return struct.pack(f"<{len(ids)}i", *ids)
    except (struct.error, TypeError):
        return None


def _pack_logprobs(values: Sequence[Any] | None, length: int) -> bytes | None:
    if values is None or len(values) != length:
        return None
    try:
        return struct.pack(f"<{length}f", *values)
    except (struct.error, TypeError):
        return None  # e.g. a None for an echoed prompt token


def step_tokens(
    choice: CapturedChoice,
    request: dict[str, Any],
    kind: str,
    prompt_index: int,
    tokenizer: Callable[[], ChatTokenizer],
) -> StepTokens:
    """The choice's ids as the upstream sampled them, else tokenized locally with the
    model's tokenizer and chat template (`local`; `tokenizer` is called only then)."""
    prompt = _pack_ids(choice.prompt_ids)
    response = _pack_ids(choice.response_ids)
    source = "upstream"
    if prompt is None:
        ids = local_prompt_ids(request, kind, prompt_index, tokenizer())
        prompt, source = _pack_ids(ids), "local"
    if response is None:
        ids = local_response_ids(request, kind, choice.output, choice.finish_reason, tokenizer())
        response, source = _pack_ids(ids), "local"
    response = response or b""
    logprobs = _pack_logprobs(choice.logprobs, len(response) // 4)
    return StepTokens(prompt or b"", response, logprobs, source)


def local_prompt_ids(
    request: dict[str, Any], kind: str, prompt_index: int, tokenizer: ChatTokenizer
) -> list[int]:
    """The prompt's ids rendered (chat template) and tokenized here; [] if it cannot be."""
    try:
        if kind == CHAT_KIND:
            return tokenizer.encode(tokenizer.render(request["messages"], request.get("tools")))
        prompt = request["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[min(prompt_index, len(prompt) - 1)]
        return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)
    except Exception as exc:  # a request the upstream took but our template cannot render
        log.warning("cannot tokenize the prompt locally: %s", exc)
        return []


def local_response_ids(
    request: dict[str, Any],
    kind: str,
    output: dict[str, Any],
    finish_reason: str | None,
    tokenizer: ChatTokenizer,
) -> list[int]:
    """The reply's ids as the chat template renders it (stop token included when it ended)."""
    if kind != CHAT_KIND:
        return tokenizer.encode(output.get("text") or "")
    stop = tokenizer.eos_token
    try:
        messages, tools = request["messages"], request.get("tools")
        message = {"role": "assistant", **output}
        prompt = tokenizer.render(messages, tools)
        full = tokenizer.render([*messages, message], tools, generation=False)
        reply = full[len(prompt) :] if full.startswith(prompt) else None
    except Exception as exc:
        log.warning("cannot render the reply locally: %s", exc)
        reply = None
    if reply is None:
        reply = (output.get("content") or "") + stop
    reply = reply.removesuffix("\n")  # the template's newline after the stop token
    if finish_reason not in TERMINAL_FINISHES:
        reply = reply.removesuffix(stop)
    return tokenizer.encode(reply)
