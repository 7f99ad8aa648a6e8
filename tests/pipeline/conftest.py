"""Pipeline test harness: a scripted model server, settings pointing at it, and a one-call runner."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from service.config import Settings
from service.pipeline.run import Outcome, run_request
from service.pipeline.runtime import PipelineDeps
from service.providers import build_provider
from service.providers.base import Provider
from service.store import queue
from service.store.db import Database
from service.store.events import Event, request_events_after
from service.store.models import RequestRow
from tests.factories import scripted_settings
from tests.scripted_provider import ScriptedServer


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    with ScriptedServer() as scripted:
        yield scripted


@pytest.fixture
def model_settings(database_url: str, server: ScriptedServer) -> Settings:
    return scripted_settings(database_url, server.base_url)


@pytest.fixture
async def provider(model_settings: Settings) -> AsyncIterator[Provider]:
    built = build_provider(model_settings)
    try:
        yield built
    finally:
        await built.aclose()


@dataclass
class Ran:
    """What one pipeline run left behind."""

    outcome: Outcome
    row: RequestRow
    events: list[Event]

    def types(self) -> list[str]:
        return [e.type for e in self.events]

    def of(self, event_type: str) -> list[dict[str, Any]]:
        return [e.data for e in self.events if e.type == event_type]

    def stages(self) -> list[str]:
        return [e.data["stage"] for e in self.events if e.type == "status" and e.data["status"] == "running"]


async def run_one(
    db: Database, settings: Settings, provider: Provider, request_id: uuid.UUID, owner: str = "w-test"
) -> Ran:
    """Claim ``request_id`` (it must be the next eligible) and run it to its end."""
    async with db.sessions() as session, session.begin():
        claimed, _ = await queue.try_claim(session, owner=owner, lease_s=settings.lease_s, max_running=100)
    assert claimed is not None and claimed.id == request_id
    outcome = await run_request(PipelineDeps(db=db, settings=settings, provider=provider), claimed)
    return await collect(db, request_id, outcome)


async def collect(db: Database, request_id: uuid.UUID, outcome: Outcome) -> Ran:
    async with db.sessions() as session:
        row = await session.get(RequestRow, request_id)
        assert row is not None
        events = await request_events_after(session, request_id, 0, limit=10_000)
    return Ran(outcome, row, events)
