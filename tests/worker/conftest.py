"""Worker test harness: the scripted server, fast settings, polling helpers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator

import pytest
from sqlalchemy import select

from service.config import Settings
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
def worker_settings(database_url: str, server: ScriptedServer) -> Settings:
    return scripted_settings(
        database_url, server.base_url, lease_s=1.5, heartbeat_s=0.3, request_timeout_s=30.0
    )


async def wait_for(
    check: Callable[[], Awaitable[bool]], *, within: float = 10.0, interval: float = 0.02
) -> float:
    """Poll ``check`` until it is true; returns the seconds it took. Fails the test on timeout."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > within:
            raise AssertionError(f"condition not met within {within}s")
        await asyncio.sleep(interval)
    return time.monotonic() - started


async def status_of(db: Database, request_id: uuid.UUID) -> str:
    async with db.sessions() as session:
        value = await session.scalar(select(RequestRow.status).where(RequestRow.id == request_id))
    return str(value)


async def row_of(db: Database, request_id: uuid.UUID) -> RequestRow:
    async with db.sessions() as session:
        row = await session.get(RequestRow, request_id)
    assert row is not None
    return row


async def events_of(db: Database, request_id: uuid.UUID) -> list[Event]:
    async with db.sessions() as session:
        return await request_events_after(session, request_id, 0, limit=10_000)
