"""Background summary jobs (SPEC §6.6, §6.7) on real PostgreSQL, with a real in-process worker and the
scripted model server at the wire. A summary step's delay makes "the job is still running" a fact the
test waits for (the job's row is ``running``), not a race."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import select, update

from service.config import Settings
from service.store import calibration, jobs, memory, queue
from service.store.admission import clear_session
from service.store.db import Database
from service.store.events import session_events_with_deletion
from service.store.history import latest_context_time
from service.store.models import JobRow, RequestRow, SessionRow
from service.store.sessions import SnapshotJobPolicy, lock_or_create_session, session_overview, store_snapshot
from service.vocabulary import JobKind
from service.worker import start_worker
from service.worker.runner import Worker
from tests.factories import (
    add_history,
    add_snapshot,
    admit,
    enqueue_job,
    fail_once,
    make_session,
    scripted_settings,
    tool_session,
)
from tests.scripted_provider import VALID_SUMMARY, ScriptedServer, Step
from tests.worker.conftest import row_of, wait_for


@pytest.fixture
def server() -> Any:
    with ScriptedServer() as scripted:
        yield scripted


def _settings(database_url: str, server: ScriptedServer, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "lease_s": 1.5,
        "heartbeat_s": 0.3,
        "request_timeout_s": 30.0,
        "background_summaries": "on",
        "summary_parallelism": 1,
    }
    values.update(overrides)
    return scripted_settings(database_url, server.base_url, **values)


@pytest.fixture
def bg_settings(database_url: str, server: ScriptedServer) -> Settings:
    return _settings(database_url, server)


@pytest.fixture
async def worker(bg_settings: Settings, db: Database) -> AsyncIterator[Worker]:
    handle = await start_worker(bg_settings, db)
    try:
        yield handle
    finally:
        await handle.stop()


async def _jobs(db: Database, sid: uuid.UUID) -> list[JobRow]:
    async with db.sessions() as session:
        rows = await session.scalars(
            select(JobRow).where(JobRow.session_id == sid).order_by(JobRow.created_at, JobRow.id)
        )
        return list(rows)


async def _background(db: Database, sid: uuid.UUID) -> list[JobRow]:
    return [j for j in await _jobs(db, sid) if (j.params or {}).get("made_by") == "background"]


async def _status(db: Database, rid: uuid.UUID) -> str:
    return (await row_of(db, rid)).status


async def _done(db: Database, rid: uuid.UUID) -> bool:
    return await _status(db, rid) in ("succeeded", "failed", "cancelled")


async def _job_is(db: Database, job_id: uuid.UUID, *statuses: str) -> bool:
    async with db.sessions() as session:
        state = await jobs.job_state(session, job_id)
    return state is not None and state.status in statuses


def _history(n: int) -> list[tuple[str, str]]:
    return [(f"question {i}?", f"answer {i}.") for i in range(1, n + 1)]


async def _first_fold_queued(db: Database) -> tuple[uuid.UUID, uuid.UUID]:
    """A session with 21 answered questions and the background fold of the first queued: (session, job)."""
    sid = await make_session(db)
    await add_history(db, sid, _history(21))
    return sid, await enqueue_job(db, sid, JobKind.QA_FOLD, "1-1", {"through_ordinal": 1})


async def _memory_events(db: Database, sid: uuid.UUID) -> list[dict[str, Any]]:
    async with db.sessions() as session:
        events = await session_events_with_deletion(session, sid, 0, limit=10_000)
    return [e.data for e, _, _ in events if e.type == "memory"]


# ------------------------------------------------------------------------------------ qa_fold


async def test_an_answer_queues_a_fold_and_the_next_question_finds_the_summary_current(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_history(db, sid, _history(20))
    first = await admit(db, sid, "question 21?")
    await wait_for(lambda: _done(db, first), within=20)
    assert await _status(db, first) == "succeeded"
    # The next question would replay 21 groups: one leaves the window, so a job folds it now.
    await wait_for(lambda: _all_jobs_ended(db, sid), within=20)
    [job] = await _background(db, sid)
    assert (job.kind, job.key, job.status) == ("qa_fold", "1-1", "succeeded")
    assert job.covered == {"covered_through_ordinal": 1}
    summary_calls = server.requests("qa_summary")
    assert len(summary_calls) == 1
    headers = summary_calls[0].headers
    assert headers["x-sidequest-job-id"] == str(job.id) and "x-sidequest-request-id" not in headers

    second = await admit(db, sid, "question 22?")
    await wait_for(lambda: _done(db, second), within=20)
    row = await row_of(db, second)
    assert row.status == "succeeded"
    qa = row.context_info["qa_summary"]
    assert qa["used"] is True and qa["made_by"] == "background" and qa["calls"] == 0
    assert qa["covered_through_ordinal"] == 1 and qa["waited_ms"] == 0
    assert [c["purpose"] for c in row.usage["calls"]] == ["answer"]  # no summary call of its own
    # Every summary call so far was a job's (this answer may already have queued the next fold).
    assert all("x-sidequest-job-id" in r.headers for r in server.requests("qa_summary"))

    # The job's usage is the session's, never a request's; memory events on the session stream.
    async with db.sessions() as session:
        overview = await session_overview(session, "default", "parent-1")
    assert overview is not None
    background = overview["background"]
    assert background["jobs"]["succeeded"] >= 1
    assert [c["purpose"] for c in background["usage"]["calls"]][:1] == ["qa_summary"]
    statuses = [e["status"] for e in await _memory_events(db, sid) if e["job_id"] == str(job.id)]
    assert statuses == ["queued", "running", "succeeded"]


async def test_a_folds_context_time_is_that_of_the_newest_folded_qa_asked_on_a_snapshot(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    """SPEC 6.1: the summary states its context time — a background job's fold as much as a request's."""
    sid = await make_session(db)
    await add_snapshot(db, sid, "old", {"taken_at": "2026-12-01T09:00:00Z", "messages": []})
    await add_snapshot(db, sid, "new", {"taken_at": "2026-12-01T10:00:00Z", "messages": []})
    await add_snapshot(db, sid, "blank", {"taken_at": "", "messages": []})  # an empty one says no time
    ids = await add_history(db, sid, _history(3))
    async with db.sessions() as session, session.begin():
        for rid, snapshot_id in zip(ids, ("old", "new", "blank"), strict=True):
            await session.execute(
                update(RequestRow).where(RequestRow.id == rid).values(snapshot_id=snapshot_id)
            )
    async with db.connection() as conn:
        times = [
            await latest_context_time(conn, sid, after_ordinal=a, through_ordinal=t, clear_version=0)
            for a, t in ((0, 3), (0, 1), (2, 3))
        ]
    assert times == ["2026-12-01T10:00:00Z", "2026-12-01T09:00:00Z", None]

    job_id = await enqueue_job(db, sid, JobKind.QA_FOLD, "1-3", {"through_ordinal": 3})
    await wait_for(lambda: _job_is(db, job_id, "succeeded"), within=20)
    async with db.sessions() as session:
        owner = await session.get(SessionRow, sid)
    assert owner is not None
    assert owner.memory["qa_summary"]["provenance"]["context_time"] == "2026-12-01T10:00:00Z"
    assert "main context as of 2026-12-01T10:00:00Z" in owner.memory["qa_summary"]["rendered"]


async def _all_jobs_ended(db: Database, sid: uuid.UUID) -> bool:
    rows = await _background(db, sid)
    return bool(rows) and all(j.status not in ("queued", "running") for j in rows)


async def test_a_request_waits_for_a_running_fold_instead_of_making_it_again(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    server.script("qa_summary", Step.valid_summary().with_delay(before_s=1.5))
    sid, job_id = await _first_fold_queued(db)
    await wait_for(lambda: _job_is(db, job_id, "running"), within=10)
    # Two requests race the job for the same summary: one set of calls in all.
    first = await admit(db, sid, "question 22?")
    second = await admit(db, sid, "question 23?")
    await wait_for(lambda: _done(db, second), within=30)
    # Every summary call was a job's (each answer queues the next fold), one call per job: no
    # request made a summary a job was making.
    calls = server.requests("qa_summary")
    job_ids = [r.headers.get("x-sidequest-job-id") for r in calls]
    assert None not in job_ids and len(set(job_ids)) == len(job_ids)
    assert job_ids[0] == str(job_id)
    row = await row_of(db, first)
    assert row.status == "succeeded"
    qa = row.context_info["qa_summary"]
    assert qa["made_by"] == "background" and qa["waited_ms"] > 0 and qa["calls"] == 0
    # What the request waited for reaches its answer: the job's summary of the Q&A it folded.
    answer = next(r for r in server.requests("answer") if r.request_id == str(first))
    assert VALID_SUMMARY["objective"] in json.dumps(answer.body)
    async with db.sessions() as session:
        progress = [
            e.data
            for e in await queue_events(session, first)
            if e.type == "progress" and e.data.get("what") == "waiting_for_background"
        ]
    assert progress and progress[0]["job_id"] == str(job_id)
    assert (await row_of(db, second)).status == "succeeded"


async def test_a_fold_that_finds_its_range_taken_answers_with_the_jobs_summary(
    worker: Worker, db: Database, server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A background job takes the fold's range between the request's plan and its registration: the
    request waits for the job, plans its history again, and answers from that plan — the job's
    summary in the prompt — not from the plan made before the wait, which had neither the summary
    nor the folded Q&A."""
    from service.pipeline import history as history_module
    from service.pipeline.waiting import registered as real

    sid = await make_session(db)
    await add_history(db, sid, _history(21))
    server.script("qa_summary", Step.valid_summary().with_delay(before_s=0.5))
    taken: list[uuid.UUID] = []

    @contextlib.asynccontextmanager
    async def racing(rt: Any, kind: JobKind, key: str) -> AsyncIterator[bool]:
        if not taken:
            through = int(key.rsplit("-", 1)[-1])
            taken.append(await enqueue_job(db, sid, kind, key, {"through_ordinal": through}))
        async with real(rt, kind, key) as mine:
            yield mine

    monkeypatch.setattr(history_module, "registered", racing)
    rid = await admit(db, sid, "question 22?")
    await wait_for(lambda: _done(db, rid), within=30)
    row = await row_of(db, rid)
    assert taken and row.status == "succeeded"
    assert row.context_info["qa_summary"]["made_by"] == "background"
    answer = next(r for r in server.requests("answer") if r.request_id == str(rid))
    assert VALID_SUMMARY["objective"] in json.dumps(answer.body)


