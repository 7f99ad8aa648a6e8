"""Cancel and clear over HTTP: terminal writes, events, NOTIFY, ordinals, memory, snapshots."""

from __future__ import annotations

import asyncio
import uuid

import asyncpg
from sqlalchemy import select, update

from service.config import Settings
from service.store.admission import purge_cleared
from service.store.db import Database, plain_dsn
from service.store.events import append_session_event
from service.store.models import EventRow, RequestRow, SessionRow, SnapshotRow
from tests.api.conftest import Server
from tests.api.helpers import ask, finish, mark_running


async def _events(db: Database, request_id: str) -> list[tuple[str, dict[str, object]]]:
    async with db.sessions() as tx:
        rows = await tx.scalars(
            select(EventRow).where(EventRow.request_id == uuid.UUID(request_id)).order_by(EventRow.seq)
        )
        return [(r.type, r.data) for r in rows]


async def test_cancel_a_queued_request(server: Server, db: Database) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-c"))["id"]
        cancelled = await client.post(f"/v1/questions/{rid}/cancel")
        assert cancelled.status_code == 200
        record = cancelled.json()
        assert record["status"] == "cancelled" and record["finished_at"] is not None
        assert record["error"] == {"code": "cancelled", "message": "cancelled by the client", "detail": {}}
        # Idempotent: nothing new happens the second time.
        again = await client.post(f"/v1/questions/{rid}/cancel")
        assert again.json() == record
    events = await _events(db, rid)
    assert [t for t, _ in events] == ["status", "status", "error"]
    assert events[1][1]["status"] == "cancelled"
    assert events[2][1]["code"] == "cancelled"


async def test_cancel_a_running_request_notifies_its_worker(
    server: Server, db: Database, settings: Settings
) -> None:
    heard: asyncio.Queue[str] = asyncio.Queue()
    conn = await asyncpg.connect(plain_dsn(settings.database_url or ""))
    try:
        await conn.add_listener("sidequest_cancel", lambda *args: heard.put_nowait(args[3]))
        async with server.client() as client:
            rid = (await ask(client, "p-cr"))["id"]
            await mark_running(db, rid, "answering")
            record = (await client.post(f"/v1/questions/{rid}/cancel")).json()
            assert record["status"] == "cancelled" and record["stage"] == "answering"
            assert await asyncio.wait_for(heard.get(), 5) == rid
            # A worker's late terminal write (guarded by status = 'running') changes nothing.
            async with db.sessions() as tx:
                late = await tx.execute(
                    update(RequestRow)
                    .where(RequestRow.id == uuid.UUID(rid), RequestRow.status == "running")
                    .values(status="succeeded")
                )
                await tx.commit()
                assert late.rowcount == 0  # type: ignore[attr-defined]
    finally:
        await conn.close()


async def test_cancel_leaves_a_terminal_request_unchanged(server: Server, db: Database) -> None:
    async with server.client() as client:
        rid = (await ask(client, "p-ct"))["id"]
        await finish(db, rid)
        before = (await client.get(f"/v1/questions/{rid}")).json()
        after = await client.post(f"/v1/questions/{rid}/cancel")
        assert after.status_code == 200 and after.json() == before and before["status"] == "succeeded"
        assert (await client.post(f"/v1/questions/{uuid.uuid4()}/cancel")).status_code == 404


async def test_clear_cancels_hides_resets_and_keeps_counting(server: Server, db: Database) -> None:
    async with server.client() as client:
        done = (await ask(client, "p-clr"))["id"]
        await finish(db, done)
        running = (await ask(client, "p-clr"))["id"]
        await mark_running(db, running)
        queued = (await ask(client, "p-clr", snapshot={"messages": [{"role": "user", "content": "hi"}]}))[
            "id"
        ]
        async with db.sessions() as tx:
            await tx.execute(
                update(SessionRow)
                .where(SessionRow.parent_id == "p-clr")
                .values(
                    memory={"qa_summary": {"covered_through_ordinal": 1}, "context_summaries": [{"key": "k"}]}
                )
            )
            owner_id = await tx.scalar(select(SessionRow.id).where(SessionRow.parent_id == "p-clr"))
            assert owner_id is not None
            await append_session_event(tx, owner_id, "handoff", {"handoff": {"ordinals": [1]}})
            await tx.commit()
        response = await client.delete("/v1/sessions/p-clr/questions")
        assert response.status_code == 200
        assert response.json() == {
            "parent_id": "p-clr",
            "clear_version": 1,
            "next_ordinal": 4,
            "cleared_requests": 3,
            "cancelled_requests": 2,
        }
        for rid in (done, running, queued):
            assert (await client.get(f"/v1/questions/{rid}")).status_code == 404
            assert (await client.post(f"/v1/questions/{rid}/cancel")).status_code == 404
        for rid in (running, queued):
            events = await _events(db, rid)
            assert [t for t, _ in events][-2:] == ["status", "error"]
            assert events[-1][1]["code"] == "cancelled"
        session_view = (await client.get("/v1/sessions/p-clr")).json()
        assert session_view["clear_version"] == 1
        assert set(session_view["counts"].values()) == {0}
        assert session_view["memory"] == {"qa_summary": None, "context_summaries": []}
        history = (await client.get("/v1/sessions/p-clr/questions")).json()
        assert history == {"items": [], "has_more": False, "next_before": None}
        nxt = await ask(client, "p-clr")
        assert nxt["ordinal"] == 4 and nxt["clear_version"] == 1
    async with db.sessions() as tx:
        assert await tx.scalar(select(SnapshotRow.snapshot_id)) is not None  # snapshots kept
        # The sweep purges cleared requests (and their events) once they are old enough, and the
        # session-level events of the history the clear replaced (the hand-off event above) with them.
        assert await tx.scalar(select(EventRow.id).where(EventRow.request_id.is_(None))) is not None
        assert await purge_cleared(tx, 3600) == 0
        assert await purge_cleared(tx, 0) == 3
        await tx.commit()
        remaining = list(await tx.scalars(select(RequestRow.ordinal)))
        assert remaining == [4]
        assert await tx.scalar(select(EventRow.id).where(EventRow.request_id.is_(None))) is None


async def test_clear_of_an_unknown_session_is_404(server: Server) -> None:
    async with server.client() as client:
        response = await client.delete("/v1/sessions/never/questions")
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
