"""Token capture: ask the upstream for the sampled ids, log-probs and usage, take back out of
its answer what the client did not ask for, and tokenize locally when the upstream cannot say,
checking the local ids against the server's own counts.

Upstream ids, as servers return them when asked with `return_token_ids`:
- vLLM: chat answers carry a top-level `prompt_token_ids` and per-choice `token_ids`; legacy
  completions both per choice (streams: the prompt's in the first chunk, `token_ids` per chunk);
- SGLang: per-choice `prompt_token_ids` and `response_token_ids` (0.5.18+; `token_ids` before)
  on chat, vLLM's fields on completions; it refuses `return_token_ids` on chat streams;
- llama.cpp: no id fields, but each chat log-prob entry carries the sampled token's `id`.

Token sources a step records (`token_source`): `upstream` (the server's ids), `local`
(computed here with the model's tokenizer, and the prompt and reply lengths equal the
server's `usage` counts), `local_unverified` (computed here, and the counts disagree or the
server gave none: both counts are in `metadata.token_check`).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pydantic_core

from claw_pipelines.tokenization import ChatTokenizer

log = logging.getLogger(__name__)

CHAT_KIND = "chat_completion"
COMPLETION_KIND = "completion"
TERMINAL_FINISHES = ("stop", "tool_calls", "function_call")
UPSTREAM, LOCAL, LOCAL_UNVERIFIED = "upstream", "local", "local_unverified"
_RESPONSE_ID_FIELDS = ("token_ids", "response_token_ids")  # vLLM's, SGLang's chat name


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
    usage: bool = False  # a stream's usage (stream_options.include_usage)

    @property
    def any(self) -> bool:
        """Whether anything was added."""
        return self.token_ids or self.logprobs or self.usage


def augment(
    raw: bytes, body: dict[str, Any], kind: str, ask_token_ids: bool = True
) -> tuple[bytes, Added]:
    """The upstream request body: the client's, plus token-id, log-prob and (streams) usage
    requests."""
    extra: dict[str, Any] = {}
    if ask_token_ids and body.get("return_token_ids") is not True:
        extra["return_token_ids"] = True
    if kind == CHAT_KIND:
        if body.get("logprobs") is not True:
            extra["logprobs"] = True
    elif body.get("logprobs") is None:
        extra["logprobs"] = 0  # the sampled token's log-prob only
    options = body.get("stream_options")
    if body.get("stream") is True and not (
        isinstance(options, dict) and options.get("include_usage") is True
    ):
        extra["stream_options"] = (options if isinstance(options, dict) else {}) | {
            "include_usage": True
        }
    if not extra:
        return raw, Added()
    added = Added("return_token_ids" in extra, "logprobs" in extra, "stream_options" in extra)
    stripped = raw.rstrip()
    if body and stripped.endswith(b"}") and not extra.keys() & body.keys():
        # Splice instead of re-encoding the whole (often long) conversation.
        return stripped[:-1] + b"," + pydantic_core.to_json(extra)[1:], added
    return pydantic_core.to_json(body | extra), added


def stripped(answer: dict[str, Any], added: Added) -> dict[str, Any] | None:
    """A copy of a response or stream chunk without what `added` asked for (as the client
    would have got it from the upstream directly); the answer itself when nothing was added;
    None for a stream's usage chunk the client did not ask for."""
    if not added.any:
        return answer
    view = dict(answer)
    if added.token_ids:
        view.pop("prompt_token_ids", None)
    if added.usage and "usage" in view:
        view.pop("usage")
        if not view.get("choices"):
            return None  # the usage-only chunk (OpenAI, vLLM, SGLang)
    choices = view.get("choices")
    if isinstance(choices, list):
        view["choices"] = [_stripped_choice(c, added) for c in choices]
    return view


def _stripped_choice(choice: Any, added: Added) -> Any:
    if not isinstance(choice, dict):
        return choice
    choice = dict(choice)
    if added.token_ids:
        for name in (*_RESPONSE_ID_FIELDS, "prompt_token_ids"):
            choice.pop(name, None)
    if added.logprobs and "logprobs" in choice:
        choice["logprobs"] = None
    return choice


