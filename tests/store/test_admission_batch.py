"""Group commit for admissions (service.store.admission_batch, the sidequest_admit_many procedure).

Admissions that wait while a CALL is in flight go together in one CALL; each is answered on its
own (its record, or its own refusal), a database error in a batch is the one admission's that caused
it, two batches never deadlock, and nothing handed in is lost to a cancelled caller or a shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from sqlalchemy import func, select

from service.store import admission_batch
from service.store.admission import (
    Admission,
    Admitted,
    IdempotencyConflict,
    QueueFull,
    _arguments,
    admit,
)
from service.store.db import Database, connect, is_unavailable, plain_dsn
from service.store.models import EventRow, RequestRow, SessionRow
from service.vocabulary import superseded_error

TENANT = "t1"


async def _admit(
    db: Database, parent: str, question: str = "q", *, max_queued: int = 20, **kw: Any
) -> Admitted:
    return await admit(db, TENANT, parent, Admission(question=question, **kw), max_queued=max_queued)


async def _count(db: Database, table: Any) -> int:
    async with db.sessions() as s:
        return int(await s.scalar(select(func.count()).select_from(table)) or 0)


async def test_waiting_admissions_share_one_call_and_each_gets_its_own_answer(db: Database) -> None:
    for i in range(3):  # a session whose queue is full (limit 3 below) and one with a used key
        await _admit(db, "p-full", f"old {i}", max_queued=3)
    earlier = await _admit(db, "p-key", "keyed", idempotency_key="k1", body_hash="h1")
    calls_before = db.admissions.calls
    heard: list[str] = []
    conn = await asyncpg.connect(plain_dsn(db.url))
    try:
        await conn.add_listener("sidequest_events", lambda _c, _p, _ch, payload: heard.append(payload))
        jobs = [_admit(db, f"p-{i % 6}", f"q{i}", max_queued=100) for i in range(30)]
        jobs += [_admit(db, "p-full", "one too many", max_queued=3)]
        jobs += [_admit(db, "p-key", "keyed", idempotency_key="k1", body_hash="h1")]
        jobs += [_admit(db, "p-key", "keyed", idempotency_key="k1", body_hash="other")]
        outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        for _ in range(50):
            if len(heard) >= 30:
                break
            await asyncio.sleep(0.05)
    finally:
        await conn.close()
    # Everything waiting went in one CALL (the second sender found nothing left).
    assert db.admissions.calls - calls_before == 1
    created = outcomes[:30]
    assert all(isinstance(o, Admitted) and o.created for o in created), outcomes
    for s in range(6):
        mine = [o for i, o in enumerate(created) if i % 6 == s]
        assert all(isinstance(o, Admitted) and o.record["parent_id"] == f"p-{s}" for o in mine)
        # Arrival order kept within a session: consecutive ordinals, in the order asked.
        assert [o.record["ordinal"] for o in mine if isinstance(o, Admitted)] == [1, 2, 3, 4, 5]
        assert [o.record["question"] for o in mine if isinstance(o, Admitted)] == [
            f"q{i}" for i in range(30) if i % 6 == s
        ]
    full, replay, conflict = outcomes[30:]
    assert isinstance(full, QueueFull) and full.detail == {"max_queued": 3}
    assert isinstance(replay, Admitted) and not replay.created and replay.record == earlier.record
    assert isinstance(conflict, IdempotencyConflict)
    assert await _count(db, RequestRow) == 3 + 1 + 30
    assert await _count(db, EventRow) == 3 + 1 + 30
    # Every queued event was notified, after the commit.
    assert len(heard) == 30


async def test_an_interrupt_in_a_batch_supersedes_and_reports_its_own_cancellations(db: Database) -> None:
    queued = [(await _admit(db, "p-int", f"queued {i}")).record["id"] for i in range(2)]
    outcomes = await asyncio.gather(
        _admit(db, "p-other", "first"),
        _admit(db, "p-int", "newer", on_busy="interrupt"),
        _admit(db, "p-other", "second"),
    )
    assert [str(i) for i in outcomes[1].superseded] == queued
    assert outcomes[0].superseded == () and outcomes[2].superseded == ()
    async with db.sessions() as s:
        rows = [await s.get(RequestRow, uuid.UUID(rid)) for rid in queued]
    assert all(r is not None and r.status == "cancelled" for r in rows)
    assert all(r is not None and r.error == superseded_error(outcomes[1].record["id"]) for r in rows)


async def test_a_database_error_in_a_batch_is_the_one_admissions_that_caused_it(db: Database) -> None:
    same_id = uuid.uuid4()

    def args(parent: str, request_id: uuid.UUID | None = None) -> tuple[Any, ...]:
        built = list(_arguments(TENANT, parent, Admission(question="q"), None, 20))
        if request_id is not None:
            built[2] = request_id
        return tuple(built)

    batch = [args("p-a"), args("p-b", same_id), args("p-c"), args("p-d", same_id), args("p-e")]
    outcomes = await asyncio.gather(*(db.admissions.admit(a) for a in batch), return_exceptions=True)
    # The batch rolled back as a whole, then each went alone: one duplicate wins, the other fails.
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(failed) == 1 and isinstance(failed[0], asyncpg.UniqueViolationError), outcomes
    assert isinstance(outcomes[1], admission_batch.AdmitResult) and outcomes[1].outcome == "created"
    assert all(isinstance(o, admission_batch.AdmitResult) for i, o in enumerate(outcomes) if i != 3)
    assert db.admissions.fallbacks == 1
    assert await _count(db, RequestRow) == 4
    assert await _count(db, EventRow) == 4
    # The failed one left no session behind (its own CALL rolled back), the others one each.
    assert await _count(db, SessionRow) == 4


async def test_two_batches_over_the_same_sessions_never_deadlock(database_url: str, db: Database) -> None:
    other = connect(database_url, pool_size=5)  # a second API process
    try:
        parents = [f"p-{i}" for i in range(40)]
        for parent in parents:
            await _admit(db, parent, "first")
        for _ in range(3):
            await asyncio.gather(
                asyncio.gather(*(_admit(db, p, "forward", max_queued=100) for p in parents)),
                asyncio.gather(*(_admit(other, p, "backward", max_queued=100) for p in reversed(parents))),
            )
        # A deadlock would have been detected by PostgreSQL and the batch sent again alone.
        assert db.admissions.fallbacks == 0 and other.admissions.fallbacks == 0
        async with db.sessions() as s:
            ordinals = (await s.execute(select(func.max(RequestRow.ordinal)))).scalar()
        assert ordinals == 7
    finally:
        await other.dispose()


async def test_a_cancelled_caller_does_not_cancel_its_admission(db: Database) -> None:
    task = asyncio.create_task(_admit(db, "p-gone", "asked, then hung up"))
    await asyncio.sleep(0)  # handed in
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await db.admissions.drain()
    assert await _count(db, RequestRow) == 1


async def test_dispose_answers_every_admission_handed_in(database_url: str) -> None:
    own = connect(database_url, pool_size=5)
    tasks = [asyncio.create_task(_admit(own, f"p-d{i % 3}", f"q{i}")) for i in range(12)]
    await asyncio.sleep(0)
    await own.dispose()
    results = await asyncio.gather(*tasks)
    assert sorted(r.record["ordinal"] for r in results) == sorted([1, 2, 3, 4] * 3)


class _InstantConnection:
    """Answers either CALL after a random few event-loop steps (no database: interleavings only)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def fetchrow(self, query: str, *args: Any) -> dict[str, Any]:
        for _ in range(self.rng.randint(0, 3)):
            await asyncio.sleep(0)
        if "sidequest_admit_many" in query:
            n = len(args[0])
            return {"outcome": ["created"] * n, "detail": [None] * n, "superseded": [[]] * n, "req": [{}] * n}
        return {"outcome": "created", "detail": None, "superseded": [], "req": {}}


