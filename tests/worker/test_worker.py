"""One in-process worker: wake-up, cancellation within a second, lost leases, recovery, shutdown."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from sqlalchemy import text

from service.config import Settings
from service.store import memory, queue
from service.store.admission import cancel_request, clear_session
from service.store.db import Database
from service.worker import start_worker
from service.worker.runner import Worker
from tests.factories import add_history, admit, make_session
from tests.scripted_provider import ScriptedServer, Step, Usage
from tests.worker.conftest import events_of, row_of, status_of, wait_for


@pytest.fixture
async def worker(worker_settings: Settings, db: Database) -> AsyncIterator[Worker]:
    handle = await start_worker(worker_settings, db)
    try:
        yield handle
    finally:
        await handle.stop()


async def test_worker_wakes_on_admission_and_answers(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    rid = await admit(db, sid, "hello?")
    took = await wait_for(lambda: _is(db, rid, "succeeded"))
    assert took < 3
    row = await row_of(db, rid)
    assert row.answer == "Scripted answer." and row.attempt == 1
    events = await events_of(db, rid)
    assert events[1].data == {**events[1].data, "status": "running", "stage": "preparing"}
    assert [e.type for e in events][-2:] == ["status", "done"]


async def _is(db: Database, rid: object, status: str) -> bool:
    return await status_of(db, rid) == status  # type: ignore[arg-type]


async def test_cancel_stops_a_running_answer_within_a_second_and_keeps_usage(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    sid = await make_session(db)
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 22)])  # one summary call first
    server.script("answer", Step.hang(text="thinking about it "))
    rid = await admit(db, sid, "long one")
    await wait_for(lambda: _has_delta(db, rid))
    assert rid in worker.requests.tasks

    started = time.monotonic()
    async with db.sessions() as session, session.begin():
        record = await cancel_request(session, "default", rid)
    assert record is not None and record["status"] == "cancelled"
    await wait_for(lambda: _not_running_locally(worker, rid), within=1.0)
    assert time.monotonic() - started < 1.0

    row = await row_of(db, rid)
    assert row.status == "cancelled"
    calls = [(c["purpose"], c["status"]) for c in row.usage["calls"]]
    assert calls == [("qa_summary", "ok"), ("answer", "cancelled")]
    # The record names the answer model it was cancelled in, not null because it never finished.
    assert row.model is not None and row.model == row.usage["calls"][1]["model"]
    # The summary's reported usage is kept (the default step counts its prompt from the body).
    assert row.usage["input_tokens"] == row.usage["calls"][0]["input_tokens"] > 0
    events = await events_of(db, rid)
    assert [e.type for e in events][-2:] == ["status", "error"]
    assert events[-1].data["code"] == "cancelled"


async def _has_delta(db: Database, rid: object) -> bool:
    return any(e.type == "delta" for e in await events_of(db, rid))  # type: ignore[arg-type]


async def _not_running_locally(worker: Worker, rid: object) -> bool:
    return rid not in worker.requests.tasks


async def test_a_cancel_without_notify_is_noticed_by_the_liveness_check(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    server.script("answer", Step.hang())
    rid = await admit(db, await make_session(db), "q")
    await wait_for(lambda: _answer_sent(server))
    async with db.sessions() as session, session.begin():
        await session.execute(
            text("UPDATE side_question_requests SET status = 'cancelled' WHERE id = :id"), {"id": rid}
        )
    took = await wait_for(lambda: _not_running_locally(worker, rid), within=2.0)
    assert took <= 1.3
    row = await row_of(db, rid)
    assert row.usage["calls"][-1]["status"] == "cancelled"


async def _answer_sent(server: ScriptedServer) -> bool:
    return bool(server.requests("answer"))


async def test_clear_during_a_summary_leaves_no_memory_behind(
    worker: Worker, db: Database, server: ScriptedServer
) -> None:
    sid = await make_session(db, "to-clear")
    await add_history(db, sid, [(f"q{i}", f"a{i}") for i in range(1, 22)])
    server.script("qa_summary", Step.valid_summary(usage=Usage(10, 10)).with_delay(before_s=0.3))
    rid = await admit(db, sid, "q")
    await wait_for(lambda: _summary_sent(server))
    async with db.sessions() as session, session.begin():
        assert await clear_session(session, "default", "to-clear") is not None
    await wait_for(lambda: _not_running_locally(worker, rid))
    await wait_for(lambda: _summary_finished(db, rid))
    async with db.sessions() as session:
        assert await memory.load_memory(session, sid) == {"qa_summary": None, "context_summaries": []}


async def _summary_sent(server: ScriptedServer) -> bool:
    return bool(server.requests("qa_summary"))


async def _summary_finished(db: Database, rid: object) -> bool:
    row = await row_of(db, rid)  # type: ignore[arg-type]
    return bool(row.usage["calls"])


async def test_expired_lease_on_a_second_attempt_fails_worker_lost(
    worker_settings: Settings, db: Database, server: ScriptedServer
) -> None:
    rid = await admit(db, await make_session(db), "q")
    # A worker that died twice: claimed (attempt 1), re-queued, claimed again (attempt 2), then silent.
    for owner in ("dead-1", "dead-2"):
        async with db.sessions() as session, session.begin():
            claimed, _ = await queue.try_claim(session, owner=owner, lease_s=0.05, max_running=4)
        assert claimed is not None and claimed.id == rid
        if owner == "dead-1":
            await wait_for(lambda: _sweep_once(db))
    handle = await start_worker(worker_settings, db)
    try:
        await wait_for(lambda: _is(db, rid, "failed"))
    finally:
        await handle.stop()
    row = await row_of(db, rid)
    assert row.error is not None and row.error["code"] == "worker_lost" and row.attempt == 2
    assert server.requests() == []


async def _sweep_once(db: Database) -> bool:
    async with db.sessions() as session, session.begin():
        return bool((await queue.sweep_expired(session)).requeued)


async def test_stop_gives_running_requests_back_to_the_queue(
    worker_settings: Settings, db: Database, server: ScriptedServer
) -> None:
    server.script("answer", Step.hang())
    rid = await admit(db, await make_session(db), "q")
    handle = await start_worker(worker_settings, db)
    await wait_for(lambda: _answer_sent(server))
    await handle.stop()
    row = await row_of(db, rid)
    assert row.status == "queued" and row.attempt == 0 and row.lease_owner is None
    assert [
        {k: v for k, v in c.items() if k not in ("latency_ms", "call_id")} for c in row.usage["calls"]
    ] == [
        {
            "purpose": "answer",
            "model": "scripted-model",
            "status": "cancelled",
            "reported": False,
            "input_tokens": 0,
            "output_tokens": 0,
            "reasoning_tokens": 0,
            "cached_tokens": 0,
        }
    ]
    # Another worker picks it up and finishes it.
    handle = await start_worker(worker_settings, db)
    try:
        await wait_for(lambda: _is(db, rid, "succeeded"))
    finally:
        await handle.stop()


async def test_the_log_says_what_was_claimed_and_why_a_request_failed(
    worker: Worker, db: Database, server: ScriptedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """docs/operations.md: one line per claim, and a failure's code and the provider's own words —
    what an operator needs to follow a request from the log alone."""
    caplog.set_level("INFO", logger="service.worker.runner")
    server.script("answer", Step.http_error(500, {"error": {"message": "upstream exploded"}}))
    sid = await make_session(db)
    rid = await admit(db, sid, "hello?")
    await wait_for(lambda: _is(db, rid, "failed"))
    await wait_for(lambda: _logged(caplog, f"request {rid} ended"))
    lines = [r.getMessage() for r in caplog.records if str(rid) in r.getMessage()]
    assert any("claimed (ordinal 1, attempt 1)" in line for line in lines), lines
    assert any("ended: failed: provider_error: upstream exploded" in line for line in lines), lines


async def _logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


async def test_the_pool_is_closed_when_the_worker_cannot_be_built(
    worker_settings: Settings, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import service.worker
    from service.store.db import connect as real_connect

    disposed: list[Database] = []

    def connect(*args: object, **kwargs: object) -> Database:
        db = real_connect(*args, **kwargs)  # type: ignore[arg-type]
        dispose = db.dispose

        async def recorded() -> None:
            disposed.append(db)
            await dispose()

        db.dispose = recorded  # type: ignore[method-assign]
        return db

    def no_worker(*args: object, **kwargs: object) -> Worker:
        raise ValueError("no provider")

    monkeypatch.setattr(service.worker, "connect", connect)
    monkeypatch.setattr(service.worker, "Worker", no_worker)
    with pytest.raises(ValueError, match="no provider"):
        await service.worker._serve_until_signalled(worker_settings, database_url)
    assert len(disposed) == 1
