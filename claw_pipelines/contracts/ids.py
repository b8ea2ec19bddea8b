"""Identifiers: time-ordered event ids and step keys."""

from __future__ import annotations

import random
import time

_random = random.Random()  # seeded from os.urandom; ids need uniqueness, not secrecy


def new_event_id() -> str:
    """A time-ordered UUIDv7 string (48-bit Unix ms, random tail)."""
    ms = time.time_ns() // 1_000_000
    rand = _random.getrandbits(80)
    value = (ms & (2**48 - 1)) << 80 | rand & ((1 << 80) - 1)
    value = value & ~(0xF << 76) | (0x7 << 76)  # version 7
    value = value & ~(0x3 << 62) | (0x2 << 62)  # RFC 4122 variant
    text = f"{value:032x}"
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


def step_key(trajectory_uid: str, step_index: int) -> str:
    """The unique key of a step: `"{trajectory_uid}:{step_index}"`."""
    return f"{trajectory_uid}:{step_index}"
