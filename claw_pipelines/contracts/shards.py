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
