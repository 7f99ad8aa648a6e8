"""Admission over HTTP: on_busy (SPEC 11.2) refusals and interrupts, races, and the body handled once."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import func, select

from service.client.sse import SseMessage as Message
from service.store.db import Database
from service.store.models import EventRow, RequestRow, SessionRow, SnapshotRow
from tests.api.conftest import Server
from tests.api.helpers import ask, mark_running
from tests.api.sse_client import events
from tests.factories import merge_session_settings


async def _row_counts(db: Database) -> tuple[int, int, int, int]:
    async with db.sessions() as tx:
        counts = []
        for table in (SessionRow, RequestRow, EventRow, SnapshotRow):
            counts.append(int(await tx.scalar(select(func.count()).select_from(table)) or 0))
    return counts[0], counts[1], counts[2], counts[3]


async def _next_ordinal(db: Database, parent: str) -> int:
    async with db.sessions() as tx:
        value = await tx.scalar(select(SessionRow.next_ordinal).where(SessionRow.parent_id == parent))
    assert value is not None
    return int(value)


def _post(parent: str, **body: Any) -> tuple[str, dict[str, Any]]:
    return f"/v1/sessions/{parent}/questions", {"question": "q", **body}


async def test_reject_is_409_session_busy_with_counts_and_writes_nothing(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        first = await ask(client, "p-b")
        await mark_running(db, first["id"], "answering")
        await ask(client, "p-b", "queued behind it")
        before = await _row_counts(db)
        url, body = _post("p-b", on_busy="reject")
        refused = await client.post(url, json=body)
        assert refused.status_code == 409
        error = refused.json()["error"]
        assert error["code"] == "session_busy"
        assert error["detail"] == {"queued": 1, "running": 1}
        assert "reject" in error["message"] and "busy" in error["message"]
        assert await _row_counts(db) == before
        assert await _next_ordinal(db, "p-b") == 3
        # A value that is not one of the three is a validation error.
        bad = await client.post(url, json={**body, "on_busy": "wait"})
        assert bad.status_code == 422 and bad.json()["error"]["code"] == "validation_error"


async def test_the_sessions_setting_applies_and_the_request_overrides_it(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        await ask(client, "p-s")
        async with db.sessions() as tx:
            session_row = await tx.scalar(select(SessionRow).where(SessionRow.parent_id == "p-s"))
            assert session_row is not None
            await merge_session_settings(tx, session_row.id, {"on_busy": "reject"})
            await tx.commit()
        url, body = _post("p-s")
        assert (await client.post(url, json=body)).status_code == 409
        assert (await client.post(url, json={**body, "on_busy": "enqueue"})).status_code == 202


async def test_interrupt_ends_the_running_stream_with_superseded_and_admits_the_new_one(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        running = await ask(client, "p-i", "long one")
        await mark_running(db, running["id"], "answering")
        queued = await ask(client, "p-i", "waiting")
        received: list[Message] = []

        async def follow(rid: str) -> list[Message]:
            got: list[Message] = []
            async with client.stream("GET", f"/v1/questions/{rid}/events") as response:
                assert response.status_code == 200
                async for message in events(response):
                    got.append(message)
            return got

        streams = [asyncio.create_task(follow(running["id"])), asyncio.create_task(follow(queued["id"]))]
        async with client.stream("GET", "/v1/sessions/p-i/events") as session_stream:
            session_events = events(session_stream)
            # The session stream replays what exists so far: 2 queued + 1 running status.
            for _ in range(3):
                received.append(await asyncio.wait_for(anext(session_events), 5))
            await asyncio.sleep(0.2)  # the request streams are open and waiting
            url, body = _post("p-i", question="never mind, this instead", on_busy="interrupt")
            response = await client.post(url, json=body)
            assert response.status_code == 202
            new = response.json()
            assert new["ordinal"] == 3 and new["status"] == "queued"
            # Then: cancelled + superseded for both, and the new one's queued event, in that order.
            for _ in range(5):
                received.append(await asyncio.wait_for(anext(session_events), 5))
        ended = await asyncio.wait_for(asyncio.gather(*streams), 5)
    # The wire's words (SPEC §8), written out: built by superseded_error, they would follow any change to it.
    expected = {
        "code": "superseded",
        "message": "cancelled because a newer question of the session interrupted it",
        "detail": {"superseded_by": new["id"]},
    }
    for stream in ended:
        status, error = stream[-2], stream[-1]
        assert status.event == "status" and status.json()["status"] == "cancelled"
        assert error.event == "error"
        assert {k: error.json()[k] for k in ("code", "message", "detail")} == expected
    tail = [(m.json()["request_id"], m.event) for m in received[3:]]
    assert tail[-1] == (new["id"], "status") and received[-1].json()["status"] == "queued"
    assert sorted(tail[:4]) == sorted(
        [
            (running["id"], "status"),
            (running["id"], "error"),
            (queued["id"], "status"),
            (queued["id"], "error"),
        ]
    )
    ids = [int(m.id or 0) for m in received]
    assert ids == sorted(ids)
    async with server.client() as client:
        record = (await client.get(f"/v1/questions/{running['id']}")).json()
        assert record["status"] == "cancelled" and record["error"] == expected


async def test_21_concurrent_posts_with_one_running_queue_20_and_refuse_one(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        running = await ask(client, "p-21")
        await mark_running(db, running["id"])
        url, body = _post("p-21")
        responses = await asyncio.gather(
            *(client.post(url, json={**body, "question": f"q{i}"}) for i in range(21))
        )
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [202] * 20 + [429]
    assert sorted(r.json()["ordinal"] for r in responses if r.status_code == 202) == list(range(2, 22))
    (refused,) = [r for r in responses if r.status_code == 429]
    assert refused.json()["error"]["code"] == "queue_full"
    assert await _next_ordinal(db, "p-21") == 22


async def test_concurrent_posts_to_a_new_session_get_consecutive_ordinals(
    server: Server, db: Database
) -> None:
    async with server.client() as client:
        url, body = _post("p-race")
        responses = await asyncio.gather(
            *(client.post(url, json={**body, "question": f"q{i}"}) for i in range(15))
        )
    assert all(r.status_code == 202 for r in responses)
    assert sorted(r.json()["ordinal"] for r in responses) == list(range(1, 16))
    assert (await _row_counts(db))[:3] == (1, 15, 15)


async def test_the_body_is_parsed_once_yet_strictly(server: Server, db: Database) -> None:
    async with server.client() as client:
        # The words NaN and Infinity inside a string are text, not JSON constants.
        url = "/v1/sessions/p-nan/questions"
        ok = await client.post(url, json={"question": "is NaN < Infinity?"})
        assert ok.status_code == 202 and ok.json()["question"] == "is NaN < Infinity?"
        for constant in (b"NaN", b"Infinity", b"-Infinity"):
            raw = b'{"question": "q", "snapshot": {"messages": [], "x": ' + constant + b"}}"
            refused = await client.post(url, content=raw, headers={"Content-Type": "application/json"})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "malformed_json"
        # UTF-16 JSON (Python's parser takes it) is checked strictly too.
        utf16 = '{"question": "q", "snapshot": {"messages": [], "x": NaN}}'.encode("utf-16")
        refused = await client.post(url, content=utf16, headers={"Content-Type": "application/json"})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "malformed_json"
        # The idempotency hash is the key-sorted JSON of the parsed body: an inline snapshot in
        # another key order replays; another snapshot conflicts.
        snapshot = {"system": "s", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Idempotency-Key": "k-inline"}
        first = await client.post(url, json={"question": "q", "snapshot": snapshot}, headers=headers)
        assert first.status_code == 202
        reordered = {"snapshot": {"messages": snapshot["messages"], "system": "s"}, "question": "q"}
        replay = await client.post(url, json=reordered, headers=headers)
        assert replay.status_code == 200 and replay.json()["id"] == first.json()["id"]
        other = await client.post(
            url, json={"question": "q", "snapshot": {**snapshot, "system": "t"}}, headers=headers
        )
        assert other.status_code == 409
    async with db.sessions() as tx:
        row = await tx.get(RequestRow, uuid.UUID(first.json()["id"]))
        assert row is not None and row.snapshot_id is not None
        assert (await _row_counts(db))[1] == 2
