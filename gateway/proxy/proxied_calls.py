"""The calls this gateway proxied lately, by the upstream's response id, so a traced span of
the same call joins its step instead of landing it twice (docs/DESIGN.md §4).

An agent that is both proxied and traced sends each call twice: to the proxy, which records
the step with its exact ids before it answers, and seconds later (its span processor's
batch) as a span. The span then adds what the proxy could not know (its rewards, its
trace's other spans) to the proxied step and its trajectory. Kept in memory, bounded: a
span of a call proxied by another gateway, or longer ago than the book holds, lands as its
own step (the limit docs/DESIGN.md §4 states).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

CAPACITY = 100_000  # calls, and as many traced trajectories, kept (about 20 MB)


class ProxiedCalls:
    """(tenant, response id) -> the step key of the call's first choice; and, once a span
    joined one, its traced trajectory -> the proxied step's trajectory. Least recently used
    forgotten past `capacity`; safe to use from the event loop and worker threads."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._steps: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._trajectories: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, tenant: str, response_id: str | None, step_key: str) -> None:
        """Keep a durable proxied step (the first choice's, when a call has several)."""
        if response_id:
            self._put(self._steps, (tenant, response_id), step_key, replace=False)

    def step_of(self, tenant: str, response_id: str | None) -> str | None:
        """The step key of the proxied call with this response id, if this gateway has it."""
        if not response_id:
            return None
        with self._lock:
            return self._steps.get((tenant, response_id))

    def join(self, tenant: str, traced_trajectory: str, step_key: str) -> None:
        """A traced trajectory's call is the proxied step `step_key`: the trajectory's other
        facts go to that step's trajectory."""
        proxied = step_key.rsplit(":", 1)[0]
        self._put(self._trajectories, (tenant, traced_trajectory), proxied, replace=True)

    def trajectory_of(self, tenant: str, traced_trajectory: str) -> str:
        """Where a traced trajectory's facts go: the proxied trajectory it joined, or itself."""
        with self._lock:
            return self._trajectories.get((tenant, traced_trajectory), traced_trajectory)

    def _put(self, book: OrderedDict, key: tuple[str, str], value: str, replace: bool) -> None:
        with self._lock:
            if replace or key not in book:
                book[key] = value
            book.move_to_end(key)
            if len(book) > self.capacity:
                book.popitem(last=False)