async def queue_events(session: Any, rid: uuid.UUID) -> list[Any]:
    from service.store.events import request_events_after

    return await request_events_after(session, rid, 0, limit=10_000)


async def test_a_failed_job_is_made_by_the_request_itself_and_never_fails_it(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    server.script("qa_summary", Step.server_error().with_delay(before_s=1.5), Step.valid_summary())
    sid, job_id = await _first_fold_queued(db)
    await wait_for(lambda: _job_is(db, job_id, "running"), within=10)
    rid = await admit(db, sid, "question 22?")
    await wait_for(lambda: _done(db, rid), within=30)
    row = await row_of(db, rid)
    assert row.status == "succeeded"
    assert await _job_is(db, job_id, "failed")
    qa = row.context_info["qa_summary"]
    assert qa["made_by"] == "request" and qa["calls"] == 1 and qa["covered_through_ordinal"] == 1
    assert [c["purpose"] for c in row.usage["calls"]] == ["qa_summary", "answer"]


async def test_a_job_whose_model_call_times_out_says_the_background_job_timed_out(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    handle = await start_worker(_settings(database_url, server, background_timeout_s=1.0), db)
    try:
        server.set_default("qa_summary", Step.valid_summary().with_delay(before_s=5.0))
        _sid, job_id = await _first_fold_queued(db)
        await wait_for(lambda: _job_is(db, job_id, "failed"), within=15)
    finally:
        await handle.stop()
    async with db.sessions() as session:
        error = (await session.get_one(JobRow, job_id)).error
    assert error is not None and error["code"] == "timeout"
    assert error["message"] == "the background job did not finish within its 1s deadline"
    assert error["detail"] == {"timeout_s": 1.0, "stage": "qa_fold"}


async def test_a_job_whose_statement_times_out_is_left_to_its_lease_not_failed_as_a_timeout(
    worker: Worker, db: Database, server: ScriptedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # asyncpg's command timeout is a bare TimeoutError: long before the job's deadline it is the
    # database going away (a failover), so nothing is written and the lease brings the job back.
    failures = fail_once(monkeypatch, memory, "save_memory", TimeoutError())
    _sid, job_id = await _first_fold_queued(db)
    await wait_for(lambda: _job_is(db, job_id, "succeeded", "failed"), within=30)
    async with db.sessions() as session:
        job = await session.get_one(JobRow, job_id)
    assert failures == [1]
    assert (job.status, job.error, job.attempt) == ("succeeded", None, 2)


async def test_a_clear_during_a_job_cancels_it_and_resurrects_nothing(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    server.script("qa_summary", Step.valid_summary().with_delay(before_s=1.5))
    sid, job_id = await _first_fold_queued(db)
    await wait_for(lambda: _job_is(db, job_id, "running"), within=10)

    async def call_in_flight() -> bool:
        return bool(server.requests("qa_summary"))

    await wait_for(call_in_flight, within=10)  # the clear lands while the job's call is at the model
    async with db.sessions() as session, session.begin():
        assert await clear_session(session, "default", "parent-1") is not None
    assert await _job_is(db, job_id, "cancelled")
    await asyncio.sleep(2.0)  # past the call's delay: a late write would land now
    async with db.sessions() as session:
        mem = await memory.load_memory(session, sid)
    assert mem["qa_summary"] is None
    assert await _job_is(db, job_id, "cancelled")
    assert job_id not in worker.jobs.tasks
    events = [e for e in await _memory_events(db, sid) if e["job_id"] == str(job_id)]
    assert [e["status"] for e in events] == ["queued", "running", "cancelled"]
    # The call in flight when the clear came counts as a call, and its usage is recorded as cancelled.
    assert events[-1]["calls"] == 1
    [job] = [j for j in await _jobs(db, sid) if j.id == job_id]
    assert [c["status"] for c in job.usage["calls"]] == ["cancelled"]


async def test_a_job_whose_worker_died_runs_again_and_requests_are_unaffected(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    await worker.jobs.stop()  # this process runs no jobs until the dead one's lease expired
    sid, job_id = await _first_fold_queued(db)
    async with db.sessions() as session, session.begin():
        dead = await jobs.claim_job(session, owner="dead-worker", lease_s=0.5, max_running=10)
    assert dead is not None and dead.id == job_id
    rid = await admit(db, sid, "question 22?")
    # The request waits for the (dead) job until the sweep puts the job back; then it folds itself
    # or uses the rerun — either way it succeeds and the job does not stay running.
    await wait_for(lambda: _done(db, rid), within=30)
    row = await row_of(db, rid)
    assert row.status == "succeeded", row.error
    await wait_for(lambda: _job_is(db, job_id, "queued", "succeeded", "failed", "cancelled"), within=10)
    async with db.sessions() as session:
        attempt = await session.scalar(select(JobRow.attempt).where(JobRow.id == job_id))
    assert attempt == 1


async def test_the_sweep_reruns_a_lost_job_once_then_fails_it(db: Database) -> None:
    sid = await make_session(db)
    job_id = await enqueue_job(db, sid, JobKind.QA_FOLD, "1-1", {"through_ordinal": 1})
    for attempt in (1, 2):
        async with db.sessions() as session, session.begin():
            claimed = await jobs.claim_job(session, owner=f"dead-{attempt}", lease_s=0.01, max_running=10)
        assert claimed is not None and claimed.attempt == attempt
        await asyncio.sleep(0.05)
        async with db.sessions() as session, session.begin():
            swept = await queue.sweep_expired(session)
        if attempt == 1:
            assert swept.jobs_requeued == [job_id] and await _job_is(db, job_id, "queued")
        else:
            assert swept.jobs_failed == [job_id] and await _job_is(db, job_id, "failed")
    async with db.sessions() as session:
        state = await jobs.job_state(session, job_id)
    assert state is not None and state.error is not None and state.error["code"] == "worker_lost"


async def test_one_job_per_session_kind_and_key_is_enforced_by_the_database(db: Database) -> None:
    sid = await make_session(db)
    await enqueue_job(db, sid, JobKind.QA_FOLD, "1-5", {"through_ordinal": 5})
    async with db.sessions() as session, session.begin():
        fold = JobKind.QA_FOLD
        again = await jobs.enqueue_job(session, sid, kind=fold, key="1-5", params={}, clear_version=0)
        other = await jobs.enqueue_job(session, sid, kind=fold, key="6-9", params={}, clear_version=0)
        stale = await jobs.enqueue_job(session, sid, kind=fold, key="10-11", params={}, clear_version=7)
    assert again is None and other is not None and stale is None


async def test_two_workers_never_run_the_same_job(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    settings = _settings(database_url, server, max_background_concurrency=4)
    server.set_default("qa_summary", Step.valid_summary().with_delay(before_s=0.3))
    sessions = [await make_session(db, f"parent-{i}") for i in range(6)]
    for sid in sessions:
        await add_history(db, sid, _history(3))
    a = Worker(settings, db)
    b = Worker(settings, db)
    await a.start()
    await b.start()
    try:
        ids = [await enqueue_job(db, sid, JobKind.QA_FOLD, "1-3", {"through_ordinal": 3}) for sid in sessions]
        for job_id in ids:
            await wait_for(functools.partial(_job_is, db, job_id, "succeeded"), within=30)
    finally:
        await a.stop()
        await b.stop()
    calls = server.requests("qa_summary")
    assert sorted(r.headers["x-sidequest-job-id"] for r in calls) == sorted(str(i) for i in ids)
    async with db.sessions() as session:
        attempts = list(await session.scalars(select(JobRow.attempt).where(JobRow.id.in_(ids))))
    assert attempts == [1] * 6


async def test_a_request_that_times_out_waiting_for_a_job_says_how_long_it_waited(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    """SPEC 3: waited_ms is the time spent waiting for a background job — also when the request's
    deadline passes during that wait: the timeout does not discard the time waited."""
    handle = await start_worker(_settings(database_url, server, request_timeout_s=1.5), db)
    try:
        server.script("qa_summary", Step.valid_summary().with_delay(before_s=6.0))
        sid, job_id = await _first_fold_queued(db)
        await wait_for(lambda: _job_is(db, job_id, "running"), within=10)
        rid = await admit(db, sid, "question 22?")
        await wait_for(lambda: _done(db, rid), within=20)
        row = await row_of(db, rid)
    finally:
        await handle.stop()
    assert row.status == "failed" and row.error is not None and row.error["code"] == "timeout"
    # Within the request's deadline (1.5 s), give or take the event loop's lateness on a loaded machine:
    # the job itself would have taken 6 s.
    assert 0 < row.context_info["qa_summary"]["waited_ms"] <= 1500 + 250


async def test_background_off_makes_no_jobs(db: Database, server: ScriptedServer, database_url: str) -> None:
    settings = _settings(database_url, server, background_summaries="off")
    handle = await start_worker(settings, db)
    try:
        sid = await make_session(db)
        await add_history(db, sid, _history(20))
        rid = await admit(db, sid, "question 21?")
        await wait_for(lambda: _done(db, rid), within=20)
        rid2 = await admit(db, sid, "question 22?")
        await wait_for(lambda: _done(db, rid2), within=20)
    finally:
        await handle.stop()
    assert await _background(db, sid) == []
    row = await row_of(db, rid2)
    assert row.context_info["qa_summary"]["made_by"] == "request"
    assert [c["purpose"] for c in row.usage["calls"]] == ["qa_summary", "answer"]


# ------------------------------------------------------------------------------------ context


def _snapshot(messages: int, *, start: int = 0) -> dict[str, Any]:
    """A snapshot of ``messages`` messages of ~1000 tokens each (3000 bytes of text)."""
    body = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i}: " + "x" * 3000}
        for i in range(start, start + messages)
    ]
    return {"system": "You are the main agent.", "messages": body}


async def _store(db: Database, snapshot_id: str, content: dict[str, Any], settings: Settings) -> None:
    policy = SnapshotJobPolicy(
        enabled=settings.background_on,
        context_window=settings.context_window,
        max_output_tokens=settings.max_output_tokens,
    )
    async with db.sessions() as session:
        owner = await lock_or_create_session(session, "default", "parent-1")
        await store_snapshot(session, owner, snapshot_id, content, jobs=policy)
        await session.commit()


async def test_storing_a_snapshot_announces_exactly_the_snapshots_whose_job_it_queues(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    """``expecting`` (sidequest serve: its worker renders the summary's material while the snapshot
    is written) hears of the snapshots whose job is queued — the session asked before and a question
    would need compaction, background summaries on — and of no other."""
    settings = _settings(database_url, server, context_window=64000)
    heard: list[int] = []  # the announced snapshots' message counts

    async def store(snapshot_id: str, content: dict[str, Any], *, enabled: bool = True) -> None:
        policy = SnapshotJobPolicy(
            enabled=enabled,
            context_window=settings.context_window,
            max_output_tokens=settings.max_output_tokens,
            expecting=lambda prepared: heard.append(len(prepared.messages)),
        )
        async with db.sessions() as session:
            owner = await lock_or_create_session(session, "default", "parent-1")
            await store_snapshot(session, owner, snapshot_id, content, jobs=policy)
            await session.commit()

    sid = await make_session(db)
    await store("first", _snapshot(60))  # the session never asked: no job
    await add_history(db, sid, _history(1))
    await store("small", _snapshot(5))  # fits: no job
    await store("off", _snapshot(61), enabled=False)  # background summaries off: no job
    await store("long", _snapshot(62))
    assert heard == [62]
    assert [j.key for j in await _background(db, sid)] == ["snapshot:long"]


async def test_a_stored_snapshot_is_summarised_before_the_question_comes(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    settings = _settings(database_url, server, context_window=64000)
    handle = await start_worker(settings, db)
    try:
        sid = await make_session(db)
        await add_history(db, sid, _history(1))  # the session has asked before
        await _store(db, "s1", _snapshot(60), settings)
        [job] = await _background(db, sid)
        assert (job.kind, job.key) == ("context_summary", "snapshot:s1")
        await wait_for(lambda: _job_is(db, job.id, "succeeded"), within=30)
        made = len(server.requests("context_summary"))
        assert made >= 1
        rid = await admit(db, sid, "what now?", snapshot_id="s1")
        await wait_for(lambda: _done(db, rid), within=30)
    finally:
        await handle.stop()
    row = await row_of(db, rid)
    assert row.status == "succeeded"
    ctx = row.context_info["context_summary"]
    assert ctx["cache"] == "hit" and ctx["made_by"] == "background" and ctx["calls"] == 0
    assert len(server.requests("context_summary")) == made  # the request made none
    [done] = await _background(db, sid)
    assert done.key != "snapshot:s1"  # it took its summary's cache key when it started


async def test_a_snapshot_job_makes_no_summary_when_the_learned_ratio_says_it_fits(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    # Queued on the raw estimate (~60k tokens over a ~52k budget); the provider has been counting half
    # of our estimates (5 samples, ratio 0.5), so a question on the snapshot fits without compaction
    # (SPEC §5.1: the ratio decides every fit) and the job ends without a call.
    settings = _settings(database_url, server, context_window=64000)
    async with db.sessions() as session, session.begin():
        for _ in range(5):
            await calibration.add_sample(session, "openai", "scripted-model", 2000, 1000)
    handle = await start_worker(settings, db)
    try:
        sid = await make_session(db)
        await add_history(db, sid, _history(1))
        await _store(db, "s1", _snapshot(60), settings)
        [job] = await _background(db, sid)
        await wait_for(lambda: _job_is(db, job.id, "succeeded"), within=30)
    finally:
        await handle.stop()
    [done] = await _background(db, sid)
    assert done.covered == {"covered_messages": 0, "reason": "not_needed"} and done.calls == 0
    assert server.requests("context_summary") == []


async def test_a_snapshot_of_a_session_that_never_asked_queues_nothing(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    settings = _settings(database_url, server, context_window=64000)
    sid = await make_session(db)
    await _store(db, "s1", _snapshot(60), settings)
    await _store(db, "small", _snapshot(2), settings)
    assert await _background(db, sid) == []


async def test_a_grown_snapshot_is_answered_at_once_from_the_cached_prefix_then_extended(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    settings = _settings(database_url, server)
    handle = await start_worker(settings, db)
    options = {"context_window": 64000}
    try:
        # SPEC §6.7 with masking off: the first summary leaves the 8000-token tail verbatim.
        sid = await make_session(db, settings={"mask_tool_results": False})
        first_snapshot = _snapshot(60)
        await _store(db, "s1", first_snapshot, settings)  # never asked: no job
        first = await admit(db, sid, "what is going on?", snapshot_id="s1", options=options)
        await wait_for(lambda: _done(db, first), within=30)
        row = await row_of(db, first)
        assert row.status == "succeeded" and row.context_info["context_summary"]["cache"] == "miss"
        recent_kept = row.context_info["context_summary"]["kept_messages"]  # the 8000-token tail
        before = len(server.requests("context_summary"))
        server.set_default("context_summary", Step.valid_summary().with_delay(before_s=1.0))

        grown = {
            **first_snapshot,
            "messages": first_snapshot["messages"] + _snapshot(10, start=60)["messages"],
        }
        # Stored inline-style without the trigger, so that only the 6.7 follow-up can queue a job.
        await _store(db, "s2", grown, Settings(**{**settings.model_dump(), "background_summaries": "off"}))
        second = await admit(db, sid, "and now?", snapshot_id="s2", options=options)
        await wait_for(lambda: _done(db, second), within=30)
        row = await row_of(db, second)
        assert row.status == "succeeded"
        ctx = row.context_info["context_summary"]
        assert ctx["cache"] == "prefix" and ctx["calls"] == 0 and ctx["waited_ms"] == 0
        assert ctx["kept_messages"] == recent_kept + 10  # every message after the cached prefix, verbatim
        assert [c["purpose"] for c in row.usage["calls"]] == ["answer"]
        # …and a job then extends the summary so the next question's tail is back near 8000 tokens.
        await wait_for(lambda: _all_jobs_ended(db, sid), within=30)
        [job] = await _background(db, sid)
        assert job.kind == "context_summary" and job.status == "succeeded"
        assert len(server.requests("context_summary")) == before + 1  # one call: the new messages

        third = await admit(db, sid, "once more?", snapshot_id="s2", options=options)
        await wait_for(lambda: _done(db, third), within=30)
    finally:
        await handle.stop()
    row = await row_of(db, third)
    ctx = row.context_info["context_summary"]
    assert ctx["cache"] == "hit" and ctx["made_by"] == "background"
    assert ctx["kept_messages"] == recent_kept  # back to the 8000-token tail


async def test_request_records_carry_the_stored_qa_estimate(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    rid = await admit(db, sid, "how big is this?")
    await wait_for(lambda: _done(db, rid), within=20)
    async with db.sessions() as session:
        tokens = await session.scalar(select(RequestRow.qa_tokens).where(RequestRow.id == rid))
    from service.pipeline.history import qa_group_tokens
    from service.summary.material import QAPair
    from service.vocabulary import utc_iso

    row = await row_of(db, rid)
    assert tokens == qa_group_tokens(
        QAPair(row.ordinal, row.question, row.answer or "", utc_iso(row.created_at))
    )


async def test_a_stored_snapshot_is_judged_by_the_window_of_the_sessions_latest_question(
    db: Database, server: ScriptedServer, database_url: str
) -> None:
    """SPEC §6.6: a chat UI that sends its model's window with every question and never writes
    settings still gets its summary made ahead of time (the service's window, 200000, would say the
    60k-token snapshot fits); a snapshot that masking alone fits gets no job (§6.2: masking needs no
    call)."""
    settings = _settings(database_url, server)  # no SIDEQUEST_CONTEXT_WINDOW: 200000
    options = {"context_window": 64000}
    sid = await make_session(db)
    await admit(db, sid, "what is the agent doing?", options=options)
    tool_heavy = {"system": "You are the main agent.", "messages": tool_session(30)}
    await _store(db, "masked-fits", tool_heavy, settings)
    assert await _background(db, sid) == []
    await _store(db, "s1", _snapshot(60), settings)
    [job] = await _background(db, sid)
    assert job.key == "snapshot:s1" and job.params["context_window"] == 64000
    handle = await start_worker(settings, db)
    try:
        await wait_for(lambda: _job_is(db, job.id, "succeeded"), within=30)
        made = len(server.requests("context_summary"))
        assert made >= 1
        rid = await admit(db, sid, "and now?", snapshot_id="s1", options=options)
        await wait_for(lambda: _done(db, rid), within=30)
    finally:
        await handle.stop()
    row = await row_of(db, rid)
    ctx = row.context_info["context_summary"]
    assert row.status == "succeeded", row.error
    assert ctx["used"] and ctx["made_by"] == "background" and ctx["waited_ms"] == 0 and ctx["calls"] == 0
    assert len(server.requests("context_summary")) == made
