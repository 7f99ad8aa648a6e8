"""The guarded memory write: only while running and before a clear; a clear racing it never loses."""

from __future__ import annotations

import asyncio
import random
import uuid

from service.store import memory, queue
from service.store.db import Database
from tests.factories import admit, clear, make_session


async def _running(db: Database, parent: str = "p") -> tuple[uuid.UUID, uuid.UUID]:
    sid = await make_session(db, parent)
    rid = await admit(db, sid, "q")
    async with db.sessions() as session, session.begin():
        claimed, _ = await queue.try_claim(session, owner="w1", lease_s=30, max_running=100)
    assert claimed is not None and claimed.id == rid
    return sid, rid


async def test_saves_qa_summary_and_upserts_context_summaries_by_key(db: Database) -> None:
    sid, rid = await _running(db)
    async with db.sessions() as session, session.begin():
        assert await memory.save_memory(
            session, rid, owner="w1", qa_summary={"text": "s1", "covered_through_ordinal": 3}
        )
    async with db.sessions() as session, session.begin():
        assert await memory.save_memory(session, rid, owner="w1", context_summary={"key": "k1", "text": "a"})
    async with db.sessions() as session, session.begin():
        assert await memory.save_memory(session, rid, owner="w1", context_summary={"key": "k2", "text": "b"})
    async with db.sessions() as session, session.begin():
        assert await memory.save_memory(session, rid, owner="w1", context_summary={"key": "k1", "text": "c"})
    async with db.sessions() as session:
        mem = await memory.load_memory(session, sid)
    assert mem["qa_summary"] == {"text": "s1", "covered_through_ordinal": 3}
    assert [(c["key"], c["text"]) for c in mem["context_summaries"]] == [("k2", "b"), ("k1", "c")]


async def test_context_summary_cache_keeps_only_the_newest(db: Database) -> None:
    sid, rid = await _running(db)
    for i in range(memory.MAX_CONTEXT_SUMMARIES + 3):
        async with db.sessions() as session, session.begin():
            assert await memory.save_memory(session, rid, owner=None, context_summary={"key": f"k{i}"})
    async with db.sessions() as session:
        mem = await memory.load_memory(session, sid)
    keys = [c["key"] for c in mem["context_summaries"]]
    assert keys == [f"k{i}" for i in range(3, memory.MAX_CONTEXT_SUMMARIES + 3)]


async def test_no_write_when_not_running_or_not_the_owner(db: Database) -> None:
    sid = await make_session(db)
    rid = await admit(db, sid, "q")
    async with db.sessions() as session, session.begin():
        assert not await memory.save_memory(session, rid, owner=None, qa_summary={"text": "queued"})
    async with db.sessions() as session, session.begin():
        await queue.try_claim(session, owner="w1", lease_s=30, max_running=4)
    async with db.sessions() as session, session.begin():
        assert not await memory.save_memory(session, rid, owner="w2", qa_summary={"text": "stranger"})
    async with db.sessions() as session:
        assert (await memory.load_memory(session, sid))["qa_summary"] is None


async def test_a_clear_racing_summary_writes_never_brings_data_back(db: Database) -> None:
    """Many interleavings of one clear against a burst of summary writes: after the clear, empty."""
    rng = random.Random(6)
    for round_no in range(25):
        sid, rid = await _running(db, f"race-{round_no}")

        async def write(i: int, rid: uuid.UUID = rid) -> bool:
            await asyncio.sleep(rng.random() * 0.01)
            async with db.sessions() as session, session.begin():
                return await memory.save_memory(
                    session, rid, owner="w1", qa_summary={"text": f"s{i}"}, context_summary={"key": f"k{i}"}
                )

        async def clear_it(parent: str = f"race-{round_no}") -> None:
            await asyncio.sleep(rng.random() * 0.01)
            await clear(db, parent)

        await asyncio.gather(clear_it(), *(write(i) for i in range(6)))
        async with db.sessions() as session:
            mem = await memory.load_memory(session, sid)
        assert mem == {"qa_summary": None, "context_summaries": []}, f"round {round_no}: {mem}"
        # A write after the clear is refused outright.
        async with db.sessions() as session, session.begin():
            assert not await memory.save_memory(session, rid, owner="w1", qa_summary={"text": "late"})


async def test_a_summary_written_is_not_session_activity(db: Database) -> None:
    """The session list orders by activity (what a client did); a summary written by the service —
    in a request or a background job — must not move a session ahead of one asked later."""
    from sqlalchemy import select

    from service.store.models import SessionRow

    sid, rid = await _running(db)
    async with db.sessions() as session:
        before = await session.scalar(select(SessionRow.updated_at).where(SessionRow.id == sid))
    await asyncio.sleep(0.01)
    async with db.sessions() as session, session.begin():
        assert await memory.save_memory(session, rid, owner="w1", qa_summary={"covered_through_ordinal": 1})
    async with db.sessions() as session:
        after = await session.scalar(select(SessionRow.updated_at).where(SessionRow.id == sid))
        assert (await memory.load_memory(session, sid))["qa_summary"] == {"covered_through_ordinal": 1}
    assert after == before
