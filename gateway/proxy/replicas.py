"""Several inference replicas behind one gateway (`CLAW_UPSTREAM_URL` = comma-separated URLs):
a trajectory sticks to one replica while it is healthy, so that replica's prefix cache serves
its next turns; new trajectories go to the replica with the fewest calls in flight; a replica
that fails is skipped for a while and its trajectories move (the step says so).

The routing key of a call: its trajectory (scoped, or continued by `previous_response_id`),
else the conversation's root (its messages up to the first user message: every turn of an
unscoped conversation, and the rollouts of one prompt, share it), else nothing (balanced).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pydantic_core

from gateway.proxy.upstream import Upstream

STICKY_CAPACITY = 200_000  # routing keys remembered (least recently used forgotten)
DOWN_FIRST_S = 2.0  # a failed replica is skipped this long, doubling while it keeps failing
DOWN_MAX_S = 30.0


@dataclass(slots=True)
class Replica:
    """One upstream replica and what the router knows of it."""

    upstream: Upstream
    in_flight: int = 0
    served: int = 0
    failures: int = 0  # in a row
    down_until: float = 0.0
    last_error: str | None = None

    @property
    def url(self) -> str:
        """Its base URL."""
        return self.upstream.base_url

    def healthy(self, now: float) -> bool:
        """Not skipped right now."""
        return now >= self.down_until

    def release(self) -> None:
        """A call on it ended."""
        self.in_flight -= 1


def routing_key(trajectory_uid: str | None, body: dict[str, Any]) -> str | None:
    """What keeps a call on its replica: the trajectory, else the conversation's root."""
    if trajectory_uid is not None:
        return "t:" + trajectory_uid
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        end = next(
            (
                i + 1
                for i, m in enumerate(messages)
                if isinstance(m, dict) and m.get("role") == "user"
            ),
            len(messages),
        )
        root = pydantic_core.to_json(messages[:end])
    elif isinstance(prompt := body.get("prompt"), str):
        root = prompt[:512].encode()
    else:
        return None
    return "c:" + hashlib.blake2b(root, digest_size=12).hexdigest()


class Replicas:
    """The upstream replicas and the sticky routing of calls among them."""

    def __init__(self, urls: list[str], timeout_s: float = 600.0, client: str = "http1") -> None:
        if not urls:
            raise ValueError("no upstream URL")
        self.replicas = [Replica(Upstream(url, timeout_s, client)) for url in urls]
        self._sticky: OrderedDict[str, Replica] = OrderedDict()

    @classmethod
    def from_setting(cls, value: str, timeout_s: float = 600.0, client: str = "http1") -> Replicas:
        """Replicas of `CLAW_UPSTREAM_URL` (one URL, or several separated by commas)."""
        return cls(upstream_urls(value), timeout_s, client)

    def __len__(self) -> int:
        return len(self.replicas)

    @property
    def base_url(self) -> str:
        """The first replica's URL (for logs)."""
        return self.replicas[0].url

    def refuses_token_ids(self, stream: bool) -> None:
        """Every replica refuses `return_token_ids` (known at start)."""
        for replica in self.replicas:
            replica.upstream.refuses_token_ids(stream)

    def route(
        self, key: str | None, avoid: tuple[Replica, ...] = ()
    ) -> tuple[Replica, Replica | None]:
        """The replica for a call, and the one its key was on when it moves (else None)."""
        replicas = self.replicas
        if len(replicas) == 1:
            return replicas[0], None
        now = time.monotonic()
        before = self._sticky.get(key) if key is not None else None
        if before is not None and before not in avoid and before.healthy(now):
            self._sticky.move_to_end(key)
            return before, None
        candidates = [r for r in replicas if r not in avoid and r.healthy(now)]
        if candidates:
            chosen = min(candidates, key=lambda r: (r.in_flight, r.served))
        else:  # every replica is skipped: try the one whose pause ends first
            chosen = min((r for r in replicas if r not in avoid), key=lambda r: r.down_until)
        if key is not None:
            self._sticky[key] = chosen
            self._sticky.move_to_end(key)
            if len(self._sticky) > STICKY_CAPACITY:
                self._sticky.popitem(last=False)
        return chosen, before if before is not chosen else None

    def failed(self, replica: Replica, reason: str) -> None:
        """Skip a replica that failed for a while (doubling while it keeps failing)."""
        replica.failures += 1
        replica.last_error = reason
        pause = min(DOWN_MAX_S, DOWN_FIRST_S * 2 ** (replica.failures - 1))
        replica.down_until = time.monotonic() + pause

    def succeeded(self, replica: Replica) -> None:
        """A replica answered: it is healthy again."""
        replica.served += 1
        if replica.failures:
            replica.failures, replica.down_until = 0, 0.0

    def describe(self) -> list[dict[str, Any]]:
        """Each replica's state, as /readyz shows it: `up`, `down` (skipped) or `retrying`
        (failed last time, its pause over: the next call tries it again)."""
        now = time.monotonic()
        trajectories: dict[int, int] = {}
        for replica in self._sticky.values():
            trajectories[id(replica)] = trajectories.get(id(replica), 0) + 1
        return [
            {
                "url": r.url,
                "state": "up" if not r.failures else "down" if not r.healthy(now) else "retrying",
                "in_flight": r.in_flight,
                "served": r.served,
                "trajectories": trajectories.get(id(r), 0),
                "failures_in_a_row": r.failures,
                "last_error": r.last_error,
            }
            for r in self.replicas
        ]

    async def aclose(self) -> None:
        """Close every replica's connections."""
        for replica in self.replicas:
            await replica.upstream.aclose()


def upstream_urls(value: str) -> list[str]:
    """The URLs of `CLAW_UPSTREAM_URL` (comma-separated)."""
    return [url.strip() for url in value.split(",") if url.strip()]
