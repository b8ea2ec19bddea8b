"""A model's chat tokenizer: its tokenizer and chat template, turning a conversation into
the prompt ids the model's server computes.

Two kinds:
- the bundled tokenizer with ChatML (the simulated model's), or a bare tokenizer.json;
- a Hugging Face tokenizer folder (`CLAW_TOKENIZER`), saved by transformers 4 or 5. With
  transformers installed it is loaded exactly as a server loads it
  (`AutoTokenizer.from_pretrained(folder)`, `apply_chat_template`), so a model-specific
  tokenizer class that rebuilds its normalizer or pre-tokenizer is honoured. Without
  transformers, only a folder whose tokenizer is its tokenizer.json as written is accepted
  (rendered in the same Jinja environment); another is refused in one line naming why.

Messages reach a folder's template as inference servers pass them (vLLM, `transformers
serve`): text content parts joined into one string, tool-call `arguments` parsed from JSON
into objects.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from collections.abc import Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
from tokenizers import Tokenizer

from claw_pipelines.tokenization.bundled import (
    IM_END,
    decode_lists_with,
    is_bundled,
    load_tokenizer,
)
from claw_pipelines.tokenization.templates import (
    CONFIG_FILE,
    compiled,
    content_text,
    folder_templates,
    pick_template,
    render_chat,
)

# tokenizer classes that are their tokenizer.json as written, whatever transformers' version
GENERIC_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
INSTALL_HINT = "install transformers (pip install 'claw-lakehouse[hf]')"


class ChatTokenizer:
    """A tokenizer and the chat template its model was trained with: what turning a
    conversation into prompt ids needs (the bundled tokenizer with ChatML by default)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        name: str = "bundled",
        fingerprint_of: bytes = b"",
    ) -> None:
        self.tokenizer = tokenizer
        self.templates = dict(templates or {})  # empty: the default ChatML template
        self.special_tokens = {"bos_token": "", "eos_token": IM_END, **(special_tokens or {})}
        self.name = name  # what the steps it tokenized record: `bundled`, a file or a folder
        self._fingerprint_of = fingerprint_of

    @property
    def eos_token(self) -> str:
        """The template's end-of-turn token (text)."""
        return self.special_tokens.get("eos_token") or ""

    @cached_property
    def fingerprint(self) -> str:
        """A short hash of the tokenizer and its templates: steps tokenized alike share it."""
        digest = hashlib.sha256(self._fingerprint_of or self.tokenizer.to_str().encode())
        digest.update(json.dumps(self.templates, sort_keys=True).encode())
        return digest.hexdigest()[:16]

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, generation: bool = True
    ) -> str:
        """The conversation as the model's template renders it."""
        if not self.templates:
            return render_chat(messages, tools, generation, None, **self.special_tokens)
        return compiled(pick_template(self.templates, tools)).render(
            messages=server_messages(messages),
            tools=tools or None,
            add_generation_prompt=generation,
            **self.special_tokens,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (special-token strings become their ids)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens kept."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode_batch(self, lists: Sequence[Sequence[int]]) -> list[str]:
        """Texts of many id lists at once (in Rust, in parallel), special tokens kept."""
        return self.tokenizer.decode_batch([list(ids) for ids in lists], skip_special_tokens=False)

    @cached_property
    def byte_level(self) -> bool:
        """Whether the tokenizer decodes by bytes (GPT-2 style byte-level BPE: the bundled
        one, Qwen, Llama 3): then id lists decode as a table lookup, vectorized."""
        return json.loads(self.tokenizer.to_str()).get("decoder", {}).get("type") == "ByteLevel"

    def decode_lists(self, ids: pa.ListArray | pa.ChunkedArray) -> pl.Series:
        """Texts of a column of id lists, special tokens kept: byte-level tokenizers by a
        vectorized byte lookup, others (or text that is not whole UTF-8) in Rust batches."""
        if self.byte_level:
            try:
                return decode_lists_with(ids, self.tokenizer)
            except pa.ArrowInvalid:  # a list that ends inside a character: decode it as text
                pass
        return pl.Series(self.decode_batch(pl.Series(ids).to_list()), dtype=pl.String)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The prompt ids of a chat waiting for the assistant's reply."""
        return self.encode(self.render(messages, tools))


class TransformersChatTokenizer(ChatTokenizer):
    """A tokenizer folder loaded by transformers, as an inference server loads it."""

    def __init__(self, folder: Path, templates: Mapping[str, str], fingerprint_of: bytes) -> None:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        specials = {n: getattr(hf, n, None) for n in _SPECIAL_TOKEN_NAMES}
        super().__init__(
            hf.backend_tokenizer,
            templates,
            {n: v for n, v in specials.items() if isinstance(v, str)},
            name=str(folder),
            fingerprint_of=fingerprint_of + type(hf).__name__.encode(),
        )
        self.hf = hf
        # a template only a processor file holds: transformers' tokenizer would have none
        self._template_given = not hf.chat_template

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, generation: bool = True
    ) -> str:
        """The conversation as `apply_chat_template` renders it."""
        template = pick_template(self.templates, tools) if self._template_given else None
        text = self.hf.apply_chat_template(
            server_messages(messages),
            tools=tools or None,
            add_generation_prompt=generation,
            tokenize=False,
            chat_template=template,
        )
        assert isinstance(text, str)
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, as `apply_chat_template(tokenize=True)` makes them."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens kept."""
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def decode_batch(self, lists: Sequence[Sequence[int]]) -> list[str]:
        """Texts of many id lists at once, special tokens kept (as `decode` gives them)."""
        return self.hf.batch_decode([list(ids) for ids in lists], skip_special_tokens=False)


