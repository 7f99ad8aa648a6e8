"""Queue SQL on a real PostgreSQL: cap, per-session order, round robin, leases, guarded writes, sweep."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from sqlalchemy import select, text

from service.store import calibration, lease, ledger, queue, terminal
from service.store.db import Database
from service.store.events import request_events_after
from service.store.models import RequestRow
from service.vocabulary import Status, terminal_error
from tests.factories import admit, clear, make_session


async def _claim(
    db: Database, owner: str = "w1", cap: int = 4, lease_s: float = 30.0
) -> queue.Claimed | None:
    async with db.sessions() as session, session.begin():
        return (await queue.try_claim(session, owner=owner, lease_s=lease_s, max_running=cap))[0]


async def _status(db: Database, request_id: uuid.UUID) -> str:
    async with db.sessions() as session:
        value = await session.scalar(select(RequestRow.status).where(RequestRow.id == request_id))
        assert value is not None
        return value


async def _finish(db: Database, claimed: queue.Claimed, owner: str = "w1") -> None:
    async with db.sessions() as session, session.begin():
        record = await terminal.finish_succeeded(
            session,
            claimed.id,
            owner,
            answer="ok",
            truncated=False,
            stop_reason="stop",
            model="m",
            context_info={},
        )
    assert record is not None


async def test_claim_marks_running_preparing_and_writes_status_event(db: Database) -> None:
    sid = await make_session(db)
    rid = await admit(db, sid, "q1")
    claimed = await _claim(db)
    assert claimed is not None and claimed.id == rid and claimed.attempt == 1 and claimed.ordinal == 1
    async with db.sessions() as session:
        row = await session.get(RequestRow, rid)
        assert row is not None
        assert (row.status, row.stage, row.lease_owner) == ("running", "preparing", "w1")
        assert row.started_at is not None and row.lease_expires_at is not None
        events = await request_events_after(session, rid, 0)
    assert [(e.type, e.data["status"], e.data["stage"]) for e in events] == [
        ("status", "queued", None),
        ("status", "running", "preparing"),
    ]


async def test_global_cap_is_never_exceeded_by_concurrent_claimers(db: Database) -> None:
    sessions = [await make_session(db, f"p{i}") for i in range(10)]
    for sid in sessions:
        await admit(db, sid, "q")
    results = await asyncio.gather(*(_claim(db, owner=f"w{i}", cap=4) for i in range(10)))
    assert sum(r is not None for r in results) == 4
    async with db.sessions() as session:
        running = await session.scalar(
            text("SELECT count(*) FROM side_question_requests WHERE status = 'running'")
        )
        assert running == 4


async def test_one_running_per_session_in_ordinal_order(db: Database) -> None:
    sid = await make_session(db)
    ids = [await admit(db, sid, f"q{i}") for i in range(3)]
    first = await _claim(db)
    assert first is not None and first.id == ids[0]
    assert await _claim(db) is None  # the session already runs one
    await _finish(db, first)
    second = await _claim(db)
    assert second is not None and second.id == ids[1]


async def test_round_robin_never_started_first_then_oldest_start(db: Database) -> None:
    a, b, c = [await make_session(db, name) for name in ("a", "b", "c")]
    # a and b each ran once before (a longest ago); c never ran.
    a1 = await admit(db, a, "a1")
    b1 = await admit(db, b, "b1")
    for expected in (a1, b1):
        claimed = await _claim(db)
        assert claimed is not None and claimed.id == expected
        await _finish(db, claimed)
    b2 = await admit(db, b, "b2")
    a2 = await admit(db, a, "a2")
    c1 = await admit(db, c, "c1")
    order = []
    for _ in range(3):
        claimed = await _claim(db)
        assert claimed is not None
        order.append(claimed.id)
    # c never started → first; then a (started longest ago) although b2 was queued before a2.
    assert order == [c1, a2, b2]


async def test_ties_between_never_started_sessions_go_to_the_oldest_queued_request(db: Database) -> None:
    a, b = await make_session(db, "a"), await make_session(db, "b")
    b1 = await admit(db, b, "b1")
    a1 = await admit(db, a, "a1")
    first = await _claim(db)
    second = await _claim(db)
    assert first is not None and second is not None
    assert [first.id, second.id] == [b1, a1]


async def test_heartbeat_extends_lease_and_reports_lost_requests(db: Database) -> None:
    sid = await make_session(db)
    await admit(db, sid, "q")
    claimed = await _claim(db, lease_s=1.0)
    assert claimed is not None
    async with db.sessions() as session, session.begin():
        held = await queue.heartbeat(session, requests={claimed.id: "w1"}, lease_s=60.0)
        assert held.requests == {claimed.id}
        assert (
            await queue.heartbeat(session, requests={claimed.id: "other"}, lease_s=60.0)
        ).requests == set()
        expires = await session.scalar(
            text("SELECT lease_expires_at - now() > interval '50 seconds' FROM side_question_requests")
        )
        assert expires is True
    await clear(db, "parent-1")
    async with db.sessions() as session, session.begin():
        assert (await queue.heartbeat(session, requests={claimed.id: "w1"}, lease_s=60.0)).requests == set()


async def test_no_worker_event_or_terminal_write_after_a_cancel(db: Database) -> None:
    sid = await make_session(db)
    rid = await admit(db, sid, "q")
    claimed = await _claim(db)
    assert claimed is not None
    await clear(db, "parent-1")
    async with db.sessions() as session, session.begin():
        assert not await lease.emit_if_held(session, rid, "w1", [("delta", {"text": "late"})])
    async with db.sessions() as session, session.begin():
        assert not await lease.emit_if_held(
            session, rid, "w1", [("status", {"status": "running", "stage": "answering"})], stage="answering"
        )
    async with db.sessions() as session, session.begin():
        record = await terminal.finish_succeeded(
            session,
            rid,
            "w1",
            answer="late",
            truncated=False,
            stop_reason="stop",
            model=None,
            context_info={},
        )
        assert record is None
    async with db.sessions() as session:
        async with session.begin():
            error = terminal_error("timeout", "late")
            ended = await terminal.finish_request(session, rid, status=Status.FAILED, owner="w1", error=error)
            assert ended is None
        events = await request_events_after(session, rid, 0)
    assert events[-1].type == "error" and events[-1].data["code"] == "cancelled"
    assert await _status(db, rid) == "cancelled"


async def test_success_writes_status_then_done_with_the_final_record(db: Database) -> None:
    sid = await make_session(db, "parent-x")
    rid = await admit(db, sid, "q")
    claimed = await _claim(db)
    assert claimed is not None
    await _finish(db, claimed)
    async with db.sessions() as session:
        events = await request_events_after(session, rid, 0)
    assert [e.type for e in events][-2:] == ["status", "done"]
    record = events[-1].data["record"]
    assert record["status"] == "succeeded" and record["answer"] == "ok" and record["parent_id"] == "parent-x"
    assert record["finished_at"] is not None


async def test_sweep_reruns_once_then_fails_worker_lost_keeping_usage(db: Database) -> None:
    sid = await make_session(db)
    rid = await admit(db, sid, "q")
    claimed = await _claim(db, lease_s=0.05)
    assert claimed is not None
    async with db.sessions() as session, session.begin():
        await session.execute(
            text("""UPDATE side_question_requests SET usage = jsonb_set(usage, '{input_tokens}', '7')""")
        )
    await asyncio.sleep(0.1)
    async with db.sessions() as session, session.begin():
        result = await queue.sweep_expired(session)
    assert result.requeued == [rid] and result.failed == []
    assert await _status(db, rid) == "queued"

    again = await _claim(db, owner="w2", lease_s=0.05)
    assert again is not None and again.id == rid and again.attempt == 2
    await asyncio.sleep(0.1)
    async with db.sessions() as session, session.begin():
        result = await queue.sweep_expired(session)
    assert result.failed == [rid]
    async with db.sessions() as session:
        row = await session.get(RequestRow, rid)
        assert row is not None
        assert row.status == "failed" and row.error is not None and row.error["code"] == "worker_lost"
        assert row.usage["input_tokens"] == 7
        events = await request_events_after(session, rid, 0)
    assert [e.type for e in events][-2:] == ["status", "error"]
    # The old owner cannot write anything any more.
    async with db.sessions() as session, session.begin():
        assert not await lease.emit_if_held(session, rid, "w2", [("delta", {"text": "x"})])


async def test_a_stale_run_of_the_same_process_cannot_write_once_its_request_is_claimed_again(
    db: Database,
) -> None:
    """Each claim has its own lease owner: after the sweep re-queued a request whose heartbeat could
    not reach the database, and this same process claimed it again, the stale run's writes (a
    statement it had in flight included) and its heartbeat find another owner on the row."""
    sid = await make_session(db)
    rid = await admit(db, sid, "q")
    stale = await _claim(db, owner=lease.claim_owner("host:1:abc"), lease_s=0.05)
    assert stale is not None
    await asyncio.sleep(0.1)
    async with db.sessions() as session, session.begin():
        assert (await queue.sweep_expired(session)).requeued == [rid]
    fresh = await _claim(db, owner=lease.claim_owner("host:1:abc"), lease_s=30.0)
    assert fresh is not None and fresh.id == rid and fresh.owner != stale.owner
    assert lease.worker_of(fresh.owner) == lease.worker_of(stale.owner) == "host:1:abc"
    async with db.sessions() as session:
        async with session.begin():
            assert not await lease.emit_if_held(session, rid, stale.owner, [("delta", {"text": "stale"})])
        async with session.begin():
            held = await queue.heartbeat(session, requests={rid: stale.owner}, lease_s=60.0)
        assert held.requests == set()
        async with session.begin():
            assert await lease.emit_if_held(session, rid, fresh.owner, [("delta", {"text": "fresh"})])
        async with session.begin():
            held = await queue.heartbeat(session, requests={rid: fresh.owner}, lease_s=60.0)
        assert held.requests == {rid}
        deltas = [e.data["text"] for e in await request_events_after(session, rid, 0) if e.type == "delta"]
    assert deltas == ["fresh"]


async def test_sweep_leaves_live_leases_alone(db: Database) -> None:
    sid = await make_session(db)
    await admit(db, sid, "q")
    assert await _claim(db, lease_s=30) is not None
    async with db.sessions() as session, session.begin():
        result = await queue.sweep_expired(session)
    assert result.requeued == [] and result.failed == []


async def test_release_requeues_without_counting_an_attempt(db: Database) -> None:
    sid = await make_session(db)
    rid = await admit(db, sid, "q")
    assert await _claim(db) is not None
    async with db.sessions() as session, session.begin():
        assert await queue.requeue_request(session, rid, reason="worker_stopped", owner="w1")
    async with db.sessions() as session:
        events = await request_events_after(session, rid, 0)
    assert [(e.type, e.data.get("status"), e.data.get("what")) for e in events][-2:] == [
        ("progress", None, "worker_stopped_rerun"),
        ("status", "queued", None),
    ]
    claimed = await _claim(db)
    assert claimed is not None and claimed.id == rid and claimed.attempt == 1


async def test_claim_skips_a_session_whose_row_an_admission_holds_instead_of_waiting(db: Database) -> None:
    a, b = await make_session(db, "a"), await make_session(db, "b")
    a1 = await admit(db, a, "a1")
    b1 = await admit(db, b, "b1")
    async with db.sessions() as holder, holder.begin():
        # What admission does for the length of its transaction: lock the session row.
        await holder.execute(
            text("SELECT id FROM side_question_sessions WHERE id = :id FOR UPDATE"), {"id": a}
        )
        claimed = await asyncio.wait_for(_claim(db), timeout=2)
        assert claimed is not None and claimed.id == b1
    claimed = await _claim(db)
    assert claimed is not None and claimed.id == a1


def _tail() -> terminal.AnswerTail:
    call = ledger.CallEntry(purpose="answer", model="m", status="ok", reported=True, input_tokens=70)
    return terminal.AnswerTail(
        delta="the last words", call=call, sample=calibration.Sample("openai", "m", 50, 70)
    )


async def _succeed_with_tail(db: Database, rid: uuid.UUID) -> dict[str, Any] | None:
    async with db.sessions() as session, session.begin():
        return await terminal.finish_succeeded(
            session,
            rid,
            "w1",
            answer="the last words",
            truncated=False,
            stop_reason="stop",
            model="m",
            context_info={},
            tail=_tail(),
        )


async def test_the_answer_tail_is_written_with_the_success_in_order(db: Database) -> None:
    sid = await make_session(db, "parent-tail")
    rid = await admit(db, sid, "q")
    claimed = await _claim(db)
    assert claimed is not None
    record = await _succeed_with_tail(db, rid)
    assert record is not None and record["usage"]["input_tokens"] == 70  # the done record counts it
    async with db.sessions() as session:
        events = await request_events_after(session, rid, 0)
        learned = await calibration.load_calibration(session, "openai", "m")
    assert [e.type for e in events][-4:] == ["delta", "usage", "status", "done"]
    assert events[-4].data["text"] == "the last words" and events[-3].data["usage"]["input_tokens"] == 70
    assert learned.samples == 1


async def test_a_lost_request_keeps_the_tails_call_and_sample_but_gets_no_event(db: Database) -> None:
    sid = await make_session(db, "parent-tail-lost")
    rid = await admit(db, sid, "q")
    claimed = await _claim(db)
    assert claimed is not None
    await clear(db, "parent-tail-lost")
    record = await _succeed_with_tail(db, rid)
    assert record is None
    async with db.sessions() as session:
        row = await session.get(RequestRow, rid)
        events = await request_events_after(session, rid, 0)
        learned = await calibration.load_calibration(session, "openai", "m")
    assert row is not None and [c["purpose"] for c in row.usage["calls"]] == ["answer"]  # tokens were spent
    assert learned.samples == 1
    assert all(e.type not in ("delta", "usage", "done") for e in events)
    assert events[-1].type == "error" and events[-1].data["code"] == "cancelled"
