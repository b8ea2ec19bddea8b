"""Deadlines of request-body reads: one sweeper task for all of them, not a timer per read.

A read registers its task and deadline (a dict entry, well under a microsecond); every `tick`
the sweeper cancels the reads past their deadline, and the read turns that cancellation into
a 408 (gateway.incoming.read_body). `asyncio.timeout` around each read cost ~12 us a request
on the ingest path (its own timer handle, scheduled and cancelled). A read is cut between its
deadline and one tick later; the tick is a quarter of the timeout, at most MAX_TICK_S.
"""

from __future__ import annotations

import asyncio

MAX_TICK_S = 1.0


class ReadDeadlines:
    """The body reads in flight and their deadlines; a sweeper cuts the late ones."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.tick = min(MAX_TICK_S, timeout_s / 4)
        self._reads: dict[asyncio.Task, float] = {}
        self._cut: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None

    def watch(self) -> asyncio.Task:
        """Start the deadline of the current task's read; returns the task."""
        task = asyncio.current_task()
        loop = task.get_loop()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep(), name="claw-read-deadlines")
        self._reads[task] = loop.time() + self.timeout_s
        return task

    def done(self, task: asyncio.Task) -> None:
        """The read of `task` ended (received, refused or cut)."""
        self._reads.pop(task, None)

    def was_cut(self, task: asyncio.Task) -> bool:
        """Whether the cancellation `task` received is the sweeper's (its read was late);
        if so, the cancellation is withdrawn: the read ends with a 408 instead."""
        if task not in self._cut:
            return False
        self._cut.discard(task)
        task.uncancel()
        return True

    def stop(self) -> None:
        """Stop the sweeper (the app is shutting down)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.tick)
            now = loop.time()
            late = [task for task, deadline in self._reads.items() if deadline <= now]
            for task in late:
                del self._reads[task]
                self._cut.add(task)
                task.cancel()
