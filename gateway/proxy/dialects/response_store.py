"""The conversations behind response ids, so `previous_response_id` resolves after a restart.

A response's step record keeps, beside the request and the answer, `conversation`: the chat
messages it continued (without `instructions`) and its reply as a chat message. Memory keeps
recent ones; a response it does not have is read back from the WAL (open, then sealed
segments) and then bronze (records received in the last `RETENTION_DAYS`), like token-in's
turns (gateway.proxy.token_history). A response is added only once its step is durable.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pydantic_core

from claw_pipelines.contracts.access import DEFAULT_TENANT
from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.lake.delta import Lake
from gateway.proxy.capture import CHAT_KIND
from gateway.proxy.token_history import wal_records

CAPACITY = 50_000  # responses kept in memory
RETENTION_DAYS = 30  # how far back bronze is searched (OpenAI keeps stored responses 30 days)


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A recorded response: where its step went, and the conversation it ends."""

    response_id: str
    trajectory_uid: str
    step_index: int
    prompt_uid: str | None
    conversation: list[dict[str, Any]]  # the chat messages it answered (no instructions)
    reply: dict[str, Any]  # its answer as a chat assistant message
    tenant: str = DEFAULT_TENANT  # whose call it was: only that tenant's calls continue it

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The whole conversation up to and including the reply."""
        return [*self.conversation, self.reply]


def reply_message(output: dict[str, Any]) -> dict[str, Any]:
    """A chat answer's message as the next turn sends it back (role, content, tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": output.get("content")}
    if output.get("tool_calls"):
        message["tool_calls"] = [
            {"id": c.get("id"), "type": "function", "function": c.get("function")}
            for c in output["tool_calls"]
            if isinstance(c, dict)
        ]
    return message


def _stored(payload: dict[str, Any], tenant: str) -> StoredResponse | None:
    response = payload.get("response")
    conversation = payload.get("conversation")
    if not isinstance(response, dict) or not isinstance(conversation, dict):
        return None
    messages, reply = conversation.get("messages"), conversation.get("reply")
    uid, index = payload.get("trajectory_uid"), payload.get("step_index")
    if not (isinstance(messages, list) and isinstance(reply, dict) and isinstance(uid, str)):
        return None
    if not isinstance(index, int):
        return None
    prompt_uid = payload.get("prompt_uid")
    return StoredResponse(response["id"], uid, index, prompt_uid, messages, reply, tenant)


def find_recorded(
    response_id: str, wal_dir: Path, lake: Lake, since: dt.date
) -> StoredResponse | None:
    """A response's record, from the WAL and then bronze."""
    needle = f'"response_id":"{response_id}"'
    for record in wal_records(wal_dir) if wal_dir.is_dir() else ():
        if record.kind == CHAT_KIND and needle.encode() in record.payload:
            found = _stored(pydantic_core.from_json(record.payload), record.tenant)
            if found is not None and found.response_id == response_id:
                return found
    rows = lake.read(
        BRONZE_EVENTS,
        columns=["payload", "tenant"],
        where=(pl.col("ingest_date") >= since)
        & (pl.col("kind") == CHAT_KIND)
        & pl.col("payload").str.contains(needle, literal=True),
    )
    for payload, tenant in rows.iter_rows():
        found = _stored(pydantic_core.from_json(payload), tenant)
        if found is not None and found.response_id == response_id:
            return found
    return None


class ResponseStore:
    """Recorded responses by id: memory first (least recently used forgotten past
    `capacity`), then the WAL and bronze."""

    def __init__(self, wal_dir: Path, lake: Lake, capacity: int = CAPACITY) -> None:
        self.wal_dir = wal_dir
        self.lake = lake
        self.capacity = capacity
        self._recent: OrderedDict[str, StoredResponse] = OrderedDict()

    def add(self, stored: StoredResponse) -> None:
        """Keep a response whose step is durable."""
        self._recent[stored.response_id] = stored
        self._recent.move_to_end(stored.response_id)
        if len(self._recent) > self.capacity:
            self._recent.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        """The recorded response of an id (None when none was recorded here)."""
        found = self._recent.get(response_id)
        if found is not None:
            self._recent.move_to_end(response_id)
            return found
        if not response_id.isascii() or '"' in response_id or "\\" in response_id:
            return None
        since = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=RETENTION_DAYS)
        found = await asyncio.to_thread(find_recorded, response_id, self.wal_dir, self.lake, since)
        if found is not None:
            self.add(found)
        return found
