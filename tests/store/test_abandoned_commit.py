"""A commit waiting for its synchronous standby is abandoned at the client's timeout, never cancelled
(SPEC 9.1: no write acknowledged or seen and then lost in a failover).

A private PostgreSQL whose ``synchronous_standby_names`` names a standby that never connects: every
commit waits for it, as a primary's commits wait while its standby is slow. asyncpg's own way, a
CancelRequest at the command timeout, makes PostgreSQL give up the wait and keep the commit locally
("the transaction has already committed locally, but might not have been replicated"): readers see
a row that a failover then loses. The service's :class:`ServerConnection` closes the socket
instead, and the row stays invisible while the commit waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from service.store.db import ServerConnection, open_connection
from tests.own_postgres import OwnPostgres


@pytest.fixture
async def waiting_primary() -> AsyncIterator[OwnPostgres]:
    pg = OwnPostgres()
    try:
        with (pg.data / "postgresql.auto.conf").open("a") as conf:
            conf.write("synchronous_standby_names = 'a_standby_that_never_comes'\n")
        await asyncio.to_thread(pg.start)
        setup = await asyncpg.connect(pg.admin_url)
        try:
            # This one commits locally (the waiting is for what comes next).
            await setup.execute("SET synchronous_commit = local; CREATE TABLE marks (id int)")
        finally:
            await setup.close()
        yield pg
    finally:
        await asyncio.to_thread(pg.destroy)


async def _visible(pg: OwnPostgres) -> int:
    reader = await asyncpg.connect(pg.admin_url)
    try:
        count: int = await reader.fetchval("SELECT count(*) FROM marks")
        return count
    finally:
        await reader.close()


async def test_a_commit_given_up_by_the_client_stays_unseen_until_replicated(
    waiting_primary: OwnPostgres,
) -> None:
    conn = await open_connection(waiting_primary.admin_url, command_timeout=1.0)
    assert isinstance(conn, ServerConnection)
    with pytest.raises(TimeoutError):
        await conn.execute("INSERT INTO marks VALUES (1)")
    await asyncio.sleep(1.0)  # time for a cancel to have landed, had one been sent
    assert conn.is_closed()
    assert await _visible(waiting_primary) == 0


async def test_the_control_asyncpg_cancels_and_the_commit_becomes_visible(
    waiting_primary: OwnPostgres,
) -> None:
    conn = await asyncpg.connect(waiting_primary.admin_url, command_timeout=1.0)
    try:
        with pytest.raises(TimeoutError):
            await conn.execute("INSERT INTO marks VALUES (1)")
        await asyncio.sleep(1.0)
        assert await _visible(waiting_primary) == 1
    finally:
        conn.terminate()
