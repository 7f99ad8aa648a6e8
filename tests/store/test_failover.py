"""A node gone in a failover (SPEC 9.1): 25006 and 57P01–57P03 drop the connection, never retried on
it, and a multi-host URL reaches the host that takes writes now — with the real driver and a real
PostgreSQL (a read-only database stands in for a standby: it answers 25006 to a write)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from service.store.db import (
    NODE_GONE_STATES,
    DatabaseUnavailable,
    connect,
    connection_lost,
    is_unavailable,
    open_connection,
    plain_dsn,
)
from tests import pg
from tests.net import free_port


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.ReadOnlySQLTransactionError("cannot execute INSERT in a read-only transaction"),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.exceptions.CrashShutdownError("terminating connection because of crash of another process"),
        asyncpg.exceptions.CannotConnectNowError("the database system is shutting down"),
    ],
)
def test_a_node_gone_is_unavailable_and_loses_its_connection(error: asyncpg.PostgresError) -> None:
    assert error.sqlstate in NODE_GONE_STATES
    wrapped = sa_exc.DBAPIError("INSERT …", {}, error)
    for exc in (error, wrapped):
        assert is_unavailable(exc)
        assert connection_lost(exc)


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already"),
        asyncpg.exceptions.ObjectNotInPrerequisiteStateError('database "x" is not accepting connections'),
    ],
)
def test_a_busy_node_is_unavailable_but_keeps_its_other_connections(error: asyncpg.PostgresError) -> None:
    assert is_unavailable(error)
    assert not connection_lost(error)


def test_a_bug_is_neither() -> None:
    error = asyncpg.exceptions.UniqueViolationError("duplicate key value violates unique constraint")
    assert not is_unavailable(error)
    assert not connection_lost(error)


@pytest.fixture
async def read_only_database(pg_server: pg.Server) -> AsyncIterator[str]:
    """A database of its own whose new transactions are read-only until the test says otherwise:
    a write there fails with 25006, as on a standby or a demoted primary."""
    url = await pg.create_database(pg_server.admin_url)
    try:
        yield url
    finally:
        await pg.drop_database(pg_server.admin_url, url)


async def _set_read_only(admin_url: str, url: str, on: bool) -> None:
    # Sessions open now end, as a demotion (a restart as a standby) ends them.
    await pg.alter_database(admin_url, url, f"SET default_transaction_read_only = {'on' if on else 'off'}")


async def test_a_write_refused_as_read_only_is_never_retried_on_its_connection(
    pg_server: pg.Server, read_only_database: str
) -> None:
    url = read_only_database
    db = connect(url, pool_size=2)
    try:
        async with db.engine.begin() as conn:
            await conn.execute(text("CREATE TABLE marks (id int)"))
        async with db.connection() as raw:
            raw_pid = raw.get_server_pid()
        async with db.engine.connect() as conn:
            session_pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        await _set_read_only(pg_server.admin_url, url, True)

        # The ORM path: 25006 (on a connection opened after the "demotion")…
        with pytest.raises(Exception) as caught:
            async with db.engine.begin() as conn:
                await conn.execute(text("INSERT INTO marks VALUES (1)"))
        assert is_unavailable(caught.value) and connection_lost(caught.value)
        async with db.engine.connect() as conn:
            refused_pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        # …and the plain path.
        with pytest.raises(asyncpg.PostgresError) as refused:
            async with db.connection() as raw:
                refused_raw_pid = raw.get_server_pid()
                await raw.execute("INSERT INTO marks VALUES (2)")
        assert refused.value.sqlstate == "25006"

        await _set_read_only(pg_server.admin_url, url, False)  # "the new primary"
        async with db.engine.begin() as conn:
            await conn.execute(text("INSERT INTO marks VALUES (3)"))
            after_pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        async with db.connection() as raw:
            await raw.execute("INSERT INTO marks VALUES (4)")
            after_raw_pid = raw.get_server_pid()
    finally:
        await db.dispose()
    # Every write after the refusal ran on a connection opened after it.
    assert len({session_pid, refused_pid, after_pid}) == 3
    assert len({raw_pid, refused_raw_pid, after_raw_pid}) == 3


async def test_a_terminated_backend_is_a_node_gone_and_the_pool_reconnects(database_url: str) -> None:
    db = connect(database_url, pool_size=2)
    admin = await asyncpg.connect(plain_dsn(database_url))
    try:
        with pytest.raises(Exception) as caught:
            async with db.connection() as raw:
                pid = raw.get_server_pid()
                await admin.execute("SELECT pg_terminate_backend($1)", pid)
                await raw.fetchval("SELECT 1")
        assert connection_lost(caught.value)
        async with db.connection() as raw:
            assert await raw.fetchval("SELECT 1") == 1
            assert raw.get_server_pid() != pid
    finally:
        await admin.close()
        await db.dispose()


def _here(url: str) -> str:
    parts = urlsplit(plain_dsn(url))
    return f"{parts.hostname}:{parts.port or 5432}"


def _with_hosts(url: str, *hosts: str) -> str:
    return pg.with_hosts(plain_dsn(url), *hosts)


async def test_several_hosts_reach_the_one_that_answers(database_url: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    dsn = _with_hosts(database_url, dead, _here(database_url)) + "?target_session_attrs=read-write"
    conn = await open_connection(dsn)
    try:
        assert await conn.fetchval("SELECT NOT pg_is_in_recovery()")
    finally:
        await conn.close()
    # Through both pools of a Database as well.
    db = connect(dsn.replace("postgresql://", "postgresql+asyncpg://", 1), pool_size=1)
    try:
        async with db.engine.connect() as sa_conn:
            assert (await sa_conn.execute(text("SELECT 1"))).scalar_one() == 1
        async with db.connection() as raw:
            assert await raw.fetchval("SELECT 1") == 1
    finally:
        await db.dispose()


async def test_no_writable_host_is_unavailable(pg_server: pg.Server, read_only_database: str) -> None:
    await _set_read_only(pg_server.admin_url, read_only_database, True)
    here = _here(read_only_database)
    both = _with_hosts(read_only_database, here, here)
    with pytest.raises(DatabaseUnavailable) as caught:
        await open_connection(both + "?target_session_attrs=read-write")
    assert is_unavailable(caught.value)
    dead = _with_hosts(read_only_database, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    with pytest.raises(DatabaseUnavailable):
        await open_connection(dead)


async def test_credentials_refused_on_every_host_are_said_as_they_are(database_url: str) -> None:
    missing = f"sidequest_missing_{uuid.uuid4().hex[:8]}"
    url = _with_hosts(database_url, _here(database_url), _here(database_url))
    parts = urlsplit(url)
    with pytest.raises(asyncpg.InvalidCatalogNameError):
        await open_connection(urlunsplit(parts._replace(path=f"/{missing}")))
