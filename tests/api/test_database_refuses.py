"""A database that is there but refuses us (SPEC §9): one in maintenance (``ALLOW_CONNECTIONS false``,
SQLSTATE 55000) and one that only reads (a standby, a primary demoted in a failover: 25006) are the
database being unavailable — 503 with ``Retry-After``, never a 500 — and the service is back when it is.

Each test has a database of its own (the ALTERs are database-wide), migrated to head.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from sqlalchemy import text

from service.api.app import create_app
from service.config import Settings
from service.store.db import connect, is_unavailable
from service.store.schema import readiness, upgrade_to_head
from tests import pg
from tests.api.conftest import serve


@pytest.fixture
async def own_url(pg_server: pg.Server) -> AsyncIterator[str]:
    url = await pg.create_database(pg_server.admin_url)
    await asyncio.to_thread(upgrade_to_head, url)
    try:
        yield url
    finally:
        await pg.alter_database(pg_server.admin_url, url, "ALLOW_CONNECTIONS true")
        await pg.alter_database(pg_server.admin_url, url, "RESET default_transaction_read_only")
        await pg.drop_database(pg_server.admin_url, url)


@pytest.mark.parametrize(
    ("change", "sqlstate"),
    [("ALLOW_CONNECTIONS false", "55000"), ("SET default_transaction_read_only = on", "25006")],
)
async def test_the_drivers_refusal_counts_as_unavailable(
    pg_server: pg.Server, own_url: str, change: str, sqlstate: str
) -> None:
    await pg.alter_database(pg_server.admin_url, own_url, change)
    db = connect(own_url)
    try:
        with pytest.raises(Exception) as caught:
            async with db.sessions() as tx, tx.begin():
                await tx.execute(text("CREATE TABLE written (x int)"))
    finally:
        await db.dispose()
    assert sqlstate in repr(caught.value) or getattr(caught.value.__cause__, "sqlstate", None) == sqlstate
    assert is_unavailable(caught.value)


async def test_a_read_only_database_is_not_ready_and_writes_get_503_until_it_writes_again(
    pg_server: pg.Server, own_url: str
) -> None:
    app = create_app(Settings(database_url=own_url, provider="offline"), own_url)
    async with serve(app) as base:
        async with httpx.AsyncClient(base_url=base, timeout=30) as client:
            assert (await client.get("/readyz")).status_code == 200
            assert (await client.post("/v1/sessions/p/questions", json={"question": "q"})).status_code == 202

            await pg.alter_database(pg_server.admin_url, own_url, "SET default_transaction_read_only = on")
            db = connect(own_url)
            try:
                assert (await readiness(db))[1] is False  # reads work, writes would not
            finally:
                await db.dispose()
            ready = await client.get("/readyz")
            assert ready.status_code == 503 and ready.json()["database"] == "read-only"
            assert ready.json()["error"]["code"] == "service_unavailable" and "Retry-After" in ready.headers
            for _ in range(2):  # the first may meet a pooled connection the ALTER's terminate closed
                refused = await client.post("/v1/sessions/p/questions", json={"question": "q2"})
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert "Retry-After" in refused.headers
            assert (await client.get("/v1/sessions/p")).status_code == 200  # reads still work

            await pg.alter_database(pg_server.admin_url, own_url, "RESET default_transaction_read_only")
            assert (await client.get("/readyz")).status_code == 200
            for _ in range(2):
                admitted = await client.post("/v1/sessions/p/questions", json={"question": "q3"})
            assert admitted.status_code == 202, admitted.text
