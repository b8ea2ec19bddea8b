"""Recent event ids: a retried request is acknowledged again and stored once."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable


class IdempotencyIndex:
    """Bounded memory of event ids that are durable, plus those being made durable now."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._durable: OrderedDict[str, None] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[None]] = {}

    def __len__(self) -> int:
        return len(self._durable)

    def __contains__(self, event_id: str) -> bool:
        return event_id in self._durable

    def remember(self, event_ids: Iterable[str]) -> None:
        """Mark ids as durable (oldest forgotten first beyond capacity)."""
        if self.capacity <= 0:
            return
        durable = self._durable
        for event_id in event_ids:
            durable[event_id] = None
        while len(durable) > self.capacity:
            durable.popitem(last=False)

    def claim(self, event_ids: list[str]) -> tuple[list[int], list[asyncio.Future[None]]]:
        """Split a request's ids into positions to write now and writes of others to await.

        Ids already durable, already claimed in this request, or in flight elsewhere are not
        written again; the futures of in-flight ones are returned to wait on.
        """
        fresh: list[int] = []
        waits: list[asyncio.Future[None]] = []
        seen: set[str] = set()
        for position, event_id in enumerate(event_ids):
            if event_id in seen or event_id in self._durable:
                continue
            seen.add(event_id)
            inflight = self._inflight.get(event_id)
            if inflight is not None:
                waits.append(inflight)
            else:
                fresh.append(position)
        return fresh, waits

    def begin(self, event_ids: list[str], future: asyncio.Future[None]) -> None:
        """Register ids as being written by one request."""
        for event_id in event_ids:
            self._inflight[event_id] = future

    def finish(self, event_ids: list[str], ok: bool) -> None:
        """The write of these ids ended: durable when `ok`, forgotten otherwise."""
        for event_id in event_ids:
            self._inflight.pop(event_id, None)
        if ok:
            self.remember(event_ids)
