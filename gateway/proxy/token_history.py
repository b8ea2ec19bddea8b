"""What token-in remembers of a trajectory: the exact ids (prompt + response) of every turn,
keyed by the conversation that led to it and its reply; and reading that back from the WAL
and bronze after a restart or once memory forgot it.

A turn's key is a chain hash: the tools, then each message (role, text, name, tool calls with
canonical JSON arguments) in order, the assistant's reply last. A next call whose messages
start with a recorded turn's conversation and reply continues that turn.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pydantic_core

from claw_pipelines.contracts.tables import BRONZE_EVENTS
from claw_pipelines.lake.delta import Lake
from gateway.proxy.capture import CHAT_KIND
from gateway.records import BronzeRecord
from gateway.wal.frames import read_segment
from gateway.wal.layout import open_segments, sealed_segments

log = logging.getLogger(__name__)
HISTORY_BYTES = 256 * 2**20  # token ids kept in memory, all trajectories together
DIGEST_SIZE = 16


def _digest(previous: bytes, part: Any) -> bytes:
    return hashlib.blake2b(previous + pydantic_core.to_json(part), digest_size=DIGEST_SIZE).digest()


def _canonical_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a value: JSON text parsed (so spacing and key order of the
    agent's echo do not matter), anything else as given."""
    if isinstance(arguments, str):
        try:
            return pydantic_core.from_json(arguments)
        except ValueError:
            return arguments
    return arguments


def message_key(message: Any) -> Any:
    """What of a message identifies it in a conversation (ids of tool calls aside)."""
    if not isinstance(message, dict):
        return message
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else {}
        function = function if isinstance(function, dict) else {}
        calls.append([function.get("name"), _canonical_arguments(function.get("arguments"))])
    return [message.get("role"), message.get("content") or "", message.get("name"), calls]


def conversation_chain(messages: Sequence[Any], tools: Any) -> list[bytes]:
    """The chain hash of every prefix of a conversation: `chain[i]` covers messages[: i + 1]."""
    chain, digest = [], _digest(b"", tools or None)
    for message in messages:
        digest = _digest(digest, message_key(message))
        chain.append(digest)
    return chain


def extend_chain(chain: Sequence[bytes], tools: Any, message: dict[str, Any]) -> bytes:
    """The chain hash of a conversation plus one more message (the reply)."""
    start = chain[-1] if chain else _digest(b"", tools or None)
    return _digest(start, message_key(message))


@dataclass(frozen=True, slots=True)
class Turn:
    """A recorded turn: its step, and the exact ids the model saw and sampled (int32)."""

    step_index: int
    ids: np.ndarray
    ended: bool  # the response ends with the end-of-turn (eos) token


@dataclass(slots=True)
class TrajectoryTokens:
    """A trajectory's recorded turns by key, and its newest step."""

    turns: dict[bytes, Turn] = field(default_factory=dict)
    last_step: int = -1
    nbytes: int = 0

    def add(self, key: bytes, turn: Turn) -> None:
        """Remember a turn (a key seen again keeps its first turn)."""
        if key not in self.turns:
            self.turns[key] = turn
            self.nbytes += turn.ids.nbytes
        self.last_step = max(self.last_step, turn.step_index)


