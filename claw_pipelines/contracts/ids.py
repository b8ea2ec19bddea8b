"""Identifiers: time-ordered event ids and step keys."""

from __future__ import annotations

import os
import time
import uuid


def new_event_id() -> str:
    """A time-ordered UUIDv7 string (48-bit Unix ms, random tail)."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & (2**48 - 1)) << 80 | rand & ((1 << 80) - 1)
    value = value & ~(0xF << 76) | (0x7 << 76)  # version 7
    value = value & ~(0x3 << 62) | (0x2 << 62)  # RFC 4122 variant
    return str(uuid.UUID(int=value))


def step_key(trajectory_uid: str, step_index: int) -> str:
    """The unique key of a step: `"{trajectory_uid}:{step_index}"`."""
    return f"{trajectory_uid}:{step_index}"