class _InstantPool:
    def __init__(self, rng: random.Random) -> None:
        self.connection = _InstantConnection(rng)

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[_InstantConnection]:
        yield self.connection


async def test_no_admission_is_left_waiting_whatever_the_interleaving() -> None:
    """A sender that finds nothing left must stop counting as one in that same step, or an
    admission handed in while both senders are ending waits until the next admission comes."""
    rng = random.Random(1)
    pool = _InstantPool(rng)

    async def get_pool() -> Any:
        return pool

    batcher = admission_batch.AdmissionBatcher(get_pool, is_unavailable)

    async def one(i: int) -> admission_batch.AdmitResult:
        for _ in range(rng.randint(0, 4)):
            await asyncio.sleep(0)
        args = _arguments(TENANT, f"p-{i % 7}", Admission(question="q"), None, 20)
        return await batcher.admit(args)

    for _ in range(300):
        burst = rng.randint(1, 6)
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(burst))), 2)
    assert batcher.admissions >= 300


class _DeadPool:
    """A database that does not answer: every connection attempt fails after ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.attempts = 0

    @contextlib.asynccontextmanager
    async def acquire(self) -> AsyncIterator[Any]:
        self.attempts += 1
        await asyncio.sleep(self.delay)
        raise ConnectionRefusedError("no database")
        yield  # pragma: no cover - never reached


async def test_admissions_waiting_behind_an_unreachable_database_fail_with_it() -> None:
    pool = _DeadPool(0.2)

    async def get_pool() -> Any:
        return pool

    batcher = admission_batch.AdmissionBatcher(get_pool, is_unavailable)

    async def one(i: int) -> admission_batch.AdmitResult:
        return await batcher.admit(_arguments(TENANT, f"p-{i}", Admission(question="q"), None, 20))

    first = []
    for i in range(admission_batch.IN_FLIGHT):  # one each: every sender now waits on the database
        first.append(asyncio.create_task(one(i)))
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.03)
    later = [asyncio.create_task(one(i)) for i in range(100, 110)]
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcomes = await asyncio.gather(*first, *later, return_exceptions=True)
    # All fail as the first attempts do (~0.15 s from here), not one connect timeout later.
    assert loop.time() - started < 0.3
    assert all(isinstance(o, ConnectionRefusedError) for o in outcomes), outcomes
    assert pool.attempts == admission_batch.IN_FLIGHT
