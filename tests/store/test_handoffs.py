"""Hand-offs and pins against PostgreSQL (SPEC §11.1): which Q&A, the mark that never moves down,
pins, idempotency, the session event, tenant isolation and clear."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select, update

from service.store.admission import IdempotencyConflict, clear_session
from service.store.db import Database
from service.store.events import session_events_with_deletion
from service.store.handoffs import (
    HandoffAsk,
    NotPinnable,
    UnknownOrdinals,
    create_handoff,
    list_handoffs,
    set_pinned,
)
from service.store.models import HandoffRow, RequestRow, SessionRow, SnapshotRow
from service.summary.document import Provenance, SummaryDocument
from service.summary.rolling import StoredQASummary
from tests.factories import add_snapshot, make_session

TENANT = "acme"
BASE = datetime(2026, 11, 29, 10, 0, 0, tzinfo=UTC)


async def add_requests(
    db: Database, session_id: uuid.UUID, statuses: list[str], **extra: Any
) -> list[uuid.UUID]:
    """Requests with the next ordinals and the given statuses (succeeded ones get an answer)."""
    ids = []
    async with db.sessions() as session, session.begin():
        owner = (await session.scalars(select(SessionRow).where(SessionRow.id == session_id))).one()
        for status in statuses:
            ordinal = owner.next_ordinal
            owner.next_ordinal = ordinal + 1
            row = RequestRow(
                id=uuid.uuid4(),
                session_id=session_id,
                ordinal=ordinal,
                question=f"question {ordinal}?",
                answer=f"answer {ordinal}." if status == "succeeded" else None,
                status=status,
                clear_version=owner.clear_version,
                created_at=BASE + timedelta(minutes=ordinal),
                **extra,
            )
            session.add(row)
            ids.append(row.id)
    return ids


async def handoff(db: Database, parent: str = "p", tenant: str = TENANT, **ask: Any) -> dict[str, Any]:
    async with db.sessions() as session, session.begin():
        outcome = await create_handoff(session, tenant, parent, HandoffAsk(**ask))
    assert outcome is not None
    return outcome.handoff


async def mark(db: Database, parent: str = "p") -> int:
    async with db.sessions() as session:
        value = await session.scalar(
            select(SessionRow.handed_off_through).where(
                SessionRow.parent_id == parent, SessionRow.tenant == TENANT
            )
        )
    assert value is not None
    return int(value)


async def handoff_count(db: Database) -> int:
    async with db.sessions() as session:
        return int(await session.scalar(select(func.count()).select_from(HandoffRow)) or 0)


async def test_new_hands_off_succeeded_qa_above_the_mark_and_never_failed_or_cancelled(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    await add_requests(db, sid, ["succeeded", "failed", "succeeded", "cancelled", "queued", "running"])
    first = await handoff(db)
    assert first["ordinals"] == [1, 3] and first["from_ordinal"] == 1 and first["through_ordinal"] == 3
    assert first["format"] == "anthropic" and first["message"] == {"role": "user", "content": first["text"]}
    assert "question 2?" not in first["text"] and "question 4?" not in first["text"]
    assert await mark(db) == 3
    # Nothing new: 200-style empty result, nothing recorded, the mark unchanged.
    again = await handoff(db)
    assert (
        again["ordinals"] == [] and again["text"] == "" and again["id"] is None and again["message"] is None
    )
    assert await handoff_count(db) == 1
    await add_requests(db, sid, ["succeeded"])
    third = await handoff(db, format="text")
    assert third["ordinals"] == [7] and third["message"] is None and "question 7?" in third["text"]
    assert await mark(db) == 7


async def test_all_takes_every_succeeded_one_and_ordinals_exactly_those(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    await add_requests(db, sid, ["succeeded", "failed", "succeeded", "succeeded"])
    await handoff(db)
    everything = await handoff(db, include="all")
    assert everything["ordinals"] == [1, 3, 4]
    chosen = await handoff(db, ordinals=(3,))
    assert chosen["ordinals"] == [3] and await mark(db) == 4  # never down
    for bad in ((2,), (9,), (1, 2)):
        with pytest.raises(UnknownOrdinals) as refused:
            await handoff(db, ordinals=bad)
        assert 1 not in refused.value.detail["ordinals"]
    assert await handoff_count(db) == 3


async def test_a_pinned_answer_is_in_the_next_new_handoff_even_below_the_mark_and_is_unpinned(
    db: Database,
) -> None:
    sid = await make_session(db, "p", TENANT)
    ids = await add_requests(db, sid, ["succeeded", "succeeded", "failed"])
    await handoff(db)
    assert await mark(db) == 2
    async with db.sessions() as session, session.begin():
        record = await set_pinned(session, TENANT, ids[0], True)
    assert record is not None and record["pinned"] is True
    async with db.sessions() as session:  # idempotent
        assert (await set_pinned(session, TENANT, ids[0], True) or {}).get("pinned") is True
    pinned = await handoff(db)
    assert pinned["ordinals"] == [1] and "pinned" in pinned["text"]
    assert await mark(db) == 2  # an older pinned Q&A alone leaves the mark where it was
    async with db.sessions() as session:
        assert (await session.get(RequestRow, ids[0]) or RequestRow()).pinned is False
    assert (await handoff(db))["ordinals"] == []
    # Only succeeded requests can be pinned; unpinning is idempotent for any.
    async with db.sessions() as session:
        with pytest.raises(NotPinnable):
            await set_pinned(session, TENANT, ids[2], True)
    async with db.sessions() as session, session.begin():
        assert (await set_pinned(session, TENANT, ids[2], False) or {}).get("pinned") is False
    async with db.sessions() as session, session.begin():
        assert await set_pinned(session, "globex", ids[0], True) is None  # another tenant's: not found


async def test_each_qa_names_its_snapshot_and_time(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    await add_snapshot(db, sid, "s-42", {"taken_at": "2026-11-29T09:58:00Z", "messages": []})
    await add_requests(db, sid, ["succeeded"], snapshot_id="s-42")
    await add_requests(db, sid, ["succeeded"])
    block = await handoff(db)
    assert "#1 (asked 2026-11-29T10:01:00Z, snapshot s-42 taken 2026-11-29T09:58:00Z)" in block["text"]
    assert "#2 (asked 2026-11-29T10:02:00Z, no snapshot" in block["text"]
    # A snapshot without taken_at: the time it reached the service stands in (SPEC 11.1: the snapshot
    # it was asked against, id and time: never an id alone).
    await add_snapshot(db, sid, "s-untimed", {"messages": []})
    await add_requests(db, sid, ["succeeded"], snapshot_id="s-untimed")
    async with db.sessions() as session:
        stored = await session.scalar(
            select(SnapshotRow.created_at).where(SnapshotRow.snapshot_id == "s-untimed")
        )
    assert stored is not None
    block = await handoff(db, ordinals=[3])
    assert f"snapshot s-untimed received {stored.astimezone(UTC):%Y-%m-%dT%H:%M:%S}Z)" in block["text"]


async def test_the_rolling_summary_stands_in_for_older_qa_when_the_block_is_too_large(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    await add_requests(db, sid, ["succeeded"] * 30)
    async with db.sessions() as session, session.begin():
        owner = await session.get(SessionRow, sid)
        assert owner is not None
        long_answer = "a long side answer about the parser " * 40
        await session.execute(
            update(RequestRow).where(RequestRow.session_id == sid).values(answer=long_answer)
        )
        provenance = Provenance.for_qa(
            first_ordinal=1,
            covered_through_ordinal=20,
            model="m",
            created_at="2026-11-29T11:00:00Z",
            context_time=None,
        )
        summary = StoredQASummary(
            SummaryDocument("Port the parser.", "Tokenizer done."), provenance, 1, 20, 50
        )
        owner.memory = {"qa_summary": summary.to_json(), "context_summaries": []}
    block = await handoff(db, max_tokens=3000)
    assert block["estimate_tokens"] <= 3000
    assert block["summarized_ordinals"] and max(block["summarized_ordinals"]) <= 20
    assert "Objective: Port the parser." in block["text"]
    assert block["ordinals"][-1] == 30 and await mark(db) == 30
    # "ordinals — exactly those" (SPEC 11.1): a summary of #1–#20 cannot stand in for #1 and #25
    # alone (it would carry #2–#20 too); for all of #1–#20 and more, it can.
    some = await handoff(db, max_tokens=1000, ordinals=[1, 25])
    assert some["summarized_ordinals"] == [] and "Objective: Port the parser." not in some["text"]
    assert some["ordinals"] == [1, 25] and some["truncated"] is True
    covering = await handoff(db, max_tokens=3000, ordinals=list(range(1, 26)))
    assert covering["summarized_ordinals"] and "Objective: Port the parser." in covering["text"]


async def test_idempotency_key_replays_the_original_and_refuses_another_body(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    await add_requests(db, sid, ["succeeded"])
    first = await handoff(db, idempotency_key="k1", body_hash="h1")
    await add_requests(db, sid, ["succeeded"])
    replay = await handoff(db, idempotency_key="k1", body_hash="h1")
    assert replay == first and await handoff_count(db) == 1
    with pytest.raises(IdempotencyConflict):
        await handoff(db, idempotency_key="k1", body_hash="other")
    assert await handoff_count(db) == 1 and await mark(db) == 1


async def test_a_handoff_is_listed_newest_first_and_is_a_session_event(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    for _ in range(3):
        await add_requests(db, sid, ["succeeded"])
        await handoff(db)
    async with db.sessions() as session:
        page = await list_handoffs(session, TENANT, "p", limit=2, before=None)
    assert page is not None and [h["ordinals"] for h in page["items"]] == [[3], [2]] and page["has_more"]
    async with db.sessions() as session:
        older = await list_handoffs(session, TENANT, "p", limit=2, before=page["next_before"])
    assert older is not None and [h["ordinals"] for h in older["items"]] == [[1]] and not older["has_more"]
    async with db.sessions() as session:
        events = [e for e, _, _ in await session_events_with_deletion(session, sid, 0) if e.type == "handoff"]
    assert [e.data["handoff"]["ordinals"] for e in events] == [[1], [2], [3]]
    assert events[0].request_id is None and events[0].data["handoff"]["id"] == older["items"][0]["id"]
    assert "text" not in events[0].data["handoff"] and events[-1].data["handed_off_through"] == 3


async def test_another_tenant_gets_nothing(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    await add_requests(db, sid, ["succeeded"])
    async with db.sessions() as session, session.begin():
        assert await create_handoff(session, "globex", "p", HandoffAsk()) is None
    async with db.sessions() as session:
        assert await list_handoffs(session, "globex", "p", limit=20, before=None) is None
    assert await handoff_count(db) == 0 and await mark(db) == 0


async def test_clear_deletes_handoffs_and_resets_the_mark_but_keeps_settings(db: Database) -> None:
    sid = await make_session(db, "p", TENANT)
    await add_requests(db, sid, ["succeeded", "succeeded"])
    async with db.sessions() as session, session.begin():
        owner = await session.get(SessionRow, sid)
        assert owner is not None
        owner.settings = {"summary_model": "cheap"}
    await handoff(db)
    async with db.sessions() as session, session.begin():
        assert await clear_session(session, TENANT, "p") is not None
    assert await handoff_count(db) == 0 and await mark(db) == 0
    async with db.sessions() as session:
        owner = await session.get(SessionRow, sid)
        assert owner is not None and owner.settings == {"summary_model": "cheap"}
    await add_requests(db, sid, ["succeeded"])
    assert (await handoff(db))["ordinals"] == [3]  # ordinals keep counting after the clear