def logprob_ids(logprobs: Any) -> list[int] | None:
    """The sampled token ids a chat choice's log-probs carry (llama.cpp's `id` per entry)."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list) or not content:
        return None
    ids = [entry.get("id") if isinstance(entry, dict) else None for entry in content]
    return ids if all(isinstance(i, int) and not isinstance(i, bool) for i in ids) else None


def response_ids_of(choice: dict[str, Any], kind: str) -> list[int] | None:
    """A choice's (or chunk's) sampled ids, in whichever field its server puts them."""
    for name in _RESPONSE_ID_FIELDS:
        if isinstance(ids := choice.get(name), list):
            return ids
    return logprob_ids(choice.get("logprobs")) if kind == CHAT_KIND else None


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
                response_ids=response_ids_of(raw, kind),
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
    dropped = (*_RESPONSE_ID_FIELDS, "prompt_token_ids")
    if not any(name in choice for name in dropped):
        return choice
    return {k: v for k, v in choice.items() if k not in dropped}


# -- packing, with local tokenization when the upstream gave no ids ------------------------


@dataclass(frozen=True, slots=True)
class StepTokens:
    """A step's token arrays packed for bronze (int32, int32, float32), where they came from,
    and what the step's metadata says of them (the tokenizer and the count check)."""

    prompt_ids: bytes
    response_ids: bytes
    rollout_log_probs: bytes | None
    token_source: str
    local_prompt: bool = False  # the prompt's ids were computed here
    local_response: bool = False  # the reply's ids were computed here
    metadata: dict[str, Any] | None = None

    @property
    def local(self) -> bool:
        """Whether any of the ids were computed here."""
        return self.local_prompt or self.local_response


class Uncapturable(Exception):
    """The upstream gave no ids for a choice and no tokenizer is configured to compute them."""


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
    tokenizer: Callable[[], ChatTokenizer | None],
) -> StepTokens:
    """The choice's ids as the upstream sampled them, else computed here with the model's
    tokenizer and chat template (`tokenizer` is called only then; Uncapturable when it gives
    none). Local ids are labelled by `verified`, against the server's counts."""
    prompt = _pack_ids(choice.prompt_ids)
    response = _pack_ids(choice.response_ids)
    local_prompt = local_response = False
    if prompt is None or response is None:
        chat = tokenizer()
        if chat is None:
            raise Uncapturable("the upstream returned no token ids and CLAW_TOKENIZER is unset")
        if prompt is None:
            ids, local_prompt = local_prompt_ids(request, kind, prompt_index, chat)
            prompt = _pack_ids(ids)
        if response is None:
            ids = local_response_ids(request, kind, choice.output, choice.finish_reason, chat)
            response, local_response = _pack_ids(ids), True
    response = response or b""
    logprobs = _pack_logprobs(choice.logprobs, len(response) // 4)
    source = LOCAL_UNVERIFIED if local_prompt or local_response else UPSTREAM
    return StepTokens(prompt or b"", response, logprobs, source, local_prompt, local_response)


def _count(usage: Any, name: str) -> int | None:
    value = usage.get(name) if isinstance(usage, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def verified(tokens: list[StepTokens], prompt_indices: list[int], usage: Any) -> list[StepTokens]:
    """A call's step tokens with local ids labelled against the server's `usage`: `local`
    when the prompt ids (each prompt once) and the replies' ids (summed) have the server's
    counts, else `local_unverified`; both counts go into the metadata. Ids all from the
    upstream are returned as they are."""
    if not any(t.local for t in tokens):
        return tokens
    prompts = {index: t for index, t in zip(prompt_indices, tokens, strict=True)}
    local_prompt = sum(len(t.prompt_ids) // 4 for t in prompts.values())
    local_completion = sum(len(t.response_ids) // 4 for t in tokens)
    server_prompt = _count(usage, "prompt_tokens")
    server_completion = _count(usage, "completion_tokens")
    agree = server_prompt == local_prompt and server_completion == local_completion
    metadata: dict[str, Any] = {
        "token_check": {
            "prompt_tokens": [local_prompt, server_prompt],
            "completion_tokens": [local_completion, server_completion],
        }
    }
    source = LOCAL if agree else LOCAL_UNVERIFIED
    return [replace(t, token_source=source, metadata=metadata) if t.local else t for t in tokens]


def local_prompt_ids(
    request: dict[str, Any], kind: str, prompt_index: int, tokenizer: ChatTokenizer
) -> tuple[list[int], bool]:
    """The prompt's ids, and whether they were computed here: rendered (chat template) and
    tokenized, or the client's own token-id prompt; [] if it cannot be rendered."""
    try:
        if kind == CHAT_KIND:
            return tokenizer.prompt_ids(request["messages"], request.get("tools")), True
        prompt = request["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[min(prompt_index, len(prompt) - 1)]
        if isinstance(prompt, list):
            return list(prompt), False
        return tokenizer.encode(prompt), True
    except Exception as exc:  # a request the upstream took but our template cannot render
        log.warning("cannot tokenize the prompt locally: %s", exc)
        return [], True


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
