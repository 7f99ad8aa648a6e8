"""Archive codecs against PostgreSQL: fixtures of every version restore, round trips are exact,
refusals write nothing, ordinals are kept and continue."""

from __future__ import annotations

import copy
import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from sqlalchemy import func, select

from service.archive import (
    ArchiveError,
    ArchiveInvalid,
    ArchiveUnreadable,
    archive_json_schema,
    load_archive_json,
    parse_archive,
)
from service.archive.model import SessionSettingsIn
from service.store import archive as archive_store
from service.store.admission import Admission, admit, clear_session
from service.store.archive import (
    SessionBusy,
    SessionHasHistory,
    SessionNotFound,
    export_archive,
    restore_archive,
)
from service.store.db import Database
from service.store.models import EventRow, RequestRow, SessionRow, empty_memory, empty_usage
from service.store.settings import read_settings, update_settings

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "archives"
SCHEMAS = ROOT / "docs" / "archive"
TENANT = "acme"


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    return data


def schema(version: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((SCHEMAS / f"v{version}.schema.json").read_text(encoding="utf-8"))
    return data


def without_envelope(document: dict[str, Any]) -> dict[str, Any]:
    """The parts a round trip must keep: everything but parent_id and exported_at."""
    return {k: v for k, v in document.items() if k not in ("parent_id", "exported_at")}


async def restore(
    db: Database, parent_id: str, document: object, *, tenant: str = TENANT, replace: bool = False
) -> archive_store.RestoreResult:
    async with db.sessions() as session, session.begin():
        return await restore_archive(session, tenant, parent_id, parse_archive(document), replace=replace)


async def export(db: Database, parent_id: str, version: int = 3, *, tenant: str = TENANT) -> dict[str, Any]:
    async with db.sessions() as session:
        return await export_archive(session, tenant, parent_id, version)


async def requests_of(db: Database, parent_id: str, *, tenant: str = TENANT) -> list[RequestRow]:
    async with db.sessions() as session:
        rows = await session.scalars(
            select(RequestRow)
            .join(SessionRow, SessionRow.id == RequestRow.session_id)
            .where(SessionRow.tenant == tenant, SessionRow.parent_id == parent_id)
            .order_by(RequestRow.ordinal)
        )
        return list(rows)


async def session_row(db: Database, parent_id: str, *, tenant: str = TENANT) -> SessionRow | None:
    async with db.sessions() as session:
        return await session.scalar(
            select(SessionRow).where(SessionRow.tenant == tenant, SessionRow.parent_id == parent_id)
        )


async def table_counts(db: Database) -> tuple[int, int, int]:
    async with db.sessions() as session:
        sessions = await session.scalar(select(func.count()).select_from(SessionRow))
        requests = await session.scalar(select(func.count()).select_from(RequestRow))
        events = await session.scalar(select(func.count()).select_from(EventRow))
    return int(sessions or 0), int(requests or 0), int(events or 0)


async def live_session(db: Database, parent_id: str) -> None:
    """A session as the worker leaves it: finished requests of every kind, memory, plus work in
    flight and a cleared request, which an archive must leave out."""
    base = datetime(2026, 11, 29, 8, 0, 0, 123456, tzinfo=UTC)
    async with db.sessions() as session, session.begin():
        owner = SessionRow(
            id=uuid.uuid4(),
            tenant=TENANT,
            parent_id=parent_id,
            clear_version=2,
            next_ordinal=9,
            memory={
                "qa_summary": {"covered_through_ordinal": 3, "tokens": 80, "document": {"objective": "ö"}},
                "context_summaries": [
                    {"key": "abc", "snapshot_id": "s1", "covered_messages": 5, "tokens": 9}
                ],
            },
        )
        session.add(owner)
        await session.flush()
        ids = {n: uuid.uuid4() for n in range(2, 9)}
        rows: list[dict[str, Any]] = [
            {"ordinal": 2, "status": "cancelled", "deleted_at": base},  # cleared: invisible
            {
                "ordinal": 3,
                "status": "succeeded",
                "answer": "three",
                "truncated": True,
                "stop_reason": "length",
            },
            {"ordinal": 4, "status": "failed", "error": {"code": "timeout", "message": "t", "detail": {}}},
            {  # interrupted by #8 (SPEC §11.2), whose id its error names
                "ordinal": 5,
                "status": "cancelled",
                "error": {"code": "superseded", "message": "c", "detail": {"superseded_by": str(ids[8])}},
            },
            {"ordinal": 6, "status": "succeeded", "answer": "six ✓", "model": "m1", "snapshot_id": "s1"},
            {"ordinal": 7, "status": "running"},
            {"ordinal": 8, "status": "queued"},
        ]
        for spec in rows:
            n = spec["ordinal"]
            terminal = spec["status"] in ("succeeded", "failed", "cancelled")
            session.add(
                RequestRow(
                    id=ids[n],
                    session_id=owner.id,
                    question=f"question {n}",
                    clear_version=2,
                    usage={**empty_usage(), "input_tokens": 10 * n, "calls": [{"purpose": "answer", "n": n}]},
                    context_info={"window": 1000 + n, "drift": 0.5, "replayed_ordinals": [1, n]},
                    created_at=base + timedelta(minutes=n),
                    started_at=base + timedelta(minutes=n, seconds=1) if spec["status"] != "queued" else None,
                    finished_at=base + timedelta(minutes=n, seconds=9) if terminal else None,
                    **spec,
                )
            )


# ------------------------------------------------------------------ fixtures of every version


@pytest.mark.parametrize("version", [1, 2, 3])
def test_published_schemas_are_the_ones_the_service_uses(version: int) -> None:
    # docs/archive/ is generated from archive_json_schema; regenerate it when this fails.
    assert schema(version) == archive_json_schema(version)
    jsonschema.Draft202012Validator.check_schema(schema(version))


@pytest.mark.parametrize("name", ["v1.json", "v2.json", "v3.json"])
async def test_fixture_restores_and_exports_back_to_itself(db: Database, name: str) -> None:
    document = fixture(name)
    version = document["version"]
    jsonschema.validate(document, schema(version))
    result = await restore(db, "restored", document)
    assert result.restored == len(document["questions"])
    exported = await export(db, "restored", version)
    jsonschema.validate(exported, schema(version))
    assert exported["parent_id"] == "restored"
    assert without_envelope(exported) == without_envelope(document)


async def test_v1_restores_as_succeeded_history_with_empty_outcome(db: Database) -> None:
    result = await restore(db, "p1", fixture("v1.json"))
    rows = await requests_of(db, "p1")
    assert [r.ordinal for r in rows] == [1, 2, 4]
    assert {r.status for r in rows} == {"succeeded"}
    assert rows[2].answer == "Zwei: billing/invoice.py und billing/tests/test_invoice.py."
    assert rows[0].usage == empty_usage() and rows[0].context_info == {} and rows[0].error is None
    assert rows[0].created_at == datetime(2026, 11, 20, 8, 1, 12, 250000, tzinfo=UTC)
    owner = await session_row(db, "p1")
    assert owner is not None and owner.memory == empty_memory()
    assert result.next_ordinal == owner.next_ordinal == 5


async def test_v2_restores_status_error_usage_and_timings(db: Database) -> None:
    document = fixture("v2.json")
    await restore(db, "p2", document)
    rows = await requests_of(db, "p2")
    assert [(r.ordinal, r.status) for r in rows] == [(1, "succeeded"), (2, "failed"), (3, "cancelled")]
    assert rows[1].error == document["questions"][1]["error"]
    assert rows[0].usage == document["questions"][0]["usage"]
    assert rows[0].model == "gpt-4.1-mini" and rows[0].snapshot_id == "s-1" and rows[0].stop_reason == "stop"
    assert rows[2].started_at is None
    assert rows[0].context_info == {}


async def test_v3_restores_memory_and_context_info(db: Database) -> None:
    document = fixture("v3.json")
    await restore(db, "p3", document)
    owner = await session_row(db, "p3")
    assert owner is not None and owner.memory == document["session"]["memory"]
    rows = await requests_of(db, "p3")
    assert rows[1].context_info == document["questions"][1]["context_info"]
    assert rows[1].truncated is True and rows[1].stop_reason == "length"


async def test_v3_missing_newer_fields_restores_with_empty_objects(db: Database) -> None:
    document = fixture("v3-minimal.json")
    jsonschema.validate(document, schema(3))
    await restore(db, "p", document)
    owner = await session_row(db, "p")
    assert owner is not None and owner.memory == empty_memory() and owner.next_ordinal == 8
    (row,) = await requests_of(db, "p")
    assert row.context_info == {} and row.usage == empty_usage() and row.error is None
    exported = await export(db, "p")
    assert exported["session"] == {
        "memory": empty_memory(),
        "handoffs": [],
        "handed_off_through": 0,
        "settings": dict.fromkeys(
            (
                "summary_instructions",
                "summary_model",
                "answer_model",
                "context_window",
                "max_output_tokens",
                "on_busy",
                "mask_tool_results",
            )
        ),
    }
    assert exported["questions"][0]["context_info"] == {}
    assert exported["questions"][0]["created_at"] == "2026-11-28T12:00:00.000000Z"


# ------------------------------------------------------------------ round trips from live sessions


@pytest.mark.parametrize("version", [1, 2, 3])
async def test_export_restore_export_is_identical_apart_from_parent_and_time(
    db: Database, version: int
) -> None:
    await live_session(db, "origin")
    first = await export(db, "origin", version)
    jsonschema.validate(first, schema(version))
    await restore(db, "copy", json.loads(json.dumps(first)))
    second = await export(db, "copy", version)
    assert second["parent_id"] == "copy"
    assert without_envelope(second) == without_envelope(first)


async def test_export_holds_finished_visible_requests_without_ids(db: Database) -> None:
    await live_session(db, "origin")
    v3 = await export(db, "origin", 3)
    assert [q["ordinal"] for q in v3["questions"]] == [3, 4, 5, 6]
    assert all("id" not in q for q in v3["questions"])
    # Not even in an error: the request that superseded #5 is named by its ordinal (SPEC §10).
    async with db.sessions() as session:
        ids = [str(i) for i in await session.scalars(select(RequestRow.id))]
    assert not any(i in json.dumps(v3) for i in ids)
    assert v3["questions"][2]["error"]["detail"] == {"superseded_by_ordinal": 8}
    assert v3["session"]["memory"]["qa_summary"]["document"] == {"objective": "ö"}
    v1 = await export(db, "origin", 1)
    # v1 restores as succeeded history, so it may only hold succeeded requests.
    assert [q["ordinal"] for q in v1["questions"]] == [3, 6]
    assert set(v1["questions"][0]) == {"ordinal", "question", "answer", "created_at"}


async def test_restored_requests_get_fresh_ids_session_clear_version_and_terminal_events(
    db: Database,
) -> None:
    await live_session(db, "origin")
    origin_ids = {r.id for r in await requests_of(db, "origin")}
    await restore(db, "copy", await export(db, "origin"))
    rows = await requests_of(db, "copy")
    assert not origin_ids & {r.id for r in rows}
    owner = await session_row(db, "copy")
    assert owner is not None and {r.clear_version for r in rows} == {owner.clear_version} == {0}
    async with db.sessions() as session:
        events = list(
            await session.scalars(
                select(EventRow).where(EventRow.session_id == owner.id).order_by(EventRow.id)
            )
        )
    by_request: dict[uuid.UUID | None, list[tuple[int | None, str]]] = {}
    for event in events:
        by_request.setdefault(event.request_id, []).append((event.seq, event.type))
    expected = {"succeeded": "done", "failed": "error", "cancelled": "error"}
    for row in rows:
        assert by_request[row.id] == [(1, "status"), (2, expected[row.status])]
        assert row.event_seq == 2
    done = next(e for e in events if e.type == "done")
    assert done.data["record"]["answer"] == "three" and done.data["record"]["parent_id"] == "copy"
    failed = next(e for e in events if e.type == "error" and e.data["code"] == "timeout")
    assert failed.data["seq"] == 2 and failed.data["ordinal"] == 4


# ------------------------------------------------------------------ ordinals


async def test_next_question_continues_after_the_highest_restored_ordinal(db: Database) -> None:
    await restore(db, "p", fixture("v1.json"))
    admitted = await admit(db, TENANT, "p", Admission(question="next?"), max_queued=20)
    assert admitted.record["ordinal"] == 5


async def test_restore_into_a_cleared_session_keeps_archive_ordinals_and_never_lowers_next(
    db: Database,
) -> None:
    for i in range(6):
        await admit(db, TENANT, "p", Admission(question=f"q{i}"), max_queued=20)
    async with db.sessions() as session, session.begin():
        await clear_session(session, TENANT, "p")
    result = await restore(db, "p", fixture("v1.json"))
    assert [r.ordinal for r in await requests_of(db, "p") if r.deleted_at is None] == [1, 2, 4]
    # Ordinals 1..6 were handed out before the clear; new questions keep counting after them.
    assert result.next_ordinal == 7
    assert result.clear_version == 1


# ------------------------------------------------------------------ refusals write nothing


async def test_restore_into_a_session_with_history_is_refused_without_replace(db: Database) -> None:
    await restore(db, "p", fixture("v3.json"))
    before = await export(db, "p")
    counts = await table_counts(db)
    with pytest.raises(SessionHasHistory) as refused:
        await restore(db, "p", fixture("v2.json"))
    assert refused.value.status == 409 and "mode=replace" in refused.value.message
    assert await table_counts(db) == counts
    assert without_envelope(await export(db, "p")) == without_envelope(before)


async def test_replace_discards_old_history_and_bumps_clear_version(db: Database) -> None:
    await restore(db, "p", fixture("v3.json"))
    result = await restore(db, "p", fixture("v1.json"), replace=True)
    assert result.replaced == 2 and result.restored == 3 and result.clear_version == 1
    exported = await export(db, "p", 3)
    assert [q["ordinal"] for q in exported["questions"]] == [1, 2, 4]
    assert exported["session"]["memory"] == empty_memory()
    rows = [r for r in await requests_of(db, "p") if r.deleted_at is None]
    assert {r.clear_version for r in rows} == {1}
    # The highest ordinal the session ever handed out was 2 (v3 fixture); the archive's is 4.
    assert result.next_ordinal == 5


async def test_replace_is_refused_while_requests_are_in_flight(db: Database) -> None:
    await admit(db, TENANT, "p", Admission(question="running?"), max_queued=20)
    counts = await table_counts(db)
    with pytest.raises(SessionBusy):
        await restore(db, "p", fixture("v1.json"), replace=True)
    assert await table_counts(db) == counts


async def test_a_failure_after_the_first_writes_rolls_everything_back(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_args: object) -> list[tuple[str, dict[str, Any]]]:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(archive_store, "_terminal_events", broken)
    with pytest.raises(RuntimeError):
        await restore(db, "p", fixture("v3.json"))
    assert await table_counts(db) == (0, 0, 0)


async def test_other_tenants_session_is_not_found_and_their_own_is_separate(db: Database) -> None:
    await restore(db, "p", fixture("v1.json"))
    with pytest.raises(SessionNotFound):
        await export(db, "p", tenant="other")
    await restore(db, "p", fixture("v2.json"), tenant="other")
    assert len((await export(db, "p", 2, tenant="other"))["questions"]) == 3
    assert len((await export(db, "p", 2))["questions"]) == 3


def _broken(mutate: Any) -> dict[str, Any]:
    document = copy.deepcopy(fixture("v3.json"))
    mutate(document)
    return document


# What each malformed archive is refused as: a 400 names what is wrong in its message; a 422 lists every
# problem with its location (the wording is pydantic's, not a contract), and the case's location leads.
MALFORMED: list[tuple[str, object, type[Exception], str]] = [
    ("not an object", [1, 2], ArchiveUnreadable, "JSON object"),
    (
        "no version",
        {"parent_id": "p", "questions": []},
        ArchiveUnreadable,
        "the archive has no version: supported",
    ),
    ("future version", {"version": 4, "parent_id": "p", "questions": []}, ArchiveUnreadable, "1, 2 and 3"),
    ("bool version", {"version": True, "parent_id": "p", "questions": []}, ArchiveUnreadable, "version"),
    ("questions not a list", {"version": 1, "parent_id": "p", "questions": {}}, ArchiveInvalid, "questions"),
    ("no parent_id", {"version": 1, "questions": []}, ArchiveInvalid, "parent_id"),
    ("unknown top key", _broken(lambda d: d.update(extra=1)), ArchiveInvalid, "extra"),
    ("v3 field in v1", {**fixture("v1.json"), "session": {}}, ArchiveInvalid, "session"),
    (
        "duplicate ordinal",
        _broken(lambda d: d["questions"][1].update(ordinal=1)),
        ArchiveInvalid,
        "questions[1].ordinal",
    ),
    (
        "a hand-off of an ordinal the archive lacks",
        _broken(lambda d: d["session"]["handoffs"][0].update(ordinals=[50], through_ordinal=50)),
        ArchiveInvalid,
        "session.handoffs[0]",
    ),
    (
        "a hand-off of a request that did not succeed",
        _broken(
            lambda d: (
                d["questions"][1].update(
                    status="failed", answer=None, pinned=False, error={"code": "x", "message": "y"}
                )
                or d["session"]["handoffs"][0].update(ordinals=[2], from_ordinal=2, through_ordinal=2)
            )
        ),
        ArchiveInvalid,
        "session.handoffs[0]",
    ),
    (
        "a hand-off summarising an ordinal the archive lacks",
        _broken(
            lambda d: d["questions"].pop(0) and d["session"]["handoffs"][0].update(summarized_ordinals=[1])
        ),
        ArchiveInvalid,
        "session.handoffs[0]",
    ),
    (
        "handed off beyond every ordinal",  # would hide the next questions from "new" hand-offs
        _broken(lambda d: d["session"].update(handed_off_through=999)),
        ArchiveInvalid,
        "session.handed_off_through",
    ),
    (
        "zero ordinal",
        _broken(lambda d: d["questions"][0].update(ordinal=0)),
        ArchiveInvalid,
        "questions[0].ordinal",
    ),
    (
        "string ordinal",
        _broken(lambda d: d["questions"][0].update(ordinal="1")),
        ArchiveInvalid,
        "questions[0].ordinal",
    ),
    (
        "huge ordinal",
        _broken(lambda d: d["questions"][0].update(ordinal=2**31)),
        ArchiveInvalid,
        "questions[0].ordinal",
    ),
    (
        "missing question",
        _broken(lambda d: d["questions"][0].pop("question")),
        ArchiveInvalid,
        "questions[0].question",
    ),
    (
        "queued status",
        _broken(lambda d: d["questions"][0].update(status="queued")),
        ArchiveInvalid,
        "questions[0].status",
    ),
    (
        "succeeded without answer",
        _broken(lambda d: d["questions"][0].update(answer=None)),
        ArchiveInvalid,
        "questions[0].answer",
    ),
    (
        "naive time",
        _broken(lambda d: d["questions"][0].update(created_at="2026-11-29T10:00:00")),
        ArchiveInvalid,
        "questions[0].created_at",
    ),
    (
        "bad time",
        _broken(lambda d: d["questions"][0].update(created_at="yesterday")),
        ArchiveInvalid,
        "questions[0].created_at",
    ),
    (
        "NUL in text",
        _broken(lambda d: d["questions"][0].update(question="a\x00b")),
        ArchiveInvalid,
        "questions[0].question",
    ),
    (
        "a failed request pinned",  # SPEC 11.1: only a succeeded request can be; restore would drop it
        _broken(
            lambda d: d["questions"][1].update(status="failed", error={"code": "timeout", "message": "m"})
        ),
        ArchiveInvalid,
        "questions[1].pinned",
    ),
    (
        "surrogate in usage",
        _broken(lambda d: d["questions"][0]["usage"]["calls"][0].update(model="\ud800")),
        ArchiveInvalid,
        "questions[0].usage.calls[0].model",
    ),
    (
        "NaN in context_info",
        _broken(lambda d: d["questions"][0]["context_info"].update(drift=float("nan"))),
        ArchiveInvalid,
        "questions[0].context_info.drift",
    ),
    (
        "negative tokens",
        _broken(lambda d: d["questions"][0]["usage"].update(input_tokens=-1)),
        ArchiveInvalid,
        "questions[0].usage.input_tokens",
    ),
    (
        "error without code",
        _broken(lambda d: d["questions"][1].update(error={"message": "x"})),
        ArchiveInvalid,
        "questions[1].error.code",
    ),
    (
        "memory not object",
        _broken(lambda d: d["session"].update(memory=[])),
        ArchiveInvalid,
        "session.memory",
    ),
    (
        "summary without key",
        _broken(lambda d: d["session"]["memory"]["context_summaries"][0].pop("key")),
        ArchiveInvalid,
        "session.memory.context_summaries[0].key",
    ),
    (
        "negative tokens in a call",
        _broken(lambda d: d["questions"][0]["usage"]["calls"][0].update(cached_tokens=-1)),
        ArchiveInvalid,
        "questions[0].usage.calls[0].cached_tokens",
    ),
    (
        "reported not a bool",
        _broken(lambda d: d["questions"][0]["usage"]["calls"][0].update(reported="yes")),
        ArchiveInvalid,
        "questions[0].usage.calls[0].reported",
    ),
    ("null exported_at", _broken(lambda d: d.update(exported_at=None)), ArchiveInvalid, "exported_at"),
    (
        "time without seconds",
        _broken(lambda d: d["questions"][0].update(created_at="2026-11-29T10:00Z")),
        ArchiveInvalid,
        "questions[0].created_at",
    ),
    (
        "status not a string",
        _broken(lambda d: d["questions"][0].update(status={})),
        ArchiveInvalid,
        "questions[0].status",
    ),
    (
        "before year 1 in UTC",
        _broken(lambda d: d["questions"][0].update(created_at="0001-01-01T00:00:00+12:00")),
        ArchiveInvalid,
        "questions[0].created_at",
    ),
    (
        "long model",
        _broken(lambda d: d["questions"][0].update(model="m" * 201)),
        ArchiveInvalid,
        "questions[0].model",
    ),
]


@pytest.mark.parametrize(("case", "document", "error", "where"), MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_malformed_archives_are_rejected_where_they_break_and_nothing_is_written(
    db: Database, case: str, document: object, error: type[Exception], where: str
) -> None:
    with pytest.raises(error) as refused:
        await restore(db, "p", document)
    assert isinstance(refused.value, ArchiveError) and refused.value.code == "invalid_archive"
    if isinstance(refused.value, ArchiveInvalid):
        assert refused.value.status == 422
        assert [e["loc"] for e in refused.value.detail["errors"]] == [where], case
        assert f" archive: {where} " in refused.value.message, case
    else:
        assert refused.value.status == 400 and where in refused.value.message, case
    assert await table_counts(db) == (0, 0, 0)


def test_invalid_archives_report_every_problem_with_its_location() -> None:
    document = _broken(lambda d: d["questions"][0].update(ordinal=-1, question=3))
    with pytest.raises(ArchiveInvalid) as refused:
        parse_archive(document)
    locs = [e["loc"] for e in refused.value.detail["errors"]]
    assert locs == ["questions[0].ordinal", "questions[0].question"]
    assert refused.value.status == 422


@pytest.mark.parametrize("body", [b"{", b"\xff\xfe", b"[" * 100_000])
def test_a_body_that_is_not_json_is_unreadable(body: bytes) -> None:
    with pytest.raises(ArchiveUnreadable) as refused:
        load_archive_json(body)
    assert refused.value.status == 400


def test_rfc3339_spellings_are_accepted() -> None:
    document = {
        "version": 1,
        "parent_id": "p",
        "questions": [
            {"ordinal": 1, "question": "q", "answer": "a", "created_at": "2016-12-31t23:59:60z"},
            {"ordinal": 2, "question": "q", "answer": "a", "created_at": "2026-11-29T12:00:00.5+02:00"},
        ],
    }
    first, second = parse_archive(document).requests
    # A leap second is the first instant of the next minute, as PostgreSQL reads it.
    assert first.created_at == datetime(2017, 1, 1, tzinfo=UTC)
    assert second.created_at == datetime(2026, 11, 29, 10, 0, 0, 500000, tzinfo=UTC)


def test_a_leap_second_past_year_9999_is_out_of_range_not_an_error() -> None:
    document = {
        "version": 1,
        "parent_id": "p",
        "questions": [{"ordinal": 1, "question": "q", "answer": "a", "created_at": "9999-12-31T23:59:60Z"}],
    }
    with pytest.raises(ArchiveInvalid) as refused:
        parse_archive(document)
    assert refused.value.status == 422
    assert [e["loc"] for e in refused.value.detail["errors"]] == ["questions[0].created_at"]


@pytest.mark.parametrize("body", [b'{"version": 1e400, "parent_id": "p", "questions": []}', b"[-1e999]"])
def test_a_number_beyond_a_double_makes_the_archive_unreadable(body: bytes) -> None:
    """Python would read it as an infinity, which an error's own detail could not even be written with."""
    with pytest.raises(ArchiveUnreadable, match="beyond the range of a 64-bit float") as refused:
        load_archive_json(body)
    assert refused.value.status == 400


def test_integral_numbers_count_as_integers_as_in_json_schema() -> None:
    document = _broken(lambda d: d.update(version=3.0))
    document["questions"][0]["ordinal"] = 5.0
    document["session"]["handoffs"][0].update(ordinals=[5.0], from_ordinal=5.0, through_ordinal=5)
    archive = parse_archive(document)
    assert archive.version == 3 and [r.ordinal for r in archive.requests] == [2, 5]
    assert isinstance(archive.requests[1].ordinal, int)
    with pytest.raises(ArchiveInvalid):
        parse_archive(_broken(lambda d: d["questions"][0].update(ordinal=1.5)))


async def test_early_years_export_with_four_digits(db: Database) -> None:
    document = {
        "version": 1,
        "parent_id": "p",
        "questions": [{"ordinal": 1, "question": "q", "answer": "a", "created_at": "0002-01-01T00:00:01Z"}],
    }
    await restore(db, "p", document)
    exported = await export(db, "p", 1)
    assert exported["questions"][0]["created_at"] == "0002-01-01T00:00:01.000000Z"
    jsonschema.validate(exported, schema(1), format_checker=jsonschema.FormatChecker())


async def test_restore_writes_the_archives_set_settings_and_clears_none(db: Database) -> None:
    """SPEC 11.2: settings are cleared by nothing but PUT — an archive's null (unset) fields leave the
    target session's own as they are; its set fields are written."""
    async with db.sessions() as session, session.begin():
        await update_settings(
            session, TENANT, "t", SessionSettingsIn(on_busy="reject", summary_model="cheap")
        )
    document = fixture("v3-minimal.json")
    document.setdefault("session", {})["settings"] = {
        **dict.fromkeys(("summary_instructions", "summary_model", "context_window", "max_output_tokens")),
        "answer_model": "big",
        "on_busy": "interrupt",
    }
    await restore(db, "t", document)
    async with db.sessions() as session:
        settings = await read_settings(session, TENANT, "t")
    assert settings is not None
    assert (settings["summary_model"], settings["answer_model"], settings["on_busy"]) == (
        "cheap",
        "big",
        "interrupt",
    )


async def test_a_restored_error_naming_a_request_id_keeps_no_id(db: Database) -> None:
    """An archive written before errors named ordinals may hold a superseded request's id: restored,
    it would name a request of another session, so it is left out (SPEC §10: no request ids)."""
    document = _broken(
        lambda d: d["questions"][1].update(
            status="cancelled",
            answer=None,
            pinned=False,
            error={
                "code": "superseded",
                "message": "s",
                "detail": {"superseded_by": str(uuid.uuid4()), "x": 1},
            },
        )
    )
    await restore(db, "p", document)
    exported = await export(db, "p", 3)
    assert exported["questions"][1]["error"]["detail"] == {"x": 1}


async def test_an_error_naming_a_request_by_something_not_an_id_still_exports(db: Database) -> None:
    """A stored error may hold any text as superseded_by (an archive restored without checking ids);
    the export's lookup of those ids must not fail on it with a 500."""
    await live_session(db, "origin")
    async with db.sessions() as session, session.begin():
        row = await session.scalar(select(RequestRow).where(RequestRow.ordinal == 5))
        assert row is not None
        row.error = {"code": "superseded", "message": "c", "detail": {"superseded_by": "not-a-uuid"}}
    exported = await export(db, "origin", 3)
    assert exported["questions"][2]["error"]["detail"] == {}
