"""What counts as "the database is unreachable" (SPEC §9), with the real driver's real errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError, ProgrammingError

from service.store.db import POOL_TIMEOUT_S, DatabaseUnavailable, connect, is_unavailable
from tests.net import free_port


async def test_a_refused_connection_is_unavailable_and_fails_fast() -> None:
    db = connect(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nothing")
    started = time.monotonic()
    try:
        with pytest.raises(Exception) as caught:
            async with db.sessions() as session:
                await session.execute(text("SELECT 1"))
    finally:
        await db.dispose()
    assert is_unavailable(caught.value)
    assert time.monotonic() - started < 5


async def test_an_exhausted_pool_times_out_as_unavailable(database_url: str) -> None:
    db = connect(database_url, pool_size=1)
    db.engine.pool._max_overflow = 0  # type: ignore[attr-defined]  # exactly one connection
    try:
        async with db.engine.connect() as held:
            await held.execute(text("SELECT 1"))
            started = time.monotonic()
            with pytest.raises(Exception) as caught:
                async with db.engine.connect() as second:
                    await second.execute(text("SELECT 1"))
            waited = time.monotonic() - started
    finally:
        await db.dispose()
    assert is_unavailable(caught.value)
    assert POOL_TIMEOUT_S - 0.5 <= waited < POOL_TIMEOUT_S + 3


async def test_a_connection_killed_mid_query_is_unavailable(database_url: str) -> None:
    db = connect(database_url, pool_size=2)
    try:
        async with db.engine.connect() as victim:
            pid = (await victim.execute(text("SELECT pg_backend_pid()"))).scalar_one()

            async def kill() -> None:
                await asyncio.sleep(0.3)
                async with db.engine.connect() as killer:
                    await killer.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})

            killing = asyncio.create_task(kill())
            with pytest.raises(Exception) as caught:
                await victim.execute(text("SELECT pg_sleep(5)"))
            await killing
    finally:
        await db.dispose()
    assert is_unavailable(caught.value)


async def test_bugs_and_refusals_are_not_outages(database_url: str) -> None:
    db = connect(database_url, pool_size=1)
    try:
        async with db.engine.connect() as conn:
            with pytest.raises(ProgrammingError) as syntax:
                await conn.execute(text("SELEC 1"))
        async with db.engine.begin() as conn:
            await conn.execute(text("CREATE TEMP TABLE t (k int PRIMARY KEY)"))
            await conn.execute(text("INSERT INTO t VALUES (1)"))
            with pytest.raises(IntegrityError) as duplicate:
                await conn.execute(text("INSERT INTO t VALUES (1)"))
    finally:
        await db.dispose()
    assert not is_unavailable(syntax.value)
    assert not is_unavailable(duplicate.value)
    assert not is_unavailable(ValueError("x"))
    assert is_unavailable(DatabaseUnavailable("x"))
    # A bare timeout is an outage for the API, not for the pipeline (which has deadlines of its own).
    assert is_unavailable(TimeoutError()) and not is_unavailable(TimeoutError(), include_timeouts=False)


async def test_a_raw_connection_that_failed_mid_protocol_is_never_reused(database_url: str) -> None:
    """A connection left mid-protocol must not go back into the raw pool: after a database restart
    the next request on it would fail with asyncpg's "cannot switch to state 12; another operation
    (2) is in progress" as ``internal_error``. An outage-kind error, a driver interface error or a
    cancellation terminates the connection instead; an ordinary SQL error keeps it."""
    import asyncpg

    db = connect(database_url, pool_size=1)

    async def pid() -> int:
        async with db.connection() as conn:
            value: int = await conn.fetchval("SELECT pg_backend_pid()")
            return value

    async def failing(exc: BaseException) -> None:
        with pytest.raises(type(exc)):
            async with db.connection():
                raise exc

    try:
        first = await pid()
        with pytest.raises(asyncpg.PostgresSyntaxError):
            async with db.connection() as conn:
                await conn.execute("SELEC 1")
        assert await pid() == first  # a statement's own error leaves the connection usable
        seen = {first}
        for exc in (
            asyncpg.ConnectionDoesNotExistError("gone"),
            asyncpg.InterfaceError("cannot perform operation: another operation is in progress"),
            asyncio.CancelledError(),
        ):
            await failing(exc)
            fresh = await pid()
            assert fresh not in seen, exc  # terminated, replaced by a new connection
            seen.add(fresh)
    finally:
        await db.dispose()
    broken = asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")
    assert is_unavailable(broken)
    assert not is_unavailable(asyncpg.InternalClientError("something else entirely"))


async def test_every_connection_of_the_service_takes_a_dsn_with_libpq_parameters(database_url: str) -> None:
    """The engine, the raw pool and the listener all read sslmode / application_name from the DSN
    (passed to asyncpg as keywords they crash the engine; a raw pool that misreads ?ssl= makes its
    every statement a 500)."""
    from service.config import asyncpg_url

    url = asyncpg_url(f"{database_url}?sslmode=disable&application_name=sq-check&connect_timeout=3")
    assert url is not None
    db = connect(url)
    try:
        async with db.sessions() as session:
            assert await session.scalar(text("SELECT current_setting('application_name')")) == "sq-check"
        async with db.connection() as conn:
            assert await conn.fetchval("SELECT current_setting('application_name')") == "sq-check"
    finally:
        await db.dispose()


async def test_readiness_gives_up_after_its_own_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """With PostgreSQL frozen (SIGSTOP) a connect can hang far longer than a probe waits; a probe
    must hear "not ready" within its own deadline."""
    from service.store import schema

    @contextlib.asynccontextmanager
    async def frozen() -> AsyncIterator[None]:  # a connect that never completes
        await asyncio.sleep(3600)
        yield

    monkeypatch.setattr(schema, "READINESS_TIMEOUT_S", 0.05)
    with pytest.raises(TimeoutError):
        await schema.readiness(SimpleNamespace(engine=SimpleNamespace(connect=frozen)))  # type: ignore[arg-type]


async def test_a_pooled_connection_read_as_ended_is_lost(database_url: str) -> None:
    """Once asyncpg has read the server's goodbye it detaches the pool's proxy, and a statement meets
    "released back to the pool" instead of "connection is closed": the same lost connection."""
    import asyncpg

    from service.store.db import connection_lost, plain_dsn

    db = connect(database_url, pool_size=1)
    admin = await asyncpg.connect(plain_dsn(database_url))
    try:
        with pytest.raises(asyncpg.InterfaceError) as caught:
            async with db.connection() as raw:
                await admin.execute("SELECT pg_terminate_backend($1)", raw.get_server_pid())
                await asyncio.sleep(0.5)  # the loop reads the termination meanwhile
                await raw.fetchval("SELECT 1")
    finally:
        await admin.close()
        await db.dispose()
    assert "released back to the pool" in str(caught.value)
    assert connection_lost(caught.value) and is_unavailable(caught.value)
