"""Where a scoped trajectory's step numbering resumes when this gateway process did not number
its earlier steps: the indices the WAL and bronze held when the process started (a restart),
and the turns a call's own history shows (a restart, or another gateway on the same lake).

A step key (`"{trajectory_uid}:{step_index}"`) goes to the client with the answer
(`X-Claw-Step-Keys`), so one index must never go to two calls. The process's own count
(`gateway.proxy.scope.TrajectoryBook`) starts from the larger of these; docs/DESIGN.md §4
says why these two and not a read of bronze per trajectory.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import polars as pl

from gateway.records import BronzeRecord

PROXIED_KINDS = ("chat_completion", "completion")  # the steps the gateway numbers
_EMPTY = pl.DataFrame(schema={"trajectory_uid": pl.String, "step_index": pl.Int64})


class RecordedSteps:
    """The next step index of every trajectory whose proxied steps the WAL or bronze held when
    this process started, kept as sorted 64-bit hashes of the trajectory uids beside the
    index after each one's newest step: 16 bytes a trajectory, a look-up in microseconds. Two
    uids sharing a hash share the larger index, which can skip indices, never repeat one."""

    def __init__(self) -> None:
        self._hashes = np.empty(0, np.int64)
        self._next = np.empty(0, np.int64)

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, steps: pl.DataFrame) -> None:
        """Take in rows of `trajectory_uid`, `step_index` (any number per trajectory)."""
        newest = (
            steps.select("trajectory_uid", pl.col("step_index").cast(pl.Int64))
            .drop_nulls()
            .group_by("trajectory_uid")
            .agg(pl.col("step_index").max())
        )
        if newest.is_empty():
            return
        uids = newest["trajectory_uid"].to_list()
        hashes = np.concatenate([self._hashes, np.fromiter(map(hash, uids), np.int64, len(uids))])
        nexts = np.concatenate([self._next, newest["step_index"].to_numpy() + 1])
        order = np.argsort(hashes, kind="stable")
        hashes, nexts = hashes[order], nexts[order]
        self._hashes, first = np.unique(hashes, return_index=True)
        self._next = np.maximum.reduceat(nexts, first)

    def next_step(self, trajectory_uid: str) -> int:
        """The index after the trajectory's newest recorded step (0: none recorded)."""
        if not len(self._hashes):
            return 0
        key = hash(trajectory_uid)
        at = int(np.searchsorted(self._hashes, key))
        if at < len(self._hashes) and self._hashes[at] == key:
            return int(self._next[at])
        return 0


def proxied_steps(bronze: pl.LazyFrame) -> pl.LazyFrame:
    """The newest `step_index` of each trajectory among bronze's proxied steps."""
    return (
        bronze.filter(pl.col("kind").is_in(PROXIED_KINDS) & pl.col("step_index").is_not_null())
        .group_by("trajectory_uid")
        .agg(pl.col("step_index").cast(pl.Int64).max())
    )


def wal_steps(records: Iterable[BronzeRecord]) -> pl.DataFrame:
    """The `trajectory_uid`, `step_index` of the proxied steps among WAL records (read from
    their payloads in one vectorized pass)."""
    payloads = [r.payload for r in records if r.kind in PROXIED_KINDS]
    if not payloads:
        return _EMPTY
    text = pl.Series("payload", payloads, pl.Binary).cast(pl.String)
    return pl.select(
        trajectory_uid=text.str.json_path_match("$.trajectory_uid"),
        step_index=text.str.json_path_match("$.step_index").cast(pl.Int64, strict=False),
    )


def turns_shown(body: dict[str, Any]) -> int:
    """How many earlier turns a chat call's history shows: its assistant messages, each the
    reply of one earlier call (a last assistant message is a reply being continued or
    prefilled, not a turn); 0 for a call without messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 0
    shown = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
    last = messages[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        shown -= 1
    return shown
