"""A step's token ids back in the model's own language: chat messages for SFT and preference
exports, judges and the dashboard, decoded with the tokenizer the step's ids belong to.

A step names its tokenizer in `metadata.tokenizer` (silver's and gold's `tokenizer` column:
its fingerprint), kept in the lake by claw_pipelines.lake.tokenizers. A prompt becomes
messages by reading its text back with the chat template (`MessageReader`): what the template
writes around a message of each role is learned by rendering markers in that role, the text
is cut along it, and the reading is kept only when rendering the messages again gives the
text exactly. Where it cannot be read (a template that merges turns, as Mistral's merges the
system prompt into the last user turn; tools), the messages the step's request recorded are
used when they render to the text. A reply is the response decoded, its end-of-turn token
dropped. Nothing else is guessed: a step that cannot be read is refused, naming why, and a
message never has a null role or content.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import polars as pl

from claw_pipelines.contracts.errors import Undecodable
from claw_pipelines.contracts.tables import SILVER_STEPS
from claw_pipelines.lake.delta import Lake
from claw_pipelines.lake.tokenizers import tokenizer_of
from claw_pipelines.tokenization import IM_END, IM_START, ChatTokenizer, load_chat_tokenizer

ROLES = ("system", "user", "assistant", "tool")
MAX_TURNS = 1024


def _marker(i: int) -> str:
    """The content standing for message i while a template's layout is learned: private-use
    characters, which no template writes itself."""
    return f"\ue000{i}\ue001"


@dataclass(frozen=True, slots=True)
class Decoded:
    """A step's conversation: its prompt's messages, and how they were had."""

    messages: list[dict[str, Any]]
    via: str  # "template" (read with the chat template) or "recorded" (its request's)


class MessageReader:
    """Reads rendered conversations of one chat tokenizer back into messages."""

    def __init__(self, chat: ChatTokenizer) -> None:
        self.chat = chat
        self._layouts: dict[tuple[str, ...], tuple[str, str] | None] = {}
        self._tails: dict[tuple[str, ...], str | None] = {}

    def _render(self, messages: list[dict], generation: bool) -> str | None:
        try:
            return self.chat.render(messages, None, generation)
        except Exception:  # a template refuses some conversations (roles out of order, ...)
            return None

    def _layout(self, roles: tuple[str, ...]) -> tuple[str, str] | None:
        """What the template writes before and after the content of the last of `roles`
        (following the others), learned with markers; None where it refuses the roles."""
        if roles not in self._layouts:
            marked = [{"role": r, "content": _marker(i)} for i, r in enumerate(roles)]
            before = self._render(marked[:-1], False) if len(roles) > 1 else ""
            after = self._render(marked, False)
            last = _marker(len(roles) - 1)
            layout = None
            if before is not None and after is not None and after.startswith(before):
                prefix, found, suffix = after[len(before) :].partition(last)
                if found and "\ue000" not in prefix + suffix:
                    layout = (prefix, suffix)
            self._layouts[roles] = layout
        return self._layouts[roles]

    def _tail(self, roles: tuple[str, ...]) -> str | None:
        """What the generation prompt adds after a conversation of `roles`."""
        if roles not in self._tails:
            marked = [{"role": r, "content": _marker(i)} for i, r in enumerate(roles)]
            plain, asked = self._render(marked, False), self._render(marked, True)
            ok = plain is not None and asked is not None and asked.startswith(plain)
            self._tails[roles] = asked[len(plain) :] if ok else None
        return self._tails[roles]

    def read(self, text: str) -> list[dict[str, str]] | None:
        """The messages whose rendering with the generation prompt is exactly `text`, or
        None. At each point the role whose layout starts the rest of the text is taken (the
        longest when several do), its content running to what the template writes after
        it; the reading ends where only the generation prompt is left, and is kept only if
        rendering it gives `text` back."""
        messages: list[dict[str, str]] = []
        roles: tuple[str, ...] = ()
        at = 0
        for _ in range(MAX_TURNS):
            tail = self._tail(roles) if roles else None
            if tail is not None and text[at:] == tail:
                return messages if self._render(messages, True) == text else None
            best: tuple[int, str, int, int, int] | None = None
            for role in ROLES:
                layout = self._layout((*roles, role))
                if layout is None or not text.startswith(layout[0], at):
                    continue
                prefix, suffix = layout
                start = at + len(prefix)
                end = text.find(suffix, start) if suffix else len(text)
                if end >= 0 and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), role, start, end, end + len(suffix))
            if best is None:
                return None
            _, role, start, end, at = best
            messages.append({"role": role, "content": text[start:end]})
            roles = (*roles, role)
        return None

    def renders(self, messages: Any, tools: Any, text: str) -> bool:
        """Whether recorded messages (and tools) render exactly to `text`."""
        if not complete(messages):
            return False
        try:
            return self.chat.render(messages, tools, True) == text
        except Exception:
            return False


def complete(messages: Any) -> bool:
    """Whether messages each have a role and some content (or tool calls): never a null."""
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and (isinstance(m.get("content"), str) or bool(m.get("tool_calls")))
            for m in messages
        )
    )


def prompt_messages(
    reader: MessageReader, step_key: str, text: str, recorded: dict[str, Any] | None
) -> Decoded:
    """A prompt's messages: its request's when they render to the prompt's text, else the
    text read with the template; Undecodable otherwise."""
    messages = recorded.get("messages") if isinstance(recorded, dict) else None
    tools = recorded.get("tools") if isinstance(recorded, dict) else None
    if messages is not None and reader.renders(messages, tools, text):
        return Decoded(messages, "recorded")
    read = reader.read(text)
    if read is not None:
        return Decoded(read, "template")
    why = "renders otherwise" if messages is not None else "was not kept"
    raise Undecodable(
        f"step {step_key}: its prompt does not read back into messages with its tokenizer "
        f"({reader.chat.name}), and its request {why}"
    )


# -- many steps at once ----------------------------------------------------------------------

CHATML_TURN = r"<\|im_start\|>(?s:.*?)<\|im_end\|>\n"
GENERATION = IM_START + "assistant\n"
MESSAGE = pl.Struct({"role": pl.String, "content": pl.String})


def is_chatml(reader: MessageReader) -> bool:
    """Whether the template lays turns out as plain ChatML (`<|im_start|>role\\ncontent
    <|im_end|>\\n`, the generation prompt `<|im_start|>assistant\\n`): then prompts are read
    for many steps at once, each reading still checked against its text."""
    roles = ("system", "user", "assistant", "user")
    marked = [{"role": r, "content": _marker(i)} for i, r in enumerate(roles)]
    expected = "".join(f"{IM_START}{r}\n{_marker(i)}{IM_END}\n" for i, r in enumerate(roles))
    return reader._render(marked, True) == expected + GENERATION


def chatml_messages(texts: pl.Series) -> tuple[pl.Series, pl.Series]:
    """(the ChatML turns of prompt texts as messages, whether each reading renders back to
    its text exactly), vectorized."""
    turn = pl.element().str.strip_suffix("\n").str.strip_suffix(IM_END)
    frame = pl.DataFrame({"text": texts}).with_columns(
        messages=pl.col("text")
        .str.extract_all(CHATML_TURN)
        .list.eval(
            pl.struct(
                role=turn.str.extract(r"^<\|im_start\|>([^\n]*)\n"),
                content=turn.str.extract(r"^<\|im_start\|>[^\n]*\n((?s:.*))$"),
            )
        )
    )
    rebuilt = pl.col("messages").list.eval(
        pl.concat_str(
            pl.lit(IM_START),
            pl.element().struct.field("role"),
            pl.lit("\n"),
            pl.element().struct.field("content"),
            pl.lit(IM_END + "\n"),
        )
    )
    checked = frame.select(
        "messages",
        exact=(rebuilt.list.join("") + pl.lit(GENERATION) == pl.col("text")).fill_null(False)
        & (pl.col("messages").list.len() > 0),
    )
    return checked["messages"], checked["exact"]


def decode_steps(
    steps: pl.DataFrame,
    resolve: Callable[[str | None], ChatTokenizer | None],
    recorded: dict[str, dict[str, Any]],
) -> pl.DataFrame:
    """Per step (`step_key`, `prompt_ids`, `response_ids`, `tokenizer`), its prompt's
    messages, its reply and `decoded_with` ({name, fingerprint, via}); `resolve` gives a
    fingerprint's tokenizer (None where unknown or not held), `recorded` a step's kept request
    (`messages`, `tools`, `reply`). Undecodable for the first step that cannot be decoded."""
    if "tokenizer" not in steps.columns:  # written before steps named their tokenizer
        steps = steps.with_columns(tokenizer=pl.lit(None, pl.String))
    parts = []
    for (fingerprint,), group in steps.group_by("tokenizer", maintain_order=True):
        chat = resolve(fingerprint)
        parts.append(_decode_group(group, chat, fingerprint, recorded))
    if not parts:
        return pl.DataFrame(
            schema={
                "step_key": pl.String,
                "prompt_messages": pl.List(MESSAGE),
                "reply": MESSAGE,
                "decoded_with": pl.Struct(
                    {"name": pl.String, "fingerprint": pl.String, "via": pl.String}
                ),
            }
        )
    order = steps.select("step_key").with_row_index("order")
    return pl.concat(parts).join(order, on="step_key").sort("order").drop("order")


def _decode_group(
    group: pl.DataFrame,
    chat: ChatTokenizer | None,
    fingerprint: str | None,
    recorded: dict[str, dict[str, Any]],
) -> pl.DataFrame:
    """The steps of one tokenizer (see decode_steps): plain ChatML read for all at once,
    each reading checked; the rest, and steps with a kept request, one by one."""
    keys = group["step_key"].to_list()
    if chat is None:
        return _recorded_only(keys, fingerprint, recorded)
    reader = MessageReader(chat)
    texts = chat.decode_lists(group["prompt_ids"].to_arrow())
    replies = chat.decode_lists(group["response_ids"].to_arrow())
    if chat.eos_token:
        replies = replies.str.strip_suffix(chat.eos_token)
    kept = pl.Series([k in recorded for k in keys], dtype=pl.Boolean)
    if is_chatml(reader):
        read, exact = chatml_messages(texts)
        done = exact & ~kept
    else:
        read, done = pl.Series([None] * len(keys), dtype=pl.List(MESSAGE)), kept & False
    frame = pl.DataFrame(
        {
            "step_key": keys,
            "prompt_messages": read.cast(pl.List(MESSAGE)),
            "reply": replies,
            "via": pl.Series(["template"] * len(keys)),
            "done": done,
        }
    )
    pending = frame.filter(~pl.col("done"))
    if pending.height:
        texts_of = dict(zip(keys, texts.to_list(), strict=True))
        read_one = [
            prompt_messages(reader, key, texts_of[key], recorded.get(key))
            for key in pending["step_key"]
        ]
        pending = pending.with_columns(
            prompt_messages=pl.Series(
                [[_message(m) for m in d.messages] for d in read_one], dtype=pl.List(MESSAGE)
            ),
            via=pl.Series([d.via for d in read_one], dtype=pl.String),
        )
        order = frame.select("step_key").with_row_index("order")
        frame = (
            pl.concat([frame.filter(pl.col("done")), pending])
            .join(order, on="step_key")
            .sort("order")
            .drop("order")
        )
    return frame.select(
        "step_key",
        "prompt_messages",
        reply=pl.struct(role=pl.lit("assistant"), content="reply"),
        decoded_with=pl.struct(
            name=pl.lit(chat.name), fingerprint=pl.lit(chat.fingerprint), via="via"
        ),
    )


def _message(message: dict[str, Any]) -> dict[str, str]:
    """A message as exported: role and text content (tool calls written as their JSON)."""
    content = message.get("content")
    if not isinstance(content, str):
        content = json.dumps(message.get("tool_calls"), ensure_ascii=False)
    return {"role": message["role"], "content": content}


def _recorded_only(
    keys: list[str], fingerprint: str | None, recorded: dict[str, dict[str, Any]]
) -> pl.DataFrame:
    """Steps whose tokenizer is unknown or not held: their recorded messages and reply."""
    prompts, replies = [], []
    for key in keys:
        kept = recorded.get(key) or {}
        reply = kept.get("reply")
        if not complete(kept.get("messages")) or not complete([reply] if reply else None):
            if fingerprint is None:
                missing = "names no tokenizer (give the model's: --tokenizer FOLDER)"
            else:
                missing = (
                    f"names tokenizer {fingerprint}, which this lake does not hold (give "
                    "the model's: --tokenizer FOLDER)"
                )
            raise Undecodable(f"step {key} {missing}, and its request was not kept")
        prompts.append([_message(m) for m in kept["messages"]])
        replies.append(_message(reply))
    return pl.DataFrame(
        {
            "step_key": keys,
            "prompt_messages": pl.Series(prompts, dtype=pl.List(MESSAGE)),
            "reply": pl.Series(replies, dtype=MESSAGE),
            "decoded_with": [
                {"name": None, "fingerprint": fingerprint, "via": "recorded"} for _ in keys
            ],
        }
    )


# -- where tokenizers and kept requests come from --------------------------------------------


def resolver(lake: Lake, fallback: str | None) -> Callable[[str | None], ChatTokenizer | None]:
    """A step tokenizer's fingerprint -> the tokenizer to decode with: the one the lake
    keeps; for steps naming none (or one the lake lacks but `fallback` is), the `fallback`
    folder (`--tokenizer`, CLAW_TOKENIZER)."""
    given = load_chat_tokenizer(fallback) if fallback is not None else None

    def resolve(fingerprint: str | None) -> ChatTokenizer | None:
        if fingerprint is None:
            return given
        if given is not None and given.fingerprint == fingerprint:
            return given
        return tokenizer_of(lake, fingerprint)

    return resolve


def recorded_requests(lake: Lake, steps: pl.DataFrame) -> dict[str, dict[str, Any]]:
    """The requests silver kept for these steps (`metadata.request`, and `metadata.reply`:
    `claw import --keep-request`), by step key."""
    if not lake.exists(SILVER_STEPS):
        return {}
    where = pl.col("step_key").is_in(steps["step_key"].unique().implode())
    if "policy_version" in steps.columns:  # a partition filter first: fewer files read
        where = pl.col("policy_version").is_in(steps["policy_version"].unique().implode()) & where
    rows = lake.read(SILVER_STEPS, columns=["step_key", "metadata"], where=where).filter(
        pl.col("metadata").str.contains('"request"', literal=True)
    )
    kept = {}
    for key, metadata in rows.iter_rows():
        data = json.loads(metadata)
        request = data.get("request")
        if isinstance(request, dict):
            kept[key] = {
                "messages": request.get("messages"),
                "tools": request.get("tools"),
                "reply": data.get("reply"),
            }
    return kept
