"""Chat templates: the bundled ChatML template, a Jinja environment that renders Hugging Face
templates as transformers does, and the templates a tokenizer folder holds (transformers 4
or 5 layouts, named templates included)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Environment, TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from claw_pipelines.tokenization.bundled import IM_END, TOOL_CALL_END, TOOL_CALL_START, encode

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

# where a tokenizer folder keeps its templates, in the order transformers prefers them
TEMPLATE_FILE = "chat_template.jinja"  # transformers 5: the default template
TEMPLATE_DIR = "additional_chat_templates"  # transformers 5: named templates, <name>.jinja
CONFIG_FILE = "tokenizer_config.json"  # transformers 4: `chat_template`, a string or named list
PROCESSOR_TEMPLATE_FILE = "chat_template.json"  # a processor's legacy {"chat_template": ...}
TOOL_TEMPLATE = "tool_use"  # the named template transformers picks when tools are given


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as transformers' chat templates get it (no HTML escaping, keys in order)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class _Generation(Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask marker) renders
    its body; the mask itself is not needed here."""

    tags = {"generation"}  # noqa: RUF012 (jinja's extension API)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=16)
def compiled(template: str) -> Any:
    """A template compiled in the environment transformers renders chat templates in (a
    sandbox: a model folder's template is code from elsewhere)."""
    return _environment(ImmutableSandboxedEnvironment).from_string(template)


@lru_cache(maxsize=1)
def _bundled() -> Any:
    """The bundled ChatML template, ours, compiled outside the sandbox (same options, same
    output; the sandbox's checks on every attribute were a third of its render time)."""
    return _environment(Environment).from_string(DEFAULT_CHAT_TEMPLATE)


def _environment(kind: type[Environment]) -> Environment:
    """A Jinja environment of `kind` set up as transformers sets up chat templates'."""
    env = kind(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def content_text(content: Any) -> str:
    """A message's content as text: a string, None, or a list of OpenAI text parts (joined
    with newlines, as vLLM does for templates that take text)."""
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
    **special_tokens: str,
) -> str:
    """Render OpenAI-style chat messages (and tools) to a prompt string with a Jinja template
    (default ChatML) and its special tokens."""
    normalized = [
        {**message, "content": content_text(message.get("content"))} for message in messages
    ]
    return (compiled(template) if template else _bundled()).render(
        messages=normalized,
        tools=tools or None,
        add_generation_prompt=add_generation_prompt,
        default_system=DEFAULT_SYSTEM_WITH_TOOLS,
        bos_token=bos_token,
        eos_token=eos_token,
        **special_tokens,
    )


def encode_chat(
    messages: list[dict],
    tools: list[dict] | None = None,
    tokenizer: Tokenizer | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Prompt token ids of a chat with ChatML: `encode(render_chat(...))`."""
    return encode(render_chat(messages, tools, add_generation_prompt), tokenizer)


def render_tool_call(name: str, arguments: str) -> str:
    """The text of one tool call as the default template renders it (`arguments` is JSON)."""
    return (
        f'{TOOL_CALL_START}\n{{"name": {_tojson(name)}, "arguments": {arguments}}}\n{TOOL_CALL_END}'
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: is not a JSON object")
    return data


def _named(value: Any) -> dict[str, str]:
    """A `chat_template` entry as named templates: a string is the default; a list of
    `{name, template}` names each."""
    if isinstance(value, str):
        return {"default": value} if value.strip() else {}
    if isinstance(value, list):
        return {
            t["name"]: t["template"]
            for t in value
            if isinstance(t, Mapping) and isinstance(t.get("name"), str)
            if isinstance(t.get("template"), str)
        }
    return {}


def folder_templates(folder: Path) -> dict[str, str]:
    """The chat templates of a tokenizer folder by name (`default`, `tool_use`, …): the
    transformers 5 files (chat_template.jinja, additional_chat_templates/*.jinja) when
    present, else tokenizer_config.json's `chat_template`, else a processor's
    chat_template.json. ValueError naming the files looked at when there is none."""
    templates: dict[str, str] = {}
    if (folder / TEMPLATE_FILE).is_file():
        templates["default"] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATE_DIR).is_dir():
        for path in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if not templates and (folder / CONFIG_FILE).is_file():
        templates = _named(_read_json(folder / CONFIG_FILE).get("chat_template"))
    if not templates and (folder / PROCESSOR_TEMPLATE_FILE).is_file():
        templates = _named(_read_json(folder / PROCESSOR_TEMPLATE_FILE).get("chat_template"))
    templates = {name: text for name, text in templates.items() if text.strip()}
    if not templates:
        looked = ", ".join(
            (TEMPLATE_FILE, f"{TEMPLATE_DIR}/", CONFIG_FILE, PROCESSOR_TEMPLATE_FILE)
        )
        raise ValueError(f"{folder}: has no chat_template (looked in {looked})")
    for name, text in templates.items():
        try:
            compiled(text)  # a template that does not parse fails here, not on the first call
        except TemplateError as exc:
            raise ValueError(f"{folder}: chat template {name!r} does not parse: {exc}") from None
    return templates


def pick_template(templates: Mapping[str, str], tools: Any) -> str:
    """The template transformers uses for a call: `tool_use` when tools are given and it
    exists, else `default` (ValueError naming the templates when there is none)."""
    if tools and TOOL_TEMPLATE in templates:
        return templates[TOOL_TEMPLATE]
    if "default" in templates:
        return templates["default"]
    raise ValueError(f"several chat templates and no default: {', '.join(sorted(templates))}")
