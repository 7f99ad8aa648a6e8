"""The usage ledger: every call appended with totals recomputed atomically, none lost under concurrency."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from service.store import ledger
from service.store.db import Database
from service.store.models import RequestRow
from tests.factories import admit, make_session


async def _stored_usage(db: Database, rid: uuid.UUID) -> dict[str, Any]:
    """The usage object as the request row holds it."""
    async with db.sessions() as session:
        row = await session.get(RequestRow, rid)
        assert row is not None
        return dict(row.usage)


def _entry(i: int, *, reported: bool = True, status: str = "ok") -> ledger.CallEntry:
    return ledger.CallEntry(
        purpose="answer",
        model="m",
        status=status,
        reported=reported,
        input_tokens=10 * i if reported else 0,
        output_tokens=i if reported else 0,
        reasoning_tokens=1 if reported else 0,
        cached_tokens=2 * i if reported else 0,
    )


async def test_append_call_keeps_calls_in_order_and_totals_equal_their_sum(db: Database) -> None:
    rid = await admit(db, await make_session(db), "q")
    async with db.sessions() as session, session.begin():
        await ledger.append_calls(session, rid, [_entry(1)])
    async with db.sessions() as session, session.begin():
        await ledger.append_calls(session, rid, [_entry(0, reported=False, status="failed")])
    async with db.sessions() as session, session.begin():
        usage = (await ledger.append_calls(session, rid, [_entry(3, status="cancelled")])).usage
    assert [c["status"] for c in usage["calls"]] == ["ok", "failed", "cancelled"]
    assert usage["calls"][1]["reported"] is False and usage["calls"][1]["input_tokens"] == 0
    assert (
        usage["input_tokens"],
        usage["output_tokens"],
        usage["reasoning_tokens"],
        usage["cached_tokens"],
    ) == (
        40,
        4,
        2,
        8,
    )
    assert await _stored_usage(db, rid) == usage


async def test_concurrent_appends_lose_no_call(db: Database) -> None:
    rid = await admit(db, await make_session(db), "q")

    async def one(i: int) -> None:
        async with db.sessions() as session, session.begin():
            await ledger.append_calls(session, rid, [_entry(i)])

    await asyncio.gather(*(one(i) for i in range(1, 21)))
    usage = await _stored_usage(db, rid)
    assert len(usage["calls"]) == 20
    assert usage["input_tokens"] == 10 * sum(range(1, 21))
    assert usage["output_tokens"] == sum(range(1, 21))


async def test_merge_context_info_replaces_top_level_keys_only(db: Database) -> None:
    rid = await admit(db, await make_session(db), "q")
    async with db.sessions() as session, session.begin():
        await ledger.merge_context_info(session, rid, {"stage": "preparing", "window": 1000})
    async with db.sessions() as session, session.begin():
        await ledger.merge_context_info(session, rid, {"stage": "answering"})
    async with db.sessions() as session:
        row = await session.get(RequestRow, rid)
        assert row is not None
        assert row.context_info == {"stage": "answering", "window": 1000}


async def test_a_retried_append_whose_first_commit_landed_counts_the_call_once(db: Database) -> None:
    """The ledger's write is tried again when the database's reply is lost, and PostgreSQL may have
    applied that COMMIT: the same call (its call_id) appended again adds nothing — no second entry,
    no second usage event (the recorder emits one only for an append that added its call)."""
    from service.pipeline.recorder import LedgerRecorder
    from service.store import queue
    from service.store.events import request_events_after

    rid = await admit(db, await make_session(db), "q")
    async with db.sessions() as session, session.begin():
        claimed, _ = await queue.try_claim(session, owner="w1", lease_s=30.0, max_running=4)
    assert claimed is not None and claimed.id == rid
    entry = _entry(2)
    for attempt in range(2):
        async with db.sessions() as session, session.begin():
            appended = await ledger.append_calls(session, rid, [entry])
        assert appended.added == (attempt == 0)
        assert [c["call_id"] for c in appended.usage["calls"]] == [entry.call_id]
        assert appended.usage["input_tokens"] == 20
    recorder = LedgerRecorder(db, rid, "w1")
    await recorder._write(entry)  # the recorder's own retry finds the call recorded: no event
    await recorder._write(_entry(3))
    async with db.sessions() as session:
        events = await request_events_after(session, rid, 0)
    usage = await _stored_usage(db, rid)
    assert len(usage["calls"]) == 2 and usage["input_tokens"] == 50
    assert [e.data["usage"]["input_tokens"] for e in events if e.type == "usage"] == [50]
