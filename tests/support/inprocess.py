"""The gateway served in-process: the real app and its route table over httpx.ASGITransport,
with the durable landing replaced by one that holds records in memory. For tests of
validation and routing, which need no WAL, syncer or flusher process (durability is tested
against real processes elsewhere)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx

from claw_pipelines.settings import ClawSettings
from gateway.main import create_app
from gateway.records import BronzeRecord


@dataclass
class _Lake:
    uri: str


@dataclass
class HeldLanding:
    """Accepts every record into `records` (no duplicates check, no disk)."""

    settings: ClawSettings
    records: list[BronzeRecord] = field(default_factory=list)
    ready: bool = False
    policy_version: int | None = None

    def __post_init__(self) -> None:
        self.gateway_id = self.settings.gateway_id
        self.lake = _Lake(self.settings.lake_uri)

    async def start(self) -> None:
        self.ready = True

    async def stop(self) -> None:
        self.ready = False

    async def land(self, records: list[BronzeRecord]) -> tuple[int, int]:
        self.records.extend(records)
        return len(records), 0

    def backlog(self) -> dict[str, int]:
        return {"bytes": 0, "sealed_segments": 0, "open_records": 0}

    def flusher_status(self) -> dict:
        return {"alive": True}


@asynccontextmanager
async def served(settings: ClawSettings) -> AsyncIterator[tuple[httpx.AsyncClient, HeldLanding]]:
    """A started in-process gateway: a client to it, and the landing holding what it took."""
    landing = HeldLanding(settings)
    app = create_app(settings, landing=landing)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield client, landing
