"""The one-statement admission (sidequest_admit, service/store/sql/admission.sql) called through store.admit.

Refusals write nothing and spend no ordinal; concurrent admissions get consecutive ordinals; the
record is exactly request_record of the stored row; the queued event and the NOTIFYs are the ones
events.py writes; on_busy (SPEC 11.2) rejects or interrupts.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg
import pytest
from sqlalchemy import func, select, update

from service.store.admission import (
    Admission,
    Admitted,
    IdempotencyConflict,
    QueueFull,
    SessionBusyRejected,
    SnapshotMissing,
    admit,
)
from service.store.db import Database, plain_dsn
from service.store.models import EventRow, RequestRow, SessionRow, SnapshotRow
from service.store.records import request_record
from service.vocabulary import superseded_error
from tests.factories import merge_session_settings

TENANT = "t1"
SNAPSHOT: dict[str, Any] = {"system": "main", "messages": [{"role": "user", "content": "fix it"}]}


async def _admit(
    db: Database, parent: str, question: str = "q", *, max_queued: int = 20, **kw: Any
) -> Admitted:
    return await admit(db, TENANT, parent, Admission(question=question, **kw), max_queued=max_queued)


async def _session(db: Database, parent: str) -> SessionRow | None:
    async with db.sessions() as s:
        return await s.scalar(
            select(SessionRow).where(SessionRow.tenant == TENANT, SessionRow.parent_id == parent)
        )


async def _counts(db: Database) -> tuple[int, int, int, int]:
    async with db.sessions() as s:
        out = []
        for table in (SessionRow, RequestRow, EventRow, SnapshotRow):
            out.append(int(await s.scalar(select(func.count()).select_from(table)) or 0))
    return out[0], out[1], out[2], out[3]


async def _set_status(db: Database, request_id: str, status: str, stage: str | None = None) -> None:
    async with db.sessions() as s:
        await s.execute(
            update(RequestRow)
            .where(RequestRow.id == uuid.UUID(request_id))
            .values(status=status, stage=stage)
        )
        await s.commit()


async def _events(db: Database, request_id: str) -> list[EventRow]:
    async with db.sessions() as s:
        return list(
            await s.scalars(
                select(EventRow).where(EventRow.request_id == uuid.UUID(request_id)).order_by(EventRow.seq)
            )
        )


async def _set_on_busy(db: Database, parent: str, value: str | None) -> None:
    owner = await _session(db, parent)
    assert owner is not None
    async with db.sessions() as s:
        await merge_session_settings(s, owner.id, {"on_busy": value})
        await s.commit()


async def test_the_record_is_request_record_of_the_stored_row_and_the_queued_event_is_written(
    db: Database,
) -> None:
    admitted = await _admit(db, "p1", "what?", options={"model": "m-1", "max_output_tokens": 1024})
    assert admitted.created and admitted.superseded == ()
    async with db.sessions() as s:
        row = await s.get(RequestRow, uuid.UUID(admitted.record["id"]))
        assert row is not None
        assert admitted.record == request_record(row, "p1")
        assert row.options == {"model": "m-1", "max_output_tokens": 1024} and row.model == "m-1"
        assert row.event_seq == 1 and row.status == "queued" and row.pinned is False
        owner = await s.get(SessionRow, row.session_id)
        assert owner is not None and owner.next_ordinal == 2
    assert admitted.record["ordinal"] == 1 and admitted.record["status"] == "queued"
    events = await _events(db, admitted.record["id"])
    assert len(events) == 1
    event = events[0]
    assert (event.type, event.seq, event.session_id) == ("status", 1, owner.id)
    data = dict(event.data)
    at = data.pop("at")
    assert data == {
        "request_id": admitted.record["id"],
        "ordinal": 1,
        "seq": 1,
        "status": "queued",
        "stage": None,
    }
    assert at.endswith("Z") and len(at) == len("2026-11-29T10:00:00.123456Z")


async def test_the_queued_event_and_the_queue_wakeup_are_notified(db: Database) -> None:
    heard: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    conn = await asyncpg.connect(plain_dsn(db.url))
    try:
        for channel in ("sidequest_events", "sidequest_queue"):
            await conn.add_listener(channel, lambda _c, _p, ch, payload: heard.put_nowait((ch, payload)))
        admitted = await _admit(db, "p-notify")
        got = [await asyncio.wait_for(heard.get(), 5) for _ in range(2)]
    finally:
        await conn.close()
    owner = await _session(db, "p-notify")
    assert owner is not None
    (event,) = await _events(db, admitted.record["id"])
    by_channel = dict(got)
    # Exactly events.py's payload (json.dumps of these keys, in this order).
    assert by_channel["sidequest_events"] == json.dumps(
        {"id": event.id, "request_id": admitted.record["id"], "session_id": str(owner.id)}
    )
    assert by_channel["sidequest_queue"] == str(owner.id)


async def test_a_full_queue_refuses_without_spending_an_ordinal(db: Database) -> None:
    records = [(await _admit(db, "p-full", f"q{i}")).record for i in range(20)]
    before = await _counts(db)
    with pytest.raises(QueueFull) as refused:
        await _admit(db, "p-full", "one too many")
    assert refused.value.detail == {"max_queued": 20}
    assert await _counts(db) == before
    owner = await _session(db, "p-full")
    assert owner is not None and owner.next_ordinal == 21
    # Running ones do not count: one starts, and the next admission takes the very next ordinal.
    await _set_status(db, records[0]["id"], "running", "preparing")
    assert (await _admit(db, "p-full", "fits")).record["ordinal"] == 21


async def test_a_refused_first_request_leaves_no_session(db: Database) -> None:
    with pytest.raises(SnapshotMissing) as refused:
        await _admit(db, "p-new", snapshot_id="never-stored")
    assert refused.value.detail == {"snapshot_id": "never-stored"}
    assert await _counts(db) == (0, 0, 0, 0)
    # And for an existing session: nothing written, no ordinal spent.
    await _admit(db, "p-new")
    before = await _counts(db)
    with pytest.raises(SnapshotMissing):
        await _admit(db, "p-new", snapshot_id="never-stored")
    assert await _counts(db) == before
    owner = await _session(db, "p-new")
    assert owner is not None and owner.next_ordinal == 2


async def test_an_inline_snapshot_is_stored_and_a_refusal_rolls_it_back(db: Database) -> None:
    admitted = await _admit(db, "p-inline", snapshot={**SNAPSHOT, "snapshot_id": "s-1"})
    assert admitted.record["snapshot_id"] == "s-1"
    # The same SQL function, run in the snapshot's transaction: the same record.
    async with db.sessions() as session:
        row = await session.get(RequestRow, uuid.UUID(admitted.record["id"]))
        assert row is not None and admitted.record == request_record(row, "p-inline")
    assert (await _admit(db, "p-inline", snapshot_id="s-1")).record["ordinal"] == 2
    # A refused inline admission leaves neither its snapshot nor a session behind.
    for i in range(18):
        await _admit(db, "p-inline", f"fill {i}")
    before = await _counts(db)
    with pytest.raises(QueueFull):
        await _admit(db, "p-inline", snapshot={**SNAPSHOT, "snapshot_id": "s-2"})
    assert await _counts(db) == before


async def test_idempotent_replay_and_conflict(db: Database) -> None:
    first = await _admit(db, "p-idem", idempotency_key="k", body_hash="h1")
    assert first.created
    replay = await _admit(db, "p-idem", idempotency_key="k", body_hash="h1")
    assert not replay.created and replay.record == first.record
    with pytest.raises(IdempotencyConflict):
        await _admit(db, "p-idem", idempotency_key="k", body_hash="h2")
    owner = await _session(db, "p-idem")
    assert owner is not None and owner.next_ordinal == 2
    # The replay answers before the queue limit and before on_busy.
    await _set_on_busy(db, "p-idem", "reject")
    again = await _admit(db, "p-idem", idempotency_key="k", body_hash="h1", max_queued=1)
    assert not again.created and again.record["id"] == first.record["id"]


async def test_concurrent_admissions_to_one_session_get_consecutive_ordinals(db: Database) -> None:
    n = 30
    # Every one starts before the session exists: exactly one session is created.
    results = await asyncio.gather(*(_admit(db, "p-race", f"q{i}", max_queued=100) for i in range(n)))
    assert sorted(r.record["ordinal"] for r in results) == list(range(1, n + 1))
    owner = await _session(db, "p-race")
    assert owner is not None and owner.next_ordinal == n + 1
    assert await _counts(db) == (1, n, n, 0)


async def test_21_concurrent_admissions_with_one_running_queue_exactly_20(db: Database) -> None:
    running = (await _admit(db, "p-21", "running")).record
    await _set_status(db, running["id"], "running", "answering")
    outcomes = await asyncio.gather(*(_admit(db, "p-21", f"q{i}") for i in range(21)), return_exceptions=True)
    admitted = [o for o in outcomes if isinstance(o, Admitted)]
    refused = [o for o in outcomes if isinstance(o, QueueFull)]
    assert (len(admitted), len(refused)) == (20, 1), outcomes
    assert sorted(a.record["ordinal"] for a in admitted) == list(range(2, 22))
    owner = await _session(db, "p-21")
    assert owner is not None and owner.next_ordinal == 22


async def test_on_busy_reject_refuses_while_busy_and_writes_nothing(db: Database) -> None:
    first = (await _admit(db, "p-rej")).record
    before = await _counts(db)
    with pytest.raises(SessionBusyRejected) as busy:
        await _admit(db, "p-rej", on_busy="reject")
    assert busy.value.detail == {"queued": 1, "running": 0}
    await _set_status(db, first["id"], "running", "answering")
    with pytest.raises(SessionBusyRejected) as busy:
        await _admit(db, "p-rej", on_busy="reject")
    assert busy.value.detail == {"queued": 0, "running": 1}
    assert await _counts(db) == before
    owner = await _session(db, "p-rej")
    assert owner is not None and owner.next_ordinal == 2
    # Idle again: reject admits.
    await _set_status(db, first["id"], "succeeded")
    assert (await _admit(db, "p-rej", on_busy="reject")).record["ordinal"] == 2
    # An idle session that does not exist yet is not busy either.
    assert (await _admit(db, "p-rej-new", on_busy="reject")).record["ordinal"] == 1


async def test_on_busy_interrupt_supersedes_queued_and_running_requests(db: Database) -> None:
    running = (await _admit(db, "p-int", "running")).record
    await _set_status(db, running["id"], "running", "answering")
    queued = [(await _admit(db, "p-int", f"queued {i}")).record for i in range(2)]
    finished = (await _admit(db, "p-int-other", "other session")).record
    heard: asyncio.Queue[str] = asyncio.Queue()
    conn = await asyncpg.connect(plain_dsn(db.url))
    try:
        await conn.add_listener("sidequest_cancel", lambda _c, _p, _ch, payload: heard.put_nowait(payload))
        new = await _admit(db, "p-int", "newer", on_busy="interrupt")
        cancelled_ids = {await asyncio.wait_for(heard.get(), 5) for _ in range(3)}
    finally:
        await conn.close()
    old_ids = [running["id"], *(q["id"] for q in queued)]
    assert new.created and new.record["ordinal"] == 4 and new.record["status"] == "queued"
    assert [str(i) for i in new.superseded] == old_ids
    assert cancelled_ids == set(old_ids)
    expected_error = superseded_error(new.record["id"])
    async with db.sessions() as s:
        for rid, stage in zip(old_ids, ("answering", None, None), strict=True):
            row = await s.get(RequestRow, uuid.UUID(rid))
            assert row is not None
            assert (row.status, row.stage, row.error) == ("cancelled", stage, expected_error)
            assert row.finished_at is not None and row.cancel_requested and row.lease_owner is None
        other = await s.get(RequestRow, uuid.UUID(finished["id"]))
        assert other is not None and other.status == "queued"
    # Each stream ends: status cancelled, then error superseded, with consecutive seqs.
    for rid, stage in zip(old_ids, ("answering", None, None), strict=True):
        events = await _events(db, rid)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        status, error = events[-2], events[-1]
        assert (status.type, status.data["status"], status.data["stage"]) == ("status", "cancelled", stage)
        assert error.type == "error"
        assert {k: error.data[k] for k in ("code", "message", "detail")} == expected_error
        assert error.data["request_id"] == rid and error.data["seq"] == events[-1].seq
    # The cancellations come before the new request's queued event in the session's event order.
    (queued_event,) = await _events(db, new.record["id"])
    async with db.sessions() as s:
        last_cancel = await s.scalar(
            select(func.max(EventRow.id)).where(EventRow.request_id.in_([uuid.UUID(i) for i in old_ids]))
        )
    assert last_cancel is not None and queued_event.id > last_cancel


async def test_interrupt_ignores_the_queue_limit_and_an_idle_session_just_admits(db: Database) -> None:
    for i in range(20):
        await _admit(db, "p-int-full", f"q{i}")
    new = await _admit(db, "p-int-full", "newer", on_busy="interrupt")
    assert new.record["ordinal"] == 21 and len(new.superseded) == 20
    idle = await _admit(db, "p-int-idle", on_busy="interrupt")
    assert idle.created and idle.superseded == ()


async def test_the_session_setting_is_the_default_and_the_request_overrides_it(db: Database) -> None:
    first = (await _admit(db, "p-set")).record
    await _set_on_busy(db, "p-set", "reject")
    with pytest.raises(SessionBusyRejected):
        await _admit(db, "p-set")
    second = (await _admit(db, "p-set", on_busy="enqueue")).record
    assert second["ordinal"] == 2
    await _set_on_busy(db, "p-set", "interrupt")
    with pytest.raises(SessionBusyRejected):
        await _admit(db, "p-set", on_busy="reject")
    newest = await _admit(db, "p-set")
    assert [str(i) for i in newest.superseded] == [first["id"], second["id"]]
    # A cleared setting (null) is the default again: enqueue.
    await _set_on_busy(db, "p-set", None)
    assert (await _admit(db, "p-set")).superseded == ()