def _arguments_as_object(call: Any) -> Any:
    """A tool call with its JSON `arguments` string parsed into an object (what vLLM and
    `transformers serve` hand templates); anything else unchanged."""
    if not isinstance(call, Mapping):
        return call
    function = call.get("function")
    target = function if isinstance(function, Mapping) else call
    arguments = target.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return call
    if isinstance(function, Mapping):
        return {**call, "function": {**function, "arguments": parsed}}
    return {**call, "arguments": parsed}


def server_messages(messages: list[dict]) -> list[dict]:
    """Messages as inference servers hand them to a model's template: text content parts
    joined into one string, tool-call arguments parsed into objects."""
    out = []
    for message in messages:
        message = dict(message)
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            message["content"] = content_text(content)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_arguments_as_object(c) for c in calls]
        out.append(message)
    return out


def transformers_installed() -> bool:
    """Whether transformers can be imported here."""
    return importlib.util.find_spec("transformers") is not None


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _model_specific(folder: Path, config: Mapping[str, Any]) -> str | None:
    """Why transformers may build this folder's tokenizer otherwise than its tokenizer.json
    says (a model-specific class), or None."""
    tokenizer_class = config.get("tokenizer_class")
    if tokenizer_class not in GENERIC_CLASSES:
        return f"its tokenizer_class is {tokenizer_class}"
    model_config = folder / "config.json"
    if model_config.is_file():
        try:
            model_type = json.loads(model_config.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        if isinstance(model_type, str):
            return f"its config.json names model_type {model_type!r}"
    return None


@lru_cache(maxsize=8)
def load_chat_tokenizer(path: str | None = None, use_transformers: bool | None = None):
    """The chat tokenizer at `path`: a Hugging Face tokenizer folder, a bare tokenizer.json
    (ChatML), or `bundled`/None for the bundled tokenizer (ChatML). A folder is loaded
    through transformers when it is installed (`use_transformers` None) or asked for;
    ValueError in one line when a folder has no chat template, or would be tokenized
    otherwise than a server does."""
    if is_bundled(path):
        return ChatTokenizer(load_tokenizer())
    assert path is not None
    folder = Path(path)
    if not folder.is_dir():
        return ChatTokenizer(load_tokenizer(path), name=path)
    templates = folder_templates(folder)
    raw = (folder / "tokenizer.json").read_bytes() if (folder / "tokenizer.json").is_file() else b""
    if use_transformers is None:
        use_transformers = transformers_installed()
    if use_transformers:
        return TransformersChatTokenizer(folder, templates, raw)
    config: dict[str, Any] = {}
    if (folder / CONFIG_FILE).is_file():
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
    why = _model_specific(folder, config)
    if why is not None:
        raise ValueError(
            f"{folder}: {why}, so transformers builds its normalizer and pre-tokenizer itself "
            f"and they may differ from tokenizer.json; {INSTALL_HINT} to tokenize as the "
            "server does"
        )
    if not raw:
        raise ValueError(f"{folder}: has no tokenizer.json")
    specials = {n: t for n in _SPECIAL_TOKEN_NAMES if (t := _token_text(config.get(n)))}
    return ChatTokenizer(
        load_tokenizer(str(folder)),
        templates,
        {"bos_token": "", "eos_token": "", **specials},
        name=str(folder),
        fingerprint_of=raw,
    )
