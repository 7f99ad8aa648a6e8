"""A background job's claim in one statement (``sidequest_claim_job``, service/store/sql/jobs.sql)
and its row's writes, on real PostgreSQL.

The claim keeps every rule in that one statement — the global background cap (a request's
single-flight registration takes no slot), one running job per (session, kind), the oldest first,
the ``running`` memory event — and returns what the job reads of its session.
A job's parallel calls are counted on its row in one write per round, each call starting only once
it is counted.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import text

from service.pipeline.recorder import JobRecorder
from service.providers.calling import CallRecord
from service.store import jobs, ledger, queries
from service.store.db import Database
from service.store.events import session_events_with_deletion
from service.vocabulary import JobKind, Status
from tests.factories import add_snapshot, enqueue_job, fail_once, make_session


async def _claim(db: Database, max_running: int = 10) -> jobs.ClaimedJob | None:
    async with db.connection() as conn, conn.transaction():
        return await jobs.claim_job(conn, owner="w1", lease_s=30, max_running=max_running)


async def _sql(db: Database, statement: str, **params: Any) -> Any:
    async with db.sessions() as session, session.begin():
        result = await session.execute(text(statement), params)
        return result.scalar() if result.returns_rows else None  # type: ignore[attr-defined]


async def test_the_claim_returns_the_job_and_what_it_reads_of_its_session(db: Database) -> None:
    sid = await make_session(db)
    await _sql(
        db,
        "UPDATE side_question_sessions SET settings = CAST(:s AS jsonb), "
        "memory = memory || CAST(:m AS jsonb) WHERE id = :id",
        s='{"context_window": 64000}',
        m='{"note": "kept"}',
        id=sid,
    )
    job_id = await enqueue_job(db, sid, JobKind.QA_FOLD, "1-3")
    claimed = await _claim(db)
    assert claimed is not None
    assert (claimed.id, claimed.session_id, claimed.kind, claimed.key) == (job_id, sid, "qa_fold", "1-3")
    assert claimed.params["k"] == "1-3" and claimed.params["made_by"] == "background"
    assert claimed.attempt == 1 and claimed.clear_version == 0 and not claimed.cleared
    assert claimed.settings == {"context_window": 64000}
    assert claimed.memory["note"] == "kept"
    status = await _sql(
        db, "SELECT status || ':' || lease_owner FROM side_question_jobs WHERE id = :id", id=job_id
    )
    assert status == "running:w1"
    async with db.sessions() as session:
        events = await session_events_with_deletion(session, sid, 0)
    memory_events = [e.data for e, _, _ in events if e.type == "memory"]
    assert [(e["job_id"], e["status"], e["calls"], e["covered"]) for e in memory_events] == [
        (str(job_id), "queued", 0, None),
        (str(job_id), "running", 0, None),
    ]
    assert memory_events[-1]["request_id"] is None and memory_events[-1]["seq"] is None
    assert memory_events[-1]["at"].endswith("Z")


async def test_a_job_whose_session_was_cleared_since_it_was_queued_is_claimed_as_cleared(
    db: Database,
) -> None:
    sid = await make_session(db)
    await enqueue_job(db, sid, JobKind.QA_FOLD, "1-3")
    await _sql(
        db, "UPDATE side_question_sessions SET clear_version = clear_version + 1 WHERE id = :id", id=sid
    )
    claimed = await _claim(db)
    assert claimed is not None and claimed.cleared and claimed.session_clear_version == 1


async def test_the_claim_keeps_the_cap_and_one_running_job_per_session_and_kind(db: Database) -> None:
    one, two = await make_session(db, "p-1"), await make_session(db, "p-2")
    first = await enqueue_job(db, one, JobKind.QA_FOLD, "1-3")
    same_kind = await enqueue_job(db, one, JobKind.QA_FOLD, "4-6")
    other_kind = await enqueue_job(db, one, JobKind.CONTEXT_SUMMARY, "snapshot:s")
    other_session = await enqueue_job(db, two, JobKind.QA_FOLD, "1-3")
    # A request's registration is running, but takes no background slot and is never claimed.
    async with db.sessions() as session, session.begin():
        registered = await jobs.register_inline(
            session,
            two,
            kind=JobKind.CONTEXT_SUMMARY,
            key="registered",
            request_id=uuid.uuid4(),
            owner="w2",
            clear_version=0,
            lease_s=30,
        )
    assert registered is not None
    claimed = [await _claim(db, max_running=3) for _ in range(4)]
    # Oldest first; the second fold of session one waits for the first (same session and kind);
    # the cap of 3 stops the fourth claim although session one's second fold is still queued.
    assert [c.id if c else None for c in claimed] == [first, other_kind, other_session, None]
    assert await _sql(db, "SELECT status FROM side_question_jobs WHERE id = :id", id=same_kind) == "queued"
    async with db.connection() as conn, conn.transaction():
        ended = await jobs.finish_job(
            conn, first, "w1", status=Status.SUCCEEDED, calls=0, covered=None, error=None
        )
    assert ended
    after = await _claim(db, max_running=3)
    assert after is not None and after.id == same_kind


async def test_nothing_queued_claims_nothing(db: Database) -> None:
    assert await _claim(db) is None


@pytest.fixture
async def running_job(db: Database) -> uuid.UUID:
    sid = await make_session(db)
    await enqueue_job(db, sid, JobKind.QA_FOLD, "1-3")
    claimed = await _claim(db)
    assert claimed is not None
    return claimed.id


async def _calls(db: Database, job_id: uuid.UUID) -> int:
    return int(await _sql(db, "SELECT calls FROM side_question_jobs WHERE id = :id", id=job_id))


async def test_attempts_starting_together_are_counted_in_one_write(
    db: Database, running_job: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes: list[int] = []
    count = jobs.count_calls

    async def spy(x: Any, job_id: uuid.UUID, n: int = 1) -> None:
        writes.append(n)
        await count(x, job_id, n)

    monkeypatch.setattr(jobs, "count_calls", spy)
    recorder = JobRecorder(db, running_job)
    await asyncio.gather(*(recorder.attempt_started() for _ in range(4)))
    # Every attempt returned only after the write: the row says 4 now.
    assert writes == [4] and await _calls(db, running_job) == 4
    await recorder.attempt_started()  # a later attempt (a retry, the merge) has its own write
    assert writes == [4, 1] and await _calls(db, running_job) == 5


async def test_a_cancelled_attempt_leaves_the_round_s_write_to_the_others(
    db: Database, running_job: uuid.UUID
) -> None:
    recorder = JobRecorder(db, running_job)
    first = asyncio.ensure_future(recorder.attempt_started())
    others = [asyncio.ensure_future(recorder.attempt_started()) for _ in range(2)]
    await asyncio.sleep(0)  # all three have joined the round
    first.cancel()
    await asyncio.gather(*others)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await _calls(db, running_job) == 3


async def test_a_context_summary_job_is_claimed_with_its_snapshot_s_content_hash(db: Database) -> None:
    sid = await make_session(db)
    await add_snapshot(db, sid, "s-1", {"messages": [{"role": "user", "content": "hello"}]})
    stored = await _sql(
        db, "SELECT content_hash FROM main_snapshots WHERE session_id = :s AND snapshot_id = 's-1'", s=sid
    )
    named = await enqueue_job(db, sid, JobKind.CONTEXT_SUMMARY, "snapshot:s-1", {"snapshot_id": "s-1"})
    missing = await enqueue_job(db, sid, JobKind.CONTEXT_SUMMARY, "snapshot:gone", {"snapshot_id": "gone"})
    first = await _claim(db)
    assert first is not None and first.id == named and first.snapshot_hash == stored
    async with db.connection() as conn, conn.transaction():
        assert await jobs.finish_job(conn, named, "w1", status=Status.SUCCEEDED, calls=0)
    second = await _claim(db)
    assert second is not None and second.id == missing and second.snapshot_hash is None


async def test_call_ends_that_come_together_are_appended_in_order_in_few_writes(
    db: Database, running_job: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.providers.base import CallUsage
    from service.store import ledger

    writes: list[list[int]] = []
    append = ledger.append_calls
    release, writing = asyncio.Event(), asyncio.Event()

    async def spy(x: Any, job_id: uuid.UUID, entries: Any, *, job: bool = False) -> Any:
        writes.append([e.input_tokens for e in entries])
        writing.set()
        await release.wait()  # the first write is in flight until the test lets it go
        return await append(x, job_id, entries, job=job)

    monkeypatch.setattr(ledger, "append_calls", spy)
    recorder = JobRecorder(db, running_job)

    async def end(tokens: int) -> None:
        usage = CallUsage(reported=True, input_tokens=tokens, output_tokens=1)
        await recorder.record_call(CallRecord("context_summary", "m", "ok", usage))

    first = asyncio.ensure_future(end(1))
    await writing.wait()
    rest = [asyncio.ensure_future(end(n)) for n in (2, 3, 4)]  # they come while the first is written
    await asyncio.sleep(0.01)
    assert writes == [[1]] and not any(task.done() for task in [first, *rest])
    release.set()
    await asyncio.gather(first, *rest)
    assert writes == [[1], [2, 3, 4]]  # the three that waited share one write, in order
    usage = await _sql(db, "SELECT usage::text FROM side_question_jobs WHERE id = :id", id=running_job)
    assert '"input_tokens": 10' in usage  # the totals of all four


async def test_a_failed_group_write_fails_each_of_its_callers_and_the_next_write_runs() -> None:
    from service.pipeline.recorder import GroupWrite

    written: list[list[int]] = []
    fail = True

    async def write(items: list[int]) -> None:
        await asyncio.sleep(0.001)
        if fail:
            raise ConnectionError("database gone")
        written.append(items)

    group: GroupWrite[int] = GroupWrite(write)
    results = await asyncio.gather(group.add(1), group.add(2), return_exceptions=True)
    assert [type(r) for r in results] == [ConnectionError, ConnectionError]
    fail = False
    await asyncio.gather(group.add(3), group.add(4))
    assert written == [[3, 4]]


async def test_the_sql_functions_restate_the_python_rules_they_share_exactly(db: Database) -> None:
    """The job claim and the session events are SQL functions (0004, 0009) that restate, in SQL,
    names and a condition the Python store also uses: the channels the listener subscribes to, and
    what makes a row a background job rather than a request's registration. Changing one home without
    the other breaks this test rather than the service."""
    from service.vocabulary import EVENTS_CHANNEL, JOBS_CHANNEL

    async def source(name: str) -> str:
        return str(await _sql(db, f"SELECT pg_get_functiondef('{name}'::regproc)"))

    background = "coalesce(params->>'made_by', 'background') = 'background'"
    claim = await source("sidequest_claim_job")
    assert claim.count(background.replace("params", "j.params")) == 2  # the cap's count and the pick
    for statement in (queries.job_outcomes, queries.job_tokens, queries.background_overviews):
        assert background in statement.text
    assert f"pg_notify('{JOBS_CHANNEL}'" in await source("sidequest_memory_event")
    for events in ("sidequest_append_session_event", "sidequest_append_event"):
        assert f"'{EVENTS_CHANNEL}'" in await source(events)


async def test_a_job_call_appended_twice_is_recorded_once(db: Database, running_job: uuid.UUID) -> None:
    """A job's ledger write tried again after a lost reply (its first COMMIT applied) adds nothing."""
    entry = ledger.CallEntry(purpose="qa_summary", model="m", status="ok", reported=True, input_tokens=40)
    for _ in range(2):
        async with db.connection() as conn:
            appended = await ledger.append_calls(conn, running_job, [entry], job=True)
    usage = appended.usage
    assert [c["call_id"] for c in usage["calls"]] == [entry.call_id] and usage["input_tokens"] == 40


async def test_a_job_call_is_recorded_across_a_dropped_connection(
    db: Database, running_job: uuid.UUID, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job's call that ends while the database is away keeps its tokens: its ledger write is tried
    again, as a request's is."""
    from service.providers.base import CallUsage

    failed = fail_once(monkeypatch, ledger, "append_calls")
    recorder = JobRecorder(db, running_job)
    usage = CallUsage(reported=True, input_tokens=7, output_tokens=1)
    await recorder.record_call(CallRecord("qa_summary", "m", "ok", usage))
    assert failed == [1]
    stored = await _sql(db, "SELECT usage::text FROM side_question_jobs WHERE id = :id", id=running_job)
    assert '"input_tokens": 7' in stored
