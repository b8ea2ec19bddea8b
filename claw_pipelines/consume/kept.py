"""What a dataset keeps of what it read: one value and the key it stands for.

The key is what the value was computed from, usually the versions of the Delta tables it was
read from: while they have not moved the value is given back, else it is made (read) again.
Only the newest value is kept; `entry` gives it with its key to whoever brings it up to date
(the lineage rows read by their change feed).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Kept(Generic[K, V]):
    """One value kept with its key: `get(key, make)` gives it back while the key is the same,
    else keeps and gives `make()`; `put` keeps a value made elsewhere (a value may be None)."""

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[K, V] | None = None

    def __repr__(self) -> str:
        return "Kept()" if self._entry is None else f"Kept(key={self._entry[0]!r})"

    @property
    def entry(self) -> tuple[K, V] | None:
        """(key, value) as last kept, or None before the first."""
        return self._entry

    def holds(self, key: K) -> bool:
        """Whether the value kept stands for `key`."""
        return self._entry is not None and self._entry[0] == key

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The value kept for `key`, or `make()` kept for it."""
        if self._entry is not None and self._entry[0] == key:
            return self._entry[1]
        return self.put(key, make())

    def put(self, key: K, value: V) -> V:
        """Keep `value` for `key` (replacing what was kept); returns it."""
        self._entry = (key, value)
        return value
