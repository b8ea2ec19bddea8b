"""Materializer shards: `Slot` (shard i of N) and which buckets of the shard key it owns
(docs/DESIGN.md §19)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

BUCKETS = 4096  # a shard key hashes to one of these; shard i of N owns bucket b when b % N == i
_SLOT = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


@dataclass(frozen=True, order=True)
class Slot:
    """Shard `index` of `count` (0 <= index < count)."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard: {self.index}/{self.count} is not i/N with 0 <= i < N")

    @classmethod
    def parse(cls, text: str) -> Slot:
        """A slot from "i/N" (e.g. "0/2")."""
        found = _SLOT.match(text)
        if found is None:
            raise ValueError(f"shard: {text!r} is not i/N (e.g. 0/2)")
        return cls(int(found.group(1)), int(found.group(2)))

    @property
    def lease_app_id(self) -> str:
        """The application id of the lease's own commits."""
        return f"claw.lease.{self.index}of{self.count}"

    @property
    def writer_app_id(self) -> str:
        """The application id every commit of the shard's writer carries at its token."""
        return f"claw.shard.{self.index}of{self.count}"

    @property
    def silver_app_id(self) -> str:
        """The application id of the shard's silver commits (its share of silver)."""
        return f"claw.silver.{self.index}of{self.count}"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, buckets: np.ndarray) -> np.ndarray:
        """Which of `buckets` (see `transforms.shards.buckets_of`) are this shard's."""
        return (buckets % self.count) == self.index

    def order_range(self) -> tuple[int, int] | None:
        """The shard orders (`shard_order`) of this shard's buckets as one range [low, high),
        when its count is a power of two (its buckets' low bits are its index, the high bits
        of their orders); None for other counts (their buckets' orders interleave)."""
        bits = self.count.bit_length() - 1
        if self.count != 1 << bits or bits > ORDER_BITS:
            return None
        span = 1 << (ORDER_BITS - bits)
        low = bit_reversed(np.array([self.index]), bits)[0] * span
        return int(low), int(low + span)


ORDER_BITS = BUCKETS.bit_length() - 1  # a bucket is this many bits
SHARD_ORDER = "shard_order"  # bronze's column of a step record's bucket, bits reversed


def bit_reversed(values: np.ndarray, bits: int = ORDER_BITS) -> np.ndarray:
    """Each value's low `bits` bits in reverse order: a bucket's `shard_order`, so that the
    buckets of shard i of 2^k (low k bits = i) have orders in one range."""
    values = values.astype(np.int64)
    out = np.zeros_like(values)
    for bit in range(bits):
        out |= ((values >> bit) & 1) << (bits - 1 - bit)
    return out