class TokenHistory:
    """Recorded turns of scoped trajectories, least recently used forgotten past `max_bytes`
    of ids (a forgotten trajectory is read back from the WAL and bronze when it returns)."""

    def __init__(self, max_bytes: int = HISTORY_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._trajectories: OrderedDict[str, TrajectoryTokens] = OrderedDict()

    def get(self, trajectory_uid: str) -> TrajectoryTokens | None:
        """A trajectory's turns (None when not in memory)."""
        found = self._trajectories.get(trajectory_uid)
        if found is not None:
            self._trajectories.move_to_end(trajectory_uid)
        return found

    def add(self, trajectory_uid: str, key: bytes, turn: Turn) -> None:
        """Remember one turn of a trajectory."""
        tokens = self._trajectories.get(trajectory_uid)
        if tokens is None:
            tokens = self._trajectories[trajectory_uid] = TrajectoryTokens()
        before = tokens.nbytes
        tokens.add(key, turn)
        self.nbytes += tokens.nbytes - before
        self._trajectories.move_to_end(trajectory_uid)
        self._evict(keep=trajectory_uid)

    def merge(self, trajectory_uid: str, restored: TrajectoryTokens) -> TrajectoryTokens:
        """Add turns read back from storage to what memory has (memory's turns win)."""
        tokens = self._trajectories.setdefault(trajectory_uid, TrajectoryTokens())
        before = tokens.nbytes
        for key, turn in restored.turns.items():
            tokens.add(key, turn)
        tokens.last_step = max(tokens.last_step, restored.last_step)
        self.nbytes += tokens.nbytes - before
        self._trajectories.move_to_end(trajectory_uid)
        self._evict(keep=trajectory_uid)
        return tokens

    def _evict(self, keep: str) -> None:
        while self.nbytes > self.max_bytes and len(self._trajectories) > 1:
            uid, tokens = next(iter(self._trajectories.items()))
            if uid == keep:
                self._trajectories.move_to_end(uid)
                continue
            del self._trajectories[uid]
            self.nbytes -= tokens.nbytes


# -- reading turns back from storage -------------------------------------------------------


def _turn_of(
    metadata: Any, step_index: Any, prompt: np.ndarray, response: np.ndarray, eos_id: int
) -> tuple[bytes, Turn] | None:
    token_in = metadata.get("token_in") if isinstance(metadata, dict) else None
    history = token_in.get("history") if isinstance(token_in, dict) else None
    if not isinstance(history, str) or not isinstance(step_index, int):
        return None
    try:
        key = bytes.fromhex(history)
    except ValueError:
        return None
    ids = np.concatenate([prompt, response]).astype(np.int32, copy=False)
    ended = bool(response.size) and int(response[-1]) == eos_id
    return key, Turn(step_index, ids, ended)


def wal_records(directory: Path) -> list[BronzeRecord]:
    """The records still in the WAL, read in the order they move (open, sealed): a segment
    sealed or landed while we read is found in the next place we look."""
    records: list[BronzeRecord] = []
    for listing in (open_segments, sealed_segments):
        for path in listing(directory):
            try:
                records += read_segment(path)
            except FileNotFoundError:
                continue
    return records


def restore_trajectory(
    trajectory_uid: str, wal_dir: Path, lake: Lake, since: dt.date, eos_id: int
) -> TrajectoryTokens:
    """A trajectory's token-in turns and newest step, from the WAL and then bronze (steps
    received since `since`)."""
    restored = TrajectoryTokens()
    seen: set[str] = set()
    needle = trajectory_uid.encode()
    for record in wal_records(wal_dir) if wal_dir.is_dir() else ():
        if record.kind != CHAT_KIND or needle not in record.payload:
            continue
        payload = pydantic_core.from_json(record.payload)
        if payload.get("trajectory_uid") != trajectory_uid:
            continue
        seen.add(record.event_id)
        step_index = payload.get("step_index")
        if isinstance(step_index, int):
            restored.last_step = max(restored.last_step, step_index)
        prompt = np.frombuffer(record.prompt_ids or b"", "<i4")
        response = np.frombuffer(record.response_ids or b"", "<i4")
        found = _turn_of(payload.get("metadata"), step_index, prompt, response, eos_id)
        if found is not None:
            restored.add(*found)
    for row in _bronze_rows(trajectory_uid, lake, since, seen):
        restored.last_step = max(restored.last_step, row["step_index"])
        metadata = {"token_in": {"history": row["history"]}}
        prompt = np.asarray(row["prompt_ids"] or (), np.int32)
        response = np.asarray(row["response_ids"] or (), np.int32)
        found = _turn_of(metadata, row["step_index"], prompt, response, eos_id)
        if found is not None:
            restored.add(*found)
    return restored


def _bronze_rows(
    trajectory_uid: str, lake: Lake, since: dt.date, seen: set[str]
) -> list[dict[str, Any]]:
    rows = lake.read(
        BRONZE_EVENTS,
        columns=[
            "event_id",
            "step_index",
            "prompt_ids",
            "response_ids",
            pl.col("payload").str.json_path_match("$.metadata.token_in.history").alias("history"),
        ],
        where=(pl.col("ingest_date") >= since)
        & (pl.col("kind") == CHAT_KIND)
        & (pl.col("trajectory_uid") == trajectory_uid)
        & pl.col("step_index").is_not_null(),
    )
    return [row for row in rows.iter_rows(named=True) if row["event_id"] not in seen]
