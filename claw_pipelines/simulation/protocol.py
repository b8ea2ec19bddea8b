"""Wire format of the simulated model: request models and OpenAI/vLLM response pieces.

Requests ignore unknown fields (like vLLM). Token ids follow vLLM's `return_token_ids`: chat has
a top-level `prompt_token_ids` and per-choice `token_ids`; completions carry both per choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from tokenizers import Tokenizer

from claw_pipelines.simulation.sampling import Generation
from claw_pipelines.tokenization import decode, token_bytes

MAX_CHOICES = 64
MAX_TOP_LOGPROBS = 20


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Open):
    """An OpenAI text content part (the only kind a text model takes)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Open):
    """The function of an assistant tool call in the conversation."""

    name: str
    arguments: str | dict[str, Any]


class ToolCall(_Open):
    """An assistant tool call in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    """One message of the conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
            for part in value
        ):
            return value
        raise ValueError("must be a string, null, or a list of text parts {type: text, text}")

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDefinition(_Open):
    """A function the model may call."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(_Open):
    """An entry of `tools`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Open):
    """The function a named tool choice forces."""

    name: str


class NamedToolChoice(_Open):
    """`tool_choice` naming one function."""

    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    """`stream_options`."""

    include_usage: bool = False


class SamplingRequest(_Lenient):
    """Fields shared by chat and legacy completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # the simulated model's stand-in for a weight update mid-generation: the request is
    # aborted after this many tokens, as vLLM aborts requests in flight (the tokens so far,
    # finish_reason `abort`); a choice that ends sooner is not
    abort_after_tokens: int | None = Field(None, ge=0)

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingRequest):
    """Body of `POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required") or isinstance(value, dict):
            return value
        raise ValueError("must be 'none', 'auto', 'required' or {type: function, function: {name}}")

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        names = {tool.function.name for tool in self.tools or []}
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in (
            names
        ):
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, not a tool")
        return self

    @property
    def token_limit(self) -> int | None:
        """`max_completion_tokens`, else `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    )


Prompt = str | list[str] | list[list[int]] | list[int]


class CompletionRequest(SamplingRequest):
    """Body of `POST /v1/completions`."""

    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value:
            if all(_is_token_ids(item) for item in value) or _is_token_ids(value):
                return value
            if all(isinstance(item, str) and item for item in value):
                return value
        raise ValueError(
            "must be a non-empty string, a list of token ids, or a non-empty list of either"
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each one text or token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(item, int) for item in self.prompt):
            return [list(self.prompt)]  # type: ignore[arg-type]
        return list(self.prompt)  # type: ignore[arg-type]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The OpenAI `usage` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_texts(tokenizer: Tokenizer, ids: Sequence[int]) -> tuple[list[str], list[bytes]]:
    table = token_bytes(tokenizer)
    raw = [table[i] for i in ids]
    return [b.decode("utf-8", "replace") for b in raw], raw


def _rows(items: list[Any], width: int) -> list[list[Any]]:
    return [items[i : i + width] for i in range(0, len(items), width)] if width else []


def _top(tokenizer: Tokenizer, gen: Generation, start: int, end: int, width: int) -> tuple:
    """Rows of (token texts, token bytes, log-probs) of the `width` most likely tokens."""
    texts, raw = _token_texts(tokenizer, gen.top_ids[start:end, :width].ravel().tolist())
    logprobs = gen.top_logprobs[start:end, :width].ravel().tolist()
    return _rows(texts, width), _rows(raw, width), _rows(logprobs, width)


def chat_logprobs(
    tokenizer: Tokenizer, gen: Generation, top: int, start: int = 0, end: int | None = None
) -> dict[str, Any]:
    """OpenAI chat `logprobs` for tokens `start:end` of a choice."""
    end = len(gen.token_ids) if end is None else end
    texts, raw = _token_texts(tokenizer, gen.token_ids[start:end])
    logprobs = gen.logprobs[start:end].tolist()
    top_texts, top_raw, top_logprobs = _top(tokenizer, gen, start, end, top)
    content = []
    for row, (text, data, logprob) in enumerate(zip(texts, raw, logprobs, strict=True)):
        alternatives = (
            zip(top_texts[row], top_raw[row], top_logprobs[row], strict=True) if top else ()
        )
        content.append(
            {
                "token": text,
                "logprob": logprob,
                "bytes": list(data),
                "top_logprobs": [
                    {"token": t, "logprob": lp, "bytes": list(b)} for t, b, lp in alternatives
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Tokenizer, gen: Generation, top: int, start: int = 0, end: int | None = None
) -> dict[str, Any]:
    """Legacy completions `logprobs` (tokens, token_logprobs, top_logprobs, text_offset)."""
    end = len(gen.token_ids) if end is None else end
    texts, _ = _token_texts(tokenizer, gen.token_ids)
    offsets = list(accumulate((len(text) for text in texts[:-1]), initial=0))
    top_texts, _, top_logprobs = _top(tokenizer, gen, start, end, max(top, 1))
    return {
        "tokens": texts[start:end],
        "token_logprobs": gen.logprobs[start:end].tolist(),
        "top_logprobs": [
            dict(zip(t, lp, strict=True)) for t, lp in zip(top_texts, top_logprobs, strict=True)
        ],
        "text_offset": offsets[start:end],
    }


@dataclass(frozen=True)
class Piece:
    """A stretch of a choice's tokens sent in one stream chunk, with the text it adds."""

    start: int
    end: int
    text: str


def stream_pieces(tokenizer: Tokenizer, gen: Generation, size: int = 3) -> list[Piece]:
    """Split a choice into pieces of `size` tokens; text is content, or tool-call arguments."""
    ids = gen.token_ids
    low, high, skip = 0, None, True
    if gen.tool_call is not None:
        full = decode(ids, tokenizer)
        low = full.rindex(gen.tool_call.arguments)
        high, skip = low + len(gen.tool_call.arguments), False
    pieces, committed = [], ""
    for start in range(0, len(ids), size):
        end = min(start + size, len(ids))
        text = decode(ids[:end], tokenizer, skip_special_tokens=skip)[low:high]
        if end < len(ids):
            text = text.rstrip("\ufffd")  # an unfinished UTF-8 character waits for its bytes
        pieces.append(Piece(start, end, text[len(committed) :]))
        committed = text
    return pieces
