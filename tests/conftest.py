"""Shared fixtures: one PostgreSQL database per test run, migrated to head, emptied between tests."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator

import hypothesis
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from service.config import Settings
from service.store.db import Database, connect
from service.store.models import Base
from service.store.schema import upgrade_to_head
from tests import pg

pytest_plugins = ["tests.scripted_provider"]

# Property tests check what holds, not how fast: no per-example deadline, which a loaded CI machine
# (two cores, the suite's servers beside it) can exceed on a large generated transcript.
hypothesis.settings.register_profile("sidequest", deadline=None)
hypothesis.settings.load_profile("sidequest")

# Every table of the schema (the models are the one list), emptied between tests.
TABLES = tuple(table.name for table in Base.metadata.sorted_tables)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pg.Server]:
    server = pg.find_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def database_url(pg_server: pg.Server) -> Iterator[str]:
    """A fresh database for this run (random name), at the head migration, dropped at the end."""
    url = asyncio.run(pg.create_database(pg_server.admin_url))
    try:
        upgrade_to_head(url)
        yield url
    finally:
        asyncio.run(pg.drop_database(pg_server.admin_url, url))


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    """A connected Database on empty tables (TRUNCATE is cheap isolation between tests)."""
    database = connect(database_url, pool_size=5)
    # The session-wide servers (tests/api/conftest.py) and an earlier test's abandoned statement (a
    # cancelled task's is never cancelled on the server) may still hold a row lock as TRUNCATE takes
    # its table locks one by one; PostgreSQL then ends the TRUNCATE as the deadlock's victim, and it is
    # safe to run again.
    for tries_left in reversed(range(3)):
        try:
            async with database.engine.begin() as conn:
                await conn.execute(text(f"TRUNCATE {', '.join(TABLES)} RESTART IDENTITY CASCADE"))
            break
        except DBAPIError as exc:
            if getattr(exc.orig, "sqlstate", None) != "40P01" or not tries_left:
                raise
    try:
        yield database
    finally:
        await database.dispose()


@pytest.fixture
def settings(database_url: str) -> Settings:
    """Settings for tests: the run's database, fast leases and polls, offline provider."""
    return Settings(
        database_url=database_url,
        provider="offline",
        lease_s=3.0,
        heartbeat_s=0.5,
        poll_s=0.2,
    )


@pytest.fixture(autouse=True)
def _reset_sse_app_status() -> Iterator[None]:
    """sse-starlette keeps a process-global exit flag; a previous server's shutdown must not leak."""
    from sse_starlette.sse import AppStatus

    AppStatus.should_exit = False
    yield
    AppStatus.should_exit = False


def pytest_report_header(config: pytest.Config) -> str:
    chosen = os.environ.get("SIDEQUEST_TEST_DATABASE_URL") or "auto (local → docker → embedded)"
    return f"sidequest test database: {chosen}"
