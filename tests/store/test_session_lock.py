"""The session row lock held by admission / clear must not block a worker appending an event.

A worker's ``append_event`` takes the session's event advisory lock and then inserts an event row,
whose foreign key takes ``KEY SHARE`` on the session row. Admission holds the session row while it
waits for that advisory lock (to append its own ``queued`` event); had it taken ``FOR UPDATE``, the two
would deadlock (PostgreSQL fails one: a 500 on POST). ``FOR NO KEY UPDATE`` lets the insert through.
"""

from __future__ import annotations

import asyncio

from service.store.db import Database
from service.store.events import append_event
from service.store.sessions import lock_or_create_session, lock_session
from tests.factories import admit, make_session


async def test_an_event_append_is_not_blocked_by_admission_or_clear_holding_the_session_row(
    db: Database,
) -> None:
    sid = await make_session(db, "p-lock")
    rid = await admit(db, sid, "q")
    for lock in (lock_or_create_session, lock_session):
        async with db.sessions() as holder:
            owner = await lock(holder, "default", "p-lock")
            assert owner is not None and owner.id == sid

            async def worker_append() -> None:
                async with db.sessions() as session, session.begin():
                    await append_event(session, rid, "progress", {"stage": "preparing", "what": "test"})

            # With the lock still held, the worker's append (advisory lock + FK check) completes.
            await asyncio.wait_for(worker_append(), 5)
            await holder.rollback()
