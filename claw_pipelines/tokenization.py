"""The bundled byte-level BPE tokenizer and the ChatML chat template (pure: no servers),
and a model's own tokenizer and chat template from its Hugging Face tokenizer directory.

Any text round-trips: `decode(encode(text)) == text`. The chat template renders an assistant
tool call exactly as the simulated model emits it, so a response's token ids reappear verbatim
inside the next turn's prompt.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "END_OF_TEXT",
    "IM_END",
    "IM_START",
    "SPECIAL_TOKENS",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "ChatTokenizer",
    "decode",
    "decode_lists",
    "encode",
    "encode_chat",
    "load_chat_tokenizer",
    "load_tokenizer",
    "render_chat",
    "render_tool_call",
    "token_bytes",
]

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, TOOL_CALL_START, TOOL_CALL_END)
DEFAULT_SYSTEM_WITH_TOOLS = "You are a helpful assistant."

DEFAULT_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content }}
{%- else %}{{- default_system }}{% endif %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' ~ (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' ~ message.content }}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{% endif %}
{{- '<tool_call>\\n{\"name\": ' ~ (fn.name | tojson) ~ ', \"arguments\": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{% else %}{{- fn.arguments | tojson }}{% endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif not (loop.first and tools and message.role == 'system') %}
{{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{% endif %}
"""

# GPT-2's printable stand-ins for the 256 byte values (the ByteLevel pre-tokenizer alphabet).
_PRINTABLE = [*range(33, 127), *range(161, 173), *range(174, 256)]
_BYTE_OF_CHAR = {chr(b): b for b in _PRINTABLE} | {
    chr(256 + n): b for n, b in enumerate(b for b in range(256) if b not in _PRINTABLE)
}


def _tojson(value: Any, indent: int | None = None) -> str:
    """JSON as Hugging Face chat templates expect it (no HTML escaping, keys in order)."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


@lru_cache(maxsize=8)
def _load(path: str | None) -> Tokenizer:
    if path is None:
        shipped = resources.files("claw_pipelines").joinpath("bundled_tokenizer", "tokenizer.json")
        return Tokenizer.from_str(shipped.read_text(encoding="utf-8"))
    return Tokenizer.from_file(path)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The tokenizer at `path` (a Hugging Face tokenizer.json, or a directory holding one),
    default the bundled one; cached."""
    if path is not None and Path(path).is_dir():
        path = str(Path(path) / "tokenizer.json")
    return _load(path)


def _content_text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise ValueError(f"unsupported content part: {str(part)[:80]}")
        return "\n".join(texts)
    raise ValueError(f"unsupported message content of type {type(content).__name__}")


def render_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    template: str | None = None,
    bos_token: str = "",
    eos_token: str = IM_END,
) -> str:
    """Render OpenAI-style chat messages (and tools) to a prompt string with a Jinja template
    (default ChatML) and its special tokens."""
    normalized = [
        {**message, "content": _content_text(message.get("content"))} for message in messages
    ]
    return _compiled(template or DEFAULT_CHAT_TEMPLATE).render(
        messages=normalized,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        default_system=DEFAULT_SYSTEM_WITH_TOOLS,
        bos_token=bos_token,
        eos_token=eos_token,
    )


def render_tool_call(name: str, arguments: str) -> str:
    """The text of one tool call as the default template renders it (`arguments` is JSON)."""
    return (
        f'{TOOL_CALL_START}\n{{"name": {_tojson(name)}, "arguments": {arguments}}}\n{TOOL_CALL_END}'
    )


def encode(text: str, tokenizer: Tokenizer | None = None) -> list[int]:
    """Token ids of `text`; special-token strings in it become their special ids."""
    return (tokenizer or load_tokenizer()).encode(text, add_special_tokens=False).ids


def decode(
    ids: Sequence[int], tokenizer: Tokenizer | None = None, skip_special_tokens: bool = False
) -> str:
    """Text of token ids; by default the exact inverse of `encode` (special tokens kept)."""
    return (tokenizer or load_tokenizer()).decode(
        list(ids), skip_special_tokens=skip_special_tokens
    )


def encode_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    tokenizer: Tokenizer | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt token ids of a chat: `encode(render_chat(...))`."""
    return encode(render_chat(messages, tools, add_generation_prompt), tokenizer)


@lru_cache(maxsize=8)
def _token_bytes(tokenizer: Tokenizer) -> tuple[bytes, ...]:
    added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
    table = []
    for token_id in range(tokenizer.get_vocab_size()):
        if token_id in added:
            table.append(added[token_id].encode("utf-8"))
            continue
        piece = tokenizer.id_to_token(token_id) or ""
        table.append(bytes(_BYTE_OF_CHAR.get(char, 0x3F) for char in piece))
    return tuple(table)


def token_bytes(tokenizer: Tokenizer | None = None) -> tuple[bytes, ...]:
    """The raw bytes of every token id of a byte-level tokenizer (index = id); cached."""
    return _token_bytes(tokenizer or load_tokenizer())


@lru_cache(maxsize=8)
def _byte_table(path: str | None) -> pa.Array:
    return pa.array(token_bytes(load_tokenizer(path)), pa.binary())


def decode_lists(ids: pa.ListArray | pa.ChunkedArray, tokenizer: str | None = None) -> pl.Series:
    """Texts of token-id lists with a byte-level tokenizer (default the bundled one),
    vectorized: a byte lookup per token and one join per list."""
    table = _byte_table(tokenizer)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    pieces = pa.ListArray.from_arrays(ids.offsets, pc.take(table, ids.values))
    texts = pc.binary_join(pieces, b"").cast(pa.large_string())
    series = pl.from_arrow(texts)
    assert isinstance(series, pl.Series)
    return series


def _token_text(value: Any) -> str:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass(frozen=True)
class ChatTokenizer:
    """A tokenizer and the chat template its model was trained with: what turning a
    conversation into prompt ids needs."""

    tokenizer: Tokenizer
    template: str = ""  # empty: the default ChatML template
    bos_token: str = ""
    eos_token: str = IM_END

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, generation: bool = True
    ) -> str:
        """The conversation as the model's template renders it."""
        return render_chat(
            messages, tools, generation, self.template or None, self.bos_token, self.eos_token
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (special-token strings become their ids)."""
        return encode(text, self.tokenizer)


def _template_of(config: Mapping[str, Any]) -> str | None:
    """tokenizer_config.json's chat template: a string, or the `default` of a named list."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


@lru_cache(maxsize=8)
def load_chat_tokenizer(path: str | None = None) -> ChatTokenizer:
    """The tokenizer and chat template at `path`: a Hugging Face tokenizer directory
    (tokenizer.json, and tokenizer_config.json with its Jinja `chat_template` and special
    tokens), or a bare tokenizer.json; default the bundled tokenizer. ChatML is the template
    of the bundled tokenizer and of a bare file; a directory must bring its own (ValueError
    naming the file otherwise)."""
    tokenizer = load_tokenizer(path)
    if path is None or not Path(path).is_dir():
        return ChatTokenizer(tokenizer)
    config_path = Path(path) / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_path}: cannot be read as JSON ({exc})") from None
    template = _template_of(config)
    if template is None:
        raise ValueError(f"{config_path}: has no chat_template")
    _compiled(template)  # a template that does not parse fails here, not on the first call
    return ChatTokenizer(
        tokenizer,
        template,
        _token_text(config.get("bos_token")),
        _token_text(config.get("eos_token")) or IM_END,
    )
