"""Through a real PgBouncer in transaction mode (SPEC 9.1): admission, claims and stream resume.

``sidequest serve``'s app (API and worker in one process) with ``SIDEQUEST_DATABASE_POOLER=transaction``
and both pools behind a PgBouncer of the test's own whose server pool has two connections, shared by
every client connection; the LISTEN connection goes to PostgreSQL directly
(``SIDEQUEST_LISTEN_DATABASE_URL``). A statement that depended on its session would land on another
client's server connection; the control test shows that the pooler setting is what makes it work.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import asyncpg
import httpx
import pytest
from sqlalchemy import text

from service.client.sse import SseMessage
from service.config import Settings
from service.serve import create_serving_app
from service.store.db import Database, connect, plain_dsn
from service.store.schema import upgrade_to_head
from tests.api.conftest import serve
from tests.api.sse_client import events
from tests.pgbouncer import PgBouncer

SNAPSHOT = {
    "system": "You are the main agent.",
    "messages": [
        {"role": "user", "content": "Please rename the config loader."},
        {"role": "assistant", "content": "It lives in service/config.py; renaming it now."},
    ],
}


@pytest.fixture
def bouncer(database_url: str) -> Iterator[PgBouncer]:
    pgbouncer = PgBouncer.in_front_of(plain_dsn(database_url), pool_size=2).start()
    try:
        yield pgbouncer
    finally:
        pgbouncer.stop()


async def _stream(
    client: httpx.AsyncClient, path: str, *, last_id: str | None = None, stop_after: int | None = None
) -> list[SseMessage]:
    headers = {"Last-Event-ID": last_id} if last_id else {}
    got: list[SseMessage] = []
    async with asyncio.timeout(60), client.stream("GET", path, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for message in events(response):
            got.append(message)
            if message.event in ("done", "error") or (stop_after is not None and len(got) >= stop_after):
                break
    return got


async def _resumed(client: httpx.AsyncClient, request_id: str) -> list[int]:
    """The request's stream read in pieces, each resumed with the last id received."""
    path = f"/v1/questions/{request_id}/events"
    seen: list[SseMessage] = []
    while not seen or seen[-1].event not in ("done", "error"):
        last = seen[-1].id if seen else None
        seen += await _stream(client, path, last_id=last, stop_after=random.randint(1, 4))
    assert seen[-1].event == "done"
    return [int(m.id or 0) for m in seen]


async def test_admission_claims_and_resumed_streams_through_pgbouncer(
    settings: Settings, db: Database, bouncer: PgBouncer
) -> None:
    direct = settings.database_url or ""
    pooled = bouncer.url(direct)
    # A migration run, through the pooler too (at head: it checks and stops).
    await asyncio.to_thread(upgrade_to_head, pooled)
    chosen = settings.model_copy(
        update={
            "database_url": pooled,
            "database_pooler": "transaction",
            "listen_database_url": direct,
            "max_concurrency": 4,
        }
    )
    app = create_serving_app(chosen, pooled)
    async with serve(app) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:

        async def admit(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {"question": f"question {i}?"}
            if i % 3 == 0:
                body["snapshot"] = SNAPSHOT
            response = await client.post(
                f"/v1/sessions/p-bouncer-{i % 5}/questions", json=body, headers={"Idempotency-Key": f"k{i}"}
            )
            assert response.status_code == 202, response.text
            record: dict[str, Any] = response.json()
            return record

        admitted = await asyncio.gather(*(admit(i) for i in range(24)))
        # A replay of an idempotent POST answers the same request.
        again = await client.post(
            "/v1/sessions/p-bouncer-0/questions",
            json={"question": "question 0?", "snapshot": SNAPSHOT},
            headers={"Idempotency-Key": "k0"},
        )
        assert again.json()["id"] == admitted[0]["id"]

        for seqs in await asyncio.gather(*(_resumed(client, r["id"]) for r in admitted)):
            assert seqs == list(range(1, len(seqs) + 1))  # no gap, no duplicate, ends with done

        # A session stream resumed halfway delivers the rest, each event once.
        path = "/v1/sessions/p-bouncer-1/events"
        first = await _stream(client, path, stop_after=5)
        rest: list[SseMessage] = []
        done = sum(1 for m in first if m.event == "done")
        async with (
            asyncio.timeout(30),
            client.stream("GET", path, headers={"Last-Event-ID": first[-1].id or ""}) as r,
        ):
            async for message in events(r):
                rest.append(message)
                done += message.event == "done"
                if done == sum(1 for a in admitted if a["parent_id"] == "p-bouncer-1"):
                    break
        ids = [int(m.id or 0) for m in first + rest]
        assert ids == sorted(set(ids))

        statuses = {(await client.get(f"/v1/questions/{r['id']}")).json()["status"] for r in admitted}
        assert statuses == {"succeeded"}

    # Nothing was left prepared under a name on the shared server connections.
    for _ in range(4):
        conn = await asyncpg.connect(plain_dsn(pooled), statement_cache_size=0)
        try:
            assert await conn.fetchval("SELECT count(*) FROM pg_prepared_statements") == 0
        finally:
            await conn.close()


async def test_without_the_pooler_setting_named_statements_break_behind_pgbouncer(
    database_url: str, bouncer: PgBouncer
) -> None:
    """The control: the same pools with ``SIDEQUEST_DATABASE_POOLER=none`` prepare statements under
    names that the next transaction's server connection does not have (or already has)."""
    db = connect(bouncer.url(database_url), pool_size=4)

    async def one(i: int) -> None:
        async with db.sessions() as session:
            for j in range(5):
                await session.execute(text(f"SELECT {i} + {j}"))
                await session.commit()

    try:
        with pytest.raises(Exception, match="prepared statement"):
            for _ in range(5):
                await asyncio.gather(*(one(i) for i in range(4)))
    finally:
        await db.dispose()
